"""The slowdown model's features are the same at training and at compose, and work for an unseen GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainsim.artifacts import atomic_artifact
from trainsim.config import compose_run
from trainsim.config.data_path import DATA_DIR
from trainsim.config.schema import SlowdownModelConfig
from trainsim.errors import ArtifactError
from trainsim.slowdown.a100_import import DEVICE_NUMBERS, import_echo_csv
from trainsim.slowdown.dataset import METRIC_COLUMNS, STATUS_OK
from trainsim.slowdown.features import (
    DEVICE_COLUMNS,
    FEATURES,
    DeviceNumbers,
    dataset_features,
    device_numbers,
    overlap_features,
)
from trainsim.slowdown.predictor import SlowdownPredictor, save_model
from trainsim.slowdown.train import SCHEMA_VERSION, grouped_cv, kernel_groups, train_slowdown_model
from trainsim.timeline.costs import PredictorSlowdown

A100_CSV = DATA_DIR / "overlap-slowdown/echo_gpt2_ddp_2gpu_a100_kernel_overlap_slowdown.csv"
ROOT = Path(__file__).resolve().parents[2]
FAST = SlowdownModelConfig(n_estimators=30, max_depth=6, nthread=1)


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return import_echo_csv(A100_CSV, "a100-80g-dgx").rows


@pytest.fixture(scope="module")
def hardware():
    return {name: compose_run([f"hardware={name}"]).hardware for name in ("a100-80g-dgx", "h100-sxm-dgx")}


@pytest.fixture(scope="module")
def result(rows):
    return train_slowdown_model(rows, FAST)


def _compose_inputs(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the composer hands the slowdown model (timeline/overlap.py): compute op rows and comm rows."""
    compute = pd.DataFrame({"op": rows["op"], "flops": rows["flops"], "bytes_moved": rows["bytes_moved"],
                            "duration_s": rows["solo_duration_s"]})
    comm = pd.DataFrame({"collective": rows["collective"], "message_bytes": rows["message_bytes"],
                         "num_ranks": rows["num_ranks"]})
    return compute, comm


class Recording:
    """A predictor that keeps the feature frame the composer's adapter built."""

    def predict(self, features: pd.DataFrame) -> np.ndarray:
        self.features = features
        return np.zeros(len(features))


def test_training_and_compose_build_identical_features(rows, hardware):
    targets = rows[rows["status"] == STATUS_OK].reset_index(drop=True)
    training = dataset_features(targets)  # what train_slowdown_model fits on
    recording = Recording()
    compute, comm = _compose_inputs(targets)
    PredictorSlowdown(recording, device_numbers(hardware["a100-80g-dgx"])).slowdown(compute, comm)
    pd.testing.assert_frame_equal(training, recording.features)
    assert list(training.columns) == list(FEATURES)
    # the utilisation features are the measured Nsight fractions (the reconstruction's bandwidth cancels)
    assert np.allclose(training["memory_bandwidth_fraction"], targets["dram_throughput_pct"] / 100, equal_nan=True)
    matmul = (training["op_kind"] == "matmul").to_numpy()
    assert matmul.sum() >= 40  # 45 of the 404 overlapped kernels are GEMMs
    assert np.allclose(training["compute_fraction"][matmul], targets["compute_throughput_pct"][matmul] / 100)
    assert training["compute_fraction"][~training["op_kind"].isin(["matmul", "attention"])].isna().all()


def test_trained_model_predicts_the_same_from_compose_inputs(rows, result, hardware, tmp_path):
    out = tmp_path / "model"
    with atomic_artifact(out, stage="slowdown_model", config={}, config_keys={"hardware": "a100"}) as tmp:
        save_model(result, tmp)
    predictor = SlowdownPredictor.load(out)
    holdout = result.predictions[result.predictions["split"] == "holdout"]
    part = rows.set_index("instance_id").loc[holdout["instance_id"]].reset_index()
    compute, comm = _compose_inputs(part)
    s = PredictorSlowdown(predictor, device_numbers(hardware["a100-80g-dgx"])).slowdown(compute, comm)
    assert np.allclose(s, holdout["predicted_slowdown"])
    assert predictor.last_unknown_categories == dict.fromkeys(predictor.categories, 0)


def test_nsight_metrics_stay_in_the_dataset_but_are_not_model_inputs(rows, result):
    assert set(METRIC_COLUMNS) <= set(rows.columns) and rows[list(METRIC_COLUMNS)].notna().all().all()
    assert not set(METRIC_COLUMNS) & set(result.schema["feature_names"])
    assert "device_type" not in result.schema["feature_names"] and set(DEVICE_COLUMNS) <= set(FEATURES)


