"""Overlap-slowdown dataset (import, local measurement), XGBoost training and the predictor API."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainsim.artifacts import atomic_artifact
from trainsim.config import compose_run
from trainsim.config.data_path import DATA_DIR
from trainsim.config.devices import device_type_of
from trainsim.config.schema import SlowdownConfig, SlowdownModelConfig
from trainsim.errors import ConfigError
from trainsim.slowdown.a100_import import import_echo_csv
from trainsim.slowdown.dataset import SLOWDOWN_SCHEMA, check_instances, to_table
from trainsim.slowdown.features import FEATURES, DeviceNumbers, dataset_features
from trainsim.slowdown.predictor import (
    ConstantSlowdownPredictor,
    SlowdownPredictor,
    overlap_features,
    save_model,
    stretched_duration,
)
from trainsim.slowdown.stage import build_dataset, write_dataset_artifact, write_model_artifact
from trainsim.slowdown.train import HELD_OUT_GROUPS, train_slowdown_model
from trainsim.timeline.costs import NoSlowdown, PredictorSlowdown
from trainsim.timeline.provenance import slowdown_inputs
from trainsim.timeline.stage import slowdown_model

A100_CSV = DATA_DIR / "overlap-slowdown/echo_gpt2_ddp_2gpu_a100_kernel_overlap_slowdown.csv"


@pytest.fixture(scope="module")
def a100() -> pd.DataFrame:
    return import_echo_csv(A100_CSV, "a100-80g-dgx").rows


@pytest.fixture(scope="module")
def a100_result(a100):
    return train_slowdown_model(a100, SlowdownModelConfig())


@pytest.fixture(scope="module")
def model_dir(a100_result, tmp_path_factory) -> Path:
    return _model_artifact(a100_result, tmp_path_factory.mktemp("models") / "a100")


def _csv_with(tmp_path: Path, edits: dict[int, dict[str, str]], rows: int = 12) -> Path:
    """The first `rows` data rows of the A100 CSV with some fields replaced (row index -> {field: value})."""
    lines = A100_CSV.read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    frame = pd.read_csv(A100_CSV, comment="#", dtype=str, keep_default_na=False).head(rows)
    for index, fields in edits.items():
        for name, value in fields.items():
            frame.loc[index, name] = value
    path = tmp_path / "edited.csv"
    path.write_text("\n".join(comments) + "\n" + frame.to_csv(index=False))
    return path


def test_importer_maps_every_row_of_the_a100_csv():
    result = import_echo_csv(A100_CSV, "a100-80g-dgx")
    rows = result.rows
    assert len(rows) == 619 and result.skipped == {"nan_timing": 0, "negative_timing": 0, "fraction_out_of_range": 0}
    assert (rows["status"] == "ok").sum() == 404 and (rows["status"] == "zero_overlap").sum() == 215
    assert result.slowdown_mismatch == 0  # the file's slowdown column equals the one recomputed from its timings
    assert result.header == {"message_bytes": 2 * 2**20, "num_ranks": 2}  # parsed from the comment header
    first = rows.iloc[0]
    assert first["solo_duration_s"] == pytest.approx(68257e-9)  # ns in the file, seconds here
    assert first["overlapped_duration_s"] == pytest.approx(70656e-9)
    assert first["device_type"] == "A100" and first["op_kind"] == "normalization"
    assert set(rows["op_kind"][rows["op"].str.contains("sgemm")]) == {"matmul"}
    assert to_table(rows).schema == SLOWDOWN_SCHEMA


def test_importer_counts_bad_rows_instead_of_dropping_or_propagating_nan(tmp_path):
    path = _csv_with(tmp_path, {0: {"ground_truth": ""}, 1: {"duration": "-5"}, 2: {"overlap_ratio": "1.5"},
                                3: {"ground_truth": "0"}})
    result = import_echo_csv(path, "a100-80g-dgx")
    assert result.skipped == {"nan_timing": 1, "negative_timing": 2, "fraction_out_of_range": 1}
    assert result.skipped_ids == ["echo:1", "echo:2", "echo:3", "echo:4"]
    assert len(result.rows) == 12 - 4
    assert result.rows[["solo_duration_s", "overlapped_duration_s", "slowdown"]].notna().all().all()


def test_importer_names_file_line_field_and_value_of_a_malformed_number(tmp_path):
    path = _csv_with(tmp_path, {4: {"duration": "fast"}})
    with pytest.raises(ValueError, match=r"edited\.csv:\d+: field 'duration' has value 'fast'"):
        import_echo_csv(path, "a100-80g-dgx")
    frame = pd.read_csv(A100_CSV, comment="#").drop(columns=["L2 hit rate"]).head(3)
    frame.to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(ValueError, match=r"short\.csv: missing column\(s\) \['L2 hit rate'\]"):
        import_echo_csv(tmp_path / "short.csv", "a100-80g-dgx", message_bytes=1.0, num_ranks=2)


def test_zero_overlap_is_counted_and_never_a_target():
    rows = pd.DataFrame({"solo_duration_s": [1.0, 1.0, 1.0, np.nan], "overlapped_duration_s": [1.5, 1.2, 1.0, 1.0],
                         "overlap_fraction": [0.5, 0.0, 1.0, 1.0]})
    valid, counts, invalid = check_instances(rows)
    assert counts["nan_timing"] == 1 and len(invalid) == 1
    assert list(valid["status"]) == ["ok", "zero_overlap", "ok"]
    assert list(valid["slowdown"]) == [1.0, 0.0, 0.0]  # (1.5 - 1) / (0.5 * 1); zero overlap: 0, not NaN


def test_model_is_scored_against_no_slowdown_on_unseen_kernel_groups(a100, a100_result):
    """The figure hardware.slowdown.use=auto decides on, at the level benchmarks/slowdown_accuracy.py measures:
    every overlapped kernel predicted by a model that never saw its kernel group, against s = 0 for the same
    kernels; and the model never trains on a kernel group it is scored on."""
    metrics = a100_result.metrics
    assert metrics["rows"] == {"ok": 404, "zero_overlap": 215, "targets": 404, "train": 323, "holdout": 81}
    scores = metrics[HELD_OUT_GROUPS]
    assert scores["kernels"] == 404 and scores["folds"] == 5 and scores["groups"] >= 50
    targets = a100[a100["status"] == "ok"]
    error = (targets["solo_duration_s"] / targets["overlapped_duration_s"] - 1).abs()  # what s = 0 predicts
    assert scores["none"]["within_10_pct"] == pytest.approx(100 * (error < 0.10).mean())
    # deterministic on fixed public data: Echo's settings on unseen kernel groups, measured 2026-11-28 at 54.2 %
    # within 10 % (summed -0.6 %); a regression of the method fails here
    assert scores["model"]["within_10_pct"] >= 50.0 and abs(scores["model"]["summed_error_pct"]) < 3.0
    # ... and they lose to no slowdown (71.0 %), so hardware.slowdown.use=auto composes without the model. The day
    # a change makes the model win, this line fails: the default flips, and docs/slowdown.md must say so.
    assert scores["model"]["within_10_pct"] < scores["none"]["within_10_pct"]
    importances = a100_result.importances
    assert set(importances["feature"]) == set(FEATURES) and importances["gain_share"].sum() == pytest.approx(1.0)


def _with_use(hw, use: str):
    return dataclasses.replace(hw, slowdown=dataclasses.replace(hw.slowdown, use=use))


def _model_artifact(result, directory: Path) -> Path:
    with atomic_artifact(directory, stage="slowdown_model", config={}, config_keys={"hardware": "a100"}) as tmp:
        save_model(result, tmp)
    return directory


def test_auto_composes_without_the_model_where_it_loses_to_no_slowdown(model_dir, a100, a100_result):
    """The real A100 data and Echo's settings: the model loses on unseen kernel groups, so the compose stage's
    slowdown (the function every accuracy benchmark composes with too) is none, and its provenance says why."""
    hw = compose_run(["hardware=a100-80g-dgx"]).hardware
    assert hw.slowdown.use == "auto"  # the default
    assert isinstance(slowdown_model(hw, model_dir), NoSlowdown)
    inputs, warnings = slowdown_inputs(hw, model_dir, "A100")
    scores = a100_result.metrics[HELD_OUT_GROUPS]
    assert not inputs["modelled"] and inputs["use"] == "auto" and warnings == []
    assert inputs["choice"].startswith("overlap slowdown: none (auto: XGBoost ")
    assert f"none {scores['none']['within_10_pct']:.0f} %" in inputs["choice"]
    # use=model applies it regardless (and says so); use=none never, with or without an artifact
    forced = slowdown_model(_with_use(hw, "model"), model_dir)
    ok = a100[a100["status"] == "ok"].head(50)
    compute = ok.rename(columns={"solo_duration_s": "duration_s"})[["op", "flops", "bytes_moved", "duration_s"]]
    assert (forced.slowdown(compute, ok[["collective", "message_bytes", "num_ranks"]]) > 0).any()
    assert slowdown_inputs(_with_use(hw, "model"), model_dir, "A100")[0]["modelled"]
    assert isinstance(slowdown_model(_with_use(hw, "none"), model_dir), NoSlowdown)
    assert slowdown_inputs(_with_use(hw, "none"), None, "A100") == (
        {"modelled": False, "use": "none", "choice": "overlap slowdown: none (hardware.slowdown.use=none)"}, [])
    with pytest.raises(ConfigError, match="hardware.slowdown.use='sometimes'; accepted: auto, model, none"):
        slowdown_model(_with_use(hw, "sometimes"), model_dir)


def test_auto_applies_the_model_where_it_beats_no_slowdown(a100, tmp_path):
    """The A100 kernels with a slowdown that follows each kernel's memory-bandwidth share (s = 3 x share, as a
    GPU whose overlap cost is set by memory traffic would show): learnable across kernel groups, so the model
    trained on it beats no slowdown on unseen groups and auto applies it."""
    rows = a100.copy()
    share = dataset_features(rows)["memory_bandwidth_fraction"].clip(0, 1).to_numpy()
    ok = (rows["status"] == "ok").to_numpy()
    rows.loc[ok, "slowdown"] = 3 * share[ok]
    rows.loc[ok, "overlapped_duration_s"] = stretched_duration(rows.loc[ok, "solo_duration_s"],
                                                               rows.loc[ok, "overlap_fraction"], 3 * share[ok])
    result = train_slowdown_model(rows, SlowdownModelConfig(n_estimators=30, max_depth=6, nthread=1))
    scores = result.metrics[HELD_OUT_GROUPS]
    assert scores["model"]["within_10_pct"] > scores["none"]["within_10_pct"]
    model_dir = _model_artifact(result, tmp_path / "model")
    hw = compose_run(["hardware=a100-80g-dgx"]).hardware
    assert isinstance(slowdown_model(hw, model_dir), PredictorSlowdown)
    inputs, _ = slowdown_inputs(hw, model_dir, "A100")
    assert inputs["modelled"] and inputs["choice"].startswith("overlap slowdown: XGBoost model (auto: XGBoost ")


def test_predictor_reproduces_the_holdout_and_refuses_a_missing_feature(model_dir, a100, a100_result):
    predictor = SlowdownPredictor.load(model_dir)
    assert predictor.feature_names == list(FEATURES)
    holdout = a100_result.predictions[a100_result.predictions["split"] == "holdout"]
    rows = a100.set_index("instance_id").loc[holdout["instance_id"]].reset_index()
    s = predictor.predict(dataset_features(rows))
    assert np.allclose(s, holdout["predicted_slowdown"]) and (s >= 0).all()
    assert predictor.last_unknown_categories == dict.fromkeys(predictor.categories, 0)
    with pytest.raises(ValueError, match="lacks feature 'compute_fraction'"):
        predictor.predict(dataset_features(rows).drop(columns=["compute_fraction"]))
    bad = dataset_features(rows).assign(solo_duration_s=-1.0)
    with pytest.raises(ValueError, match="'solo_duration_s' has value -1.0 in row 0"):
        predictor.predict(bad)


def test_composer_api_counts_unknown_categories(model_dir):
    predictor = SlowdownPredictor.load(model_dir)
    compute = pd.DataFrame({"op": ["aten::mm", "aten::add.Tensor", "aten::my_custom_op"],
                            "flops": [2e9, 1e6, 0.0], "bytes_moved": [1.2e7, 1.2e7, 4e6],
                            "duration_s": [1e-3, 5e-5, 1e-5]})
    comm = pd.DataFrame({"collective": ["all_reduce", "all_gather", "all_to_all"],
                         "message_bytes": [25 * 2**20, 2**20, 2**20], "num_ranks": [8, 8, 8]})
    h100 = DeviceNumbers(132, 3.35e12, 67e12, 989e12, "H100")
    features = overlap_features(compute, comm, h100)
    assert list(features.columns) == list(FEATURES)
    assert list(features["op_kind"]) == ["matmul", "elementwise", "elementwise"]
    assert features["arithmetic_intensity"].iloc[0] == pytest.approx(2e9 / 1.2e7)
    assert features["memory_bandwidth_fraction"].iloc[1] == pytest.approx(1.2e7 / (5e-5 * 3.35e12))
    # 2e9 / 1e-3 s = 2 TFLOP/s: within the fp32 pipe's 67 TFLOP/s, so its fraction of that
    assert features["compute_fraction"].iloc[0] == pytest.approx(2e12 / 67e12)
    assert features[["flops", "compute_fraction"]].iloc[1:].isna().all().all()  # FLOPs count for matmul/attention only
    assert (features["device_sm_count"] == 132).all() and "device_type" not in features
    s = predictor.predict(features)
    assert s.shape == (3,) and np.isfinite(s).all() and (s >= 0).all()
    unknown = predictor.last_unknown_categories
    assert unknown["collective"] == 2 and "device_type" not in unknown  # all_gather, all_to_all never trained
    t = stretched_duration(compute["duration_s"], [1.0, 0.5, 0.0], s)
    assert t[2] == pytest.approx(1e-5) and t[0] == pytest.approx(1e-3 * (1 + s[0]))
    with pytest.raises(ValueError, match="3 compute rows but 2 comm rows"):
        overlap_features(compute, comm.head(2), h100)
    with pytest.raises(TypeError, match="device must be a DeviceNumbers"):
        overlap_features(compute, comm, "H100")  # a device-type label is no longer a feature


def test_constant_baseline_has_the_same_predict_signature(model_dir, a100_result):
    baseline = ConstantSlowdownPredictor.load(model_dir)
    factor = a100_result.metrics["baseline_factors"]["A100"]
    s = baseline.predict(pd.DataFrame({"device_type": ["A100", "H100"]}))
    assert s[0] == pytest.approx(factor) and baseline.last_unknown_categories == {"device_type": 1}
    assert baseline.predict(pd.DataFrame({"flops": [1.0]}))[0] == pytest.approx(factor)  # no label: pooled factor


def test_device_type_feature():
    assert device_type_of("cuda", "NVIDIA A100-SXM4-80GB") == "A100"
    assert device_type_of("cuda", "NVIDIA H100 80GB HBM3") == "H100"
    assert device_type_of("cuda", "NVIDIA H800") == "H800"
    assert device_type_of("cpu", "host CPU core") == "cpu"
    assert device_type_of("cuda", "NVIDIA A100", configured="A800") == "A800"


def test_gpu_hardware_trains_on_the_imported_csv(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the YAML path is relative to the project root
    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    keys = {"hardware": "h100-sxm-dgx"}
    summary = write_dataset_artifact(hw, keys, tmp_path / "slowdown")
    assert summary["source"] == "import" and summary["status"] == {"ok": 404, "zero_overlap": 215}
    assert summary["hardware_device_type"] == "H100" and summary["device_types"] == ["A100"]
    fast = dataclasses.replace(hw, slowdown=dataclasses.replace(hw.slowdown, model=SlowdownModelConfig(n_estimators=5)))
    write_model_artifact(fast, keys, tmp_path / "slowdown", tmp_path / "model")
    metrics = json.loads((tmp_path / "model/metrics.json").read_text())
    assert metrics["params"]["n_estimators"] == 5 and SlowdownPredictor.load(tmp_path / "model").feature_names
    measure = dataclasses.replace(hw, slowdown=dataclasses.replace(hw.slowdown, source="measure"))
    with pytest.raises(ConfigError, match="slowdown.source='measure' needs a cuda device"):
        build_dataset(measure, "h100-sxm-dgx")


def test_bad_model_config_names_the_field(a100):
    with pytest.raises(ConfigError, match="hardware.slowdown.model.features has unknown name"):
        train_slowdown_model(a100, SlowdownModelConfig(features=["tflops"]))
    with pytest.raises(ConfigError, match="too few"):
        train_slowdown_model(a100.head(5), SlowdownModelConfig())


TINY = SlowdownConfig(collectives=["all_reduce", "reduce_scatter"], message_bytes=[1 << 20], matmul_sizes=[64],
                      memory_bound_ops=["add", "layer_norm"], memory_bound_elements=[1 << 14], solo_calls=3,
                      max_calls_per_window=8)


@pytest.mark.slow
def test_local_collection_measures_sane_instances():
    from trainsim.slowdown.collect import collect_local

    rows, invalid, skipped = collect_local(TINY, "local-cpu", "cpu")
    assert invalid == {"nan_timing": 0, "negative_timing": 0, "fraction_out_of_range": 0} and skipped == []
    assert set(rows["op"]) == {"aten::mm", "aten::add.Tensor", "aten::native_layer_norm"}
    assert set(rows["collective"]) == {"all_reduce", "reduce_scatter"} and set(rows["num_ranks"]) == {2}
    assert (rows["solo_duration_s"] > 0).all() and (rows["overlapped_duration_s"] > 0).all()
    assert rows["overlap_fraction"].between(0, 1).all() and (rows["status"] == "ok").any()
    ok = rows[rows["status"] == "ok"]
    assert np.isfinite(ok["slowdown"]).all()
    mm = rows[rows["op"] == "aten::mm"].iloc[0]
    assert mm["flops"] == 2 * 64**3 and mm["op_kind"] == "matmul" and mm["device_type"] == "cpu"
    assert to_table(rows).schema == SLOWDOWN_SCHEMA


def test_nested_tuning_selects_inside_each_fold(a100):
    from trainsim.config.schema import SlowdownTuningConfig
    cfg = SlowdownModelConfig(objective="reg:absoluteerror", n_estimators=5, nthread=1,
                              tuning=SlowdownTuningConfig(learning_rate=[0.1, 0.3], max_depth=[3]))
    metrics = train_slowdown_model(a100, cfg).metrics
    assert metrics["tuning"]["grid_size"] == 2 and len(metrics["tuning"]["cv_fold_params"]) == cfg.cv_folds
    assert metrics["params"]["eta"] == metrics["tuning"]["final_params"]["learning_rate"]
    assert train_slowdown_model(a100, SlowdownModelConfig(n_estimators=5)).metrics["tuning"] == {}
    with pytest.raises(ConfigError, match="tuning.inner_folds=1"):
        train_slowdown_model(a100, dataclasses.replace(cfg, tuning=SlowdownTuningConfig(max_depth=[3, 6],
                                                                                         inner_folds=1)))
