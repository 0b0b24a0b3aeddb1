"""The component errors are measured, not set: each level from the held-out predictions of its own fold kind, and
the shipped file is what the recorded results give."""

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from figures import read_results

from trainsim.uncertainty.interval import COMPONENT_ERRORS, MAPE_TO_SPREAD
from trainsim.uncertainty.measured_errors import component_table, compute_errors, scored_folds

RESULTS = COMPONENT_ERRORS.parents[3] / "benchmarks" / "results"


def predictions(**columns) -> pd.DataFrame:
    n = len(columns["held_out"])
    base = {"table": [f"t{i % 3}" for i in range(n)], "label": [f"r{i}" for i in range(n)], "model": "llama3-8b",
            "family": "Llama", "gpu": "H100", "hardware": "h100-sxm-dgx", "framework": [f"f{i % 3}" for i in range(n)],
            "params_from": "fit"}
    return pd.DataFrame({**base, **columns})


def test_each_fold_kind_measures_its_level():
    frame = predictions(held_out=["row", "row", "table", "table", "table", "gpu", "gpu", "table"],
                        measured_s=[1.0, 1.0, 1.1, 1.2, 1.0, 2.0, 1.0, 1.0],
                        predicted_s=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                        params_from=["fit", "fit", "fit", "fit", "start", "other GPUs", "other GPUs",
                                     "carried from H100"])
    folds = scored_folds(frame)
    # the data-free 'start' row measures no level a run gets; a carried fit is what an unfitted GPU's config runs
    assert list(folds["level"]) == ["fitted", "fitted", "unseen_framework", "unseen_framework", "unseen_gpu",
                                    "unseen_gpu", "unseen_gpu"]
    errors = compute_errors(frame)
    assert errors["fitted"]["spread"] == 0 and errors["fitted"]["count"] == 2
    assert errors["unseen_framework"]["bias"] == pytest.approx(np.mean(np.log([1.1, 1.2])), abs=1e-4)
    assert errors["unseen_gpu"]["spread"] == pytest.approx(np.std(np.log([2.0, 1.0, 1.0]), ddof=1), abs=1e-4)
    # a table whose framework another table of its GPU shares (another release of the same recipes) is 'fitted'
    shared = frame.assign(framework="megatron-bridge")
    assert list(scored_folds(shared)["level"])[2:4] == ["fitted", "fitted"]


def test_a_mean_absolute_error_figure_becomes_a_spread():
    frame = predictions(held_out=["row", "row"], measured_s=[1.0, 1.1], predicted_s=[1.0, 1.0])
    table = component_table(frame, {"comm_mape_pct_large_all": 10.0, "comm_mape_pct_alltoall": 20.0},
                            {"e2e_error_pct_local_single": 2.0, "e2e_error_pct_local_dp2": 4.0})
    components = table["components"]
    assert components["collectives"]["calibrated"]["spread"] == pytest.approx(0.1 * MAPE_TO_SPREAD, abs=1e-4)
    assert components["alltoall"]["calibrated"]["spread"] == pytest.approx(0.2 * math.sqrt(math.pi / 2), abs=1e-4)
    assert components["compute"]["measured"]["count"] == 2
    assert "uncalibrated" not in components["collectives"]  # no figure, no level: never a guessed one


def test_shipped_errors_are_the_recorded_results():
    recorded = pd.read_csv(RESULTS / "generalisation_predictions.csv")

    def numbers(script):
        return {k: float(v["value"]) for k, v in read_results(script).items()
                if isinstance(v.get("value"), int | float)}

    fresh = component_table(recorded, numbers("comm_accuracy"), numbers("e2e_accuracy"))
    assert yaml.safe_load(COMPONENT_ERRORS.read_text()) == fresh, \
        "component_errors.yaml differs from the recorded results: python benchmarks/uncertainty.py --write"