def test_importer_device_numbers_are_the_hardware_configs(hardware):
    for sm, name in ((108, "a100-80g-dgx"), (132, "h100-sxm-dgx")):
        config = device_numbers(hardware[name])
        assert DEVICE_NUMBERS[sm].columns() == config.columns(), name


def test_an_unseen_gpu_gets_a_finite_slowdown_in_the_training_range(rows, result, hardware):
    """H100 numbers were never in the training data: the prediction must come from the same trained
    branches (utilisation features), not collapse to ~0 as an unknown device-type category did."""
    predictor = SlowdownPredictor(result.booster, result.schema)
    targets = rows[rows["status"] == STATUS_OK].reset_index(drop=True)
    a100, h100 = device_numbers(hardware["a100-80g-dgx"]), device_numbers(hardware["h100-sxm-dgx"])
    assert h100.sm_count not in set(targets["device_sm_count"])
    compute, comm = _compose_inputs(targets)
    s_a100 = predictor.predict(overlap_features(compute, comm, a100))
    # the same kernels on the H100: memory-bound ones faster by the bandwidth ratio, GEMMs by the fp32 peaks'
    faster = np.where(compute["op"].str.contains("gemm"), a100.vector_flops_per_s / h100.vector_flops_per_s,
                      a100.memory_bandwidth_bytes_per_s / h100.memory_bandwidth_bytes_per_s)
    s_h100 = predictor.predict(overlap_features(compute.assign(duration_s=compute["duration_s"] * faster), comm, h100))
    assert np.isfinite(s_h100).all() and (s_h100 >= 0).all()
    assert s_h100.max() <= targets["slowdown"].max()
    assert s_h100.mean() > 0.5 * s_a100.mean() > 0, (s_h100.mean(), s_a100.mean())
    assert predictor.last_unknown_categories == dict.fromkeys(predictor.categories, 0)


def test_device_numbers_of_a_cpu_are_unknown_not_zero(hardware):
    cpu = dataclasses.replace(hardware["a100-80g-dgx"], device_kind="cpu", peak_flops_per_s={},
                              memory_bandwidth_bytes_per_s=0.0, sm_count=0)
    numbers = device_numbers(cpu)
    assert all(np.isnan(v) for v in numbers.columns().values())
    features = overlap_features(pd.DataFrame({"op": ["aten::mm"], "flops": [1e9], "bytes_moved": [1e6],
                                              "duration_s": [1e-3]}),
                                pd.DataFrame({"collective": ["all_reduce"], "message_bytes": [1e6], "num_ranks": [2]}),
                                numbers)
    assert features[["memory_bandwidth_fraction", "compute_fraction"]].isna().all().all()
    # a bf16 GEMM beyond the fp32 pipe's peak is a fraction of the tensor-core peak
    gpu = DeviceNumbers(108, 2.039e12, 19.5e12, 312e12)
    fast = overlap_features(pd.DataFrame({"op": ["aten::mm"], "flops": [1e12], "bytes_moved": [1e8],
                                          "duration_s": [4e-3]}),
                            pd.DataFrame({"collective": ["all_reduce"], "message_bytes": [1e6], "num_ranks": [2]}), gpu)
    assert fast["compute_fraction"].iloc[0] == pytest.approx(1e12 / 4e-3 / 312e12)


def test_old_dataset_and_old_model_are_refused_with_a_clear_message(rows, result, tmp_path):
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['device_sm_count'.*re-run the slowdown_dataset"):
        dataset_features(rows.drop(columns=list(DEVICE_COLUMNS)))
    old = dataclasses.replace(result, schema={**result.schema, "schema_version": SCHEMA_VERSION - 1})
    out = tmp_path / "old"
    with atomic_artifact(out, stage="slowdown_model", config={}, config_keys={"hardware": "a100"}) as tmp:
        save_model(old, tmp)
    with pytest.raises(ArtifactError, match=rf"schema_version {SCHEMA_VERSION - 1}, this trainsim reads "
                                            rf"{SCHEMA_VERSION}.*re-run the slowdown_dataset and slowdown_model"):
        SlowdownPredictor.load(out)
    with pytest.raises(ValueError, match="'solo_duration_s' has value -1.0"):
        SlowdownPredictor(result.booster, result.schema).predict(dataset_features(rows).assign(solo_duration_s=-1.0))


def test_grouped_cross_validation_never_splits_a_kernel_group(rows):
    out = grouped_cv(rows, dataclasses.replace(FAST, n_estimators=5))
    assert len(out) == int((rows["status"] == STATUS_OK).sum())
    assert (out.groupby("group")["fold"].nunique() == 1).all() and out["fold"].nunique() == 5
    assert np.isfinite(out["predicted_slowdown"]).all()
    groups = kernel_groups(rows)
    same = rows["kernel_name"].iloc[0] == rows["kernel_name"]
    assert len(set(groups[same.to_numpy()])) >= 1 and len(set(groups)) < len(rows)
