"""Every prediction says what it was made from, and warns where a fallback stood in."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainsim
from trainsim.config import compose_run

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted(p.stem for p in (ROOT / "conf/hardware").glob("*.yaml") if p.stem != "local-cpu")
FAST_SLOWDOWN = ["hardware.slowdown.model.tuning.learning_rate=[]", "hardware.slowdown.model.tuning.n_estimators=[]",
                 "hardware.slowdown.model.tuning.max_depth=[]", "hardware.slowdown.model.tuning.min_child_weight=[]"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A working directory of its own, so the artifacts built here are not the checkout's."""
    return tmp_path_factory.mktemp("project")


@pytest.mark.parametrize("hardware", GPU_CONFIGS)
def test_every_gpu_config_composes_with_its_calibration_and_slowdown_model(hardware, project, monkeypatch):
    monkeypatch.chdir(project)
    hw = compose_run([f"hardware={hardware}"]).hardware
    # use=model: the model is applied on every GPU config (auto would pick none on Echo's data, test_slowdown.py)
    p = trainsim.predict("model=gpt-tiny", "parallelism=dp2", f"hardware={hardware}", *FAST_SLOWDOWN,
                         "hardware.slowdown.use=model")
    calibration = p.inputs["calibration"]
    assert calibration["calibrated"] == bool(hw.calibration.files)
    if hw.calibration.files:
        assert calibration["sources"] == [f.path for f in hw.calibration.files]
        assert all(e["rows"] > 0 for e in calibration["collectives"].values())
    else:  # no measurements: the datasheet stands in, and the user is told
        assert any("uncalibrated" in w for w in p.warnings)
        assert p.summary["models"]["comm"].startswith("CommModel (uncalibrated")
    assert p.inputs["slowdown"]["modelled"] and p.inputs["slowdown"]["files"] == hw.slowdown.import_files
    assert p.summary["models"]["slowdown"] == "xgboost"
    assert p.inputs["slowdown"]["choice"].startswith("overlap slowdown: XGBoost model (hardware.slowdown.use=model; ")
    assert p.inputs["kernels"]["analytical_ops"] > 0
    assert p.inputs["kernels"]["kernel_model"] == (hw.kernel_model.fitted_on or "schema defaults (not fitted)")
    kernel_warnings = [w for w in p.warnings if w.startswith("kernels:")]
    assert any("default efficiencies" in w for w in kernel_warnings) == (not hw.kernel_model.fitted_on)
    outside = bool(hw.kernel_model.fitted_range)  # gpt-tiny is smaller than any model a fit saw
    assert any("outside what the kernel model was fitted on" in w for w in kernel_warnings) == outside
    assert p.inputs["kernels"]["inside_fitted_range"] == (False if outside else None)
    if "A100" not in hw.device_name:  # Echo's A100 data applied to another GPU
        assert any(w.startswith("slowdown: model trained on A100") for w in p.warnings)


def test_a_multi_node_run_warns_when_calibration_is_single_node(project, monkeypatch):
    monkeypatch.chdir(project)
    p = trainsim.predict("model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx", "hardware.devices_per_node=1",
                         *FAST_SLOWDOWN)
    assert any("calibrated on at most 1 node(s), this run spans 2" in w for w in p.warnings)


def test_a_slowdown_model_of_an_older_schema_is_rebuilt_not_refused(project, monkeypatch):
    import json
    from pathlib import Path

    from trainsim.slowdown.train import SCHEMA_VERSION

    monkeypatch.chdir(project)
    overrides = ("model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx", *FAST_SLOWDOWN)
    first = trainsim.predict(*overrides)
    schema_file = Path(first.inputs["slowdown"]["artifact"]) / "schema.json"
    schema = json.loads(schema_file.read_text())
    schema_file.write_text(json.dumps({**schema, "schema_version": SCHEMA_VERSION - 1}))  # as an upgrade leaves it
    again = trainsim.predict(*overrides)
    assert json.loads(schema_file.read_text())["schema_version"] == SCHEMA_VERSION
    assert again.step_time_s == pytest.approx(first.step_time_s, rel=1e-6)
