"""System noise: the expected-maximum factor, the fit, the local measurement and its use by the composer."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from trainsim.comm.model import CommModel
from trainsim.comm.noise import SystemNoise, expected_max_std_normal, fit_noise, measure_local
from trainsim.config import compose_run


def test_expected_maximum_of_standard_normals():
    assert expected_max_std_normal(1) == 0.0
    assert expected_max_std_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_std_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    values = [expected_max_std_normal(n) for n in (2, 4, 8, 64, 1024)]
    assert np.all(np.diff(values) > 0) and values[-1] == pytest.approx(3.2414, abs=0.01)


def test_fit_recovers_a_power_law_and_grows_like_sqrt_beyond_the_measured_range():
    truth = SystemNoise(scale=0.05, exponent=0.8, max_segment_s=1.0)
    segments = np.array([0.01, 0.05, 0.25, 1.0])
    table = pd.DataFrame({"segment_s": segments,
                          "mean_abs_difference_s": [2 / math.sqrt(math.pi) * truth.sigma_s(t) for t in segments]})
    fitted = fit_noise(table)
    assert fitted.scale == pytest.approx(0.05, rel=1e-6) and fitted.exponent == pytest.approx(0.8, rel=1e-6)
    assert fitted.max_segment_s == 1.0
    assert fitted.sigma_s(4.0) == pytest.approx(0.05 * 2.0)
    assert fitted.sync_wait_s(0.25, 2) == pytest.approx(truth.sigma_s(0.25) / math.sqrt(math.pi))
    assert fitted.sync_wait_s(0.25, 1) == 0.0 and fitted.sync_wait_s(0.0, 8) == 0.0
    with pytest.raises(ValueError, match="two segment lengths"):
        fit_noise(table.head(1))


def test_local_measurement_times_the_same_work_on_two_ranks():
    table = measure_local(segments=(0.004, 0.02), seconds_per_segment=0.2)
    assert list(table["num_ranks"]) == [2, 2] and (table["repeats"] >= 8).all()
    assert table["segment_s"].iloc[0] == pytest.approx(0.004, rel=1.0)
    assert table["segment_s"].iloc[1] > table["segment_s"].iloc[0]
    assert (table["mean_abs_difference_s"] > 0).all() and (table["relative_sd"] >= 0).all()
    fit_noise(table)  # usable as measured


def test_calibration_carries_the_noise_model_to_the_comm_model(tmp_path):
    from trainsim.comm.calibration import write_calibration_artifact

    hw = compose_run(["hardware=local-cpu"]).hardware
    measured = pd.DataFrame({"segment_s": [0.01, 0.1], "mean_abs_difference_s": [0.001, 0.01],
                             "relative_sd": [0.1, 0.1], "repeats": [10, 10], "num_ranks": [2, 2]})
    sweep = lambda hw: pd.DataFrame({"collective": ["all_reduce"] * 4, "algorithm": "gloo", "protocol": "gloo",  # noqa: E731
                                     "num_ranks": 2, "num_nodes": 1, "message_bytes": [1024, 4096, 16384, 65536],
                                     "time_s": [1e-4, 1.2e-4, 2e-4, 5e-4], "source": "test"})
    fit = write_calibration_artifact(hw, {"hardware": "local-cpu"}, tmp_path / "cal", sweep=sweep,
                                     noise=lambda: measured)
    assert fit["system_noise"]["model"]["exponent"] == pytest.approx(1.0)
    model = CommModel.load(tmp_path / "cal", hw)
    sigma = math.sqrt(math.pi) / 2 * 0.01  # at the measured 0.1 s
    assert model.sync_wait_s(0.1, 2) == pytest.approx(sigma / math.sqrt(math.pi))
    assert "system noise" in model.source
    stored = json.loads((tmp_path / "cal" / "fit.json").read_text())
    assert len(stored["system_noise"]["measurements"]) == 2

    hw.calibration.system_noise = False
    fit = write_calibration_artifact(hw, {"hardware": "local-cpu"}, tmp_path / "off", sweep=sweep,
                                     noise=lambda: pytest.fail("noise measured although switched off"))
    assert "system_noise" not in fit and CommModel.load(tmp_path / "off", hw).sync_wait_s(1.0, 2) == 0.0
