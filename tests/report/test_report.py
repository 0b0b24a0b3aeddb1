"""The report stage: one page per configuration point, checked in headless Chromium, metrics for DVC,
ground truth shown as measured or "not measured", and a corrupt input stopping the report."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from conftest import copy_project

from trainsim.artifacts import atomic_artifact, read_manifest
from trainsim.config import compose_run
from trainsim.errors import ArtifactError
from trainsim.registry import STAGES
from trainsim.report.browser import broken_elements, find_browser, render_report
from trainsim.report.efficiency import efficiency
from trainsim.report.html import SECTIONS
from trainsim.report.stage import HTML_FILE, METRICS_FILE, write_report_artifact

KEYS = {"hardware": "a100-80g-dgx", "model": "gpt-tiny", "parallelism": "dp2"}
"""A GPU point: analytical kernels, the NCCL model fitted to the A100 tables, the model trained on Echo's
A100 data. Nothing is timed on this machine, so the pipeline is quick and its output deterministic."""


def _snakemake(project: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(["snakemake", *args, "--config", f"hardware={KEYS['hardware']}"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def a100_project(tmp_path_factory, workflow_env) -> Path:
    project = copy_project(tmp_path_factory.mktemp("report") / "project")
    _snakemake(project, workflow_env, "--cores", "2")
    return project


def _artifact(project: Path, stage: str) -> Path:
    return project / STAGES[stage].path(KEYS)


def _browser() -> str:
    browser = find_browser()
    if browser is None:  # .ci/run installs Debian's chromium; only a failed install gets here
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    return browser


@pytest.mark.slow
def test_page_renders_whole_in_chromium(a100_project, tmp_path):
    page = _artifact(a100_project, "report") / HTML_FILE
    rendered = render_report(page, browser=_browser(), screenshot=tmp_path / "page.png")
    assert broken_elements(rendered, SECTIONS) == []
    assert rendered["sections"] == list(SECTIONS)
    figures = {img["id"] for img in rendered["images"]}
    assert {"end-to-end-figure", "breakdown-figure", "timeline-figure", "comm-figure", "slowdown-figure",
            "importance-figure", "cost-figure"} <= figures
    tables = {t["id"]: t["rows"] for t in rendered["tables"]}
    assert tables["comm-table"] == len(json.loads((_artifact(a100_project, "calibration") / "fit.json")
                                                  .read_text())["collectives"])
    assert tables["provenance-table"] == 5  # trace, profile, calibration, slowdown model, compose
    # calibration, one row per calibrated collective, kernel model, overlap slowdown used, slowdown model
    assert tables["inputs-table"] == 4 + tables["comm-table"]
    assert (tmp_path / "page.png").stat().st_size > 10_000
    # the step's Chrome trace, downloaded and gunzipped by the browser: every event of the compose artifact's
    trace = json.loads((_artifact(a100_project, "compose") / "trace.json").read_text())
    assert [(d["id"], d["events"]) for d in rendered["downloads"]] == [("trace-download", len(trace["traceEvents"]))]
    assert tables["efficiency-table"] == 7 and "training-table" not in tables  # no token budget: no totals
    assert 'id="training-missing"' in page.read_text()
    text = page.read_text()  # every figure names what its numbers were made from
    assert text.count("<figcaption>") == len(rendered["images"])
    assert "NCCL model calibrated on a100-2gpu-nvlink_allreduce_vtrain-lut.csv" in text
    # which overlap slowdown the compose applied and why (auto: the model loses to none on unseen kernel groups)
    summary = json.loads((_artifact(a100_project, "compose") / "summary.json").read_text())
    choice = summary["inputs"]["slowdown"]["choice"]
    assert choice.startswith("overlap slowdown: none (auto: XGBoost ") and html.escape(choice) in text


@pytest.mark.slow
def test_metrics_come_from_the_upstream_artifacts_and_missing_truth_is_not_measured(a100_project):
    report = _artifact(a100_project, "report")
    metrics = json.loads((report / METRICS_FILE).read_text())
    compose = json.loads((_artifact(a100_project, "compose") / "summary.json").read_text())
    assert metrics["end_to_end"]["predicted_s"] == compose["step_time_s"]
    assert metrics["end_to_end"]["measured"] == 0 and "error_pct" not in metrics["end_to_end"]  # never a zero
    # the efficiency figures are the composed step's, in the configured hardware's prices and peaks
    run = compose_run([f"{group}={name}" for group, name in KEYS.items()])
    expected = efficiency(compose["step_time_s"], run.group("hardware"), run.group("model"), run.group("parallelism"))
    shown = metrics["efficiency"]
    assert {"mfu_pct", "cost_per_step_usd", "tokens_per_s"} <= shown.keys() and shown["mfu_pct"] > 0
    assert shown == pytest.approx({name: expected[name] for name in shown})
    page = (report / HTML_FILE).read_text()
    assert "not measured" in page and "a100-80g-dgx" in page
    fit = json.loads((_artifact(a100_project, "calibration") / "fit.json").read_text())
    for name, entry in fit["collectives"].items():
        assert metrics["comm"][name]["model_mape_pct_large"] == pytest.approx(entry["heldout"]["model_mape_pct_large"])
    model_metrics = json.loads((_artifact(a100_project, "slowdown_model") / "metrics.json").read_text())
    assert metrics["slowdown"]["holdout_model"]["within_10_pct"] == pytest.approx(
        model_metrics["holdout"]["model"]["within_10_pct"])
    manifest = read_manifest(report)
    assert set(manifest["files"]) == {HTML_FILE, METRICS_FILE} | {name for name, _, _ in STAGES["report"].dvc_plots}


@pytest.mark.slow
def test_snakemake_report_bundles_the_page(a100_project, workflow_env, tmp_path):
    _snakemake(a100_project, workflow_env, "--cores", "1", "--report", str(tmp_path / "report.zip"))
    with zipfile.ZipFile(tmp_path / "report.zip") as bundle:
        names = bundle.namelist()
    assert any(n.endswith(f"/{HTML_FILE}") and "/data/raw/" in n for n in names)
    assert any(n.endswith(f"/{METRICS_FILE}") for n in names)
    assert any(n.endswith("/summary.html") for n in names)  # the sweep's summary page too


@pytest.mark.slow
def test_ground_truth_appearing_re_reports_with_the_error(a100_project, workflow_env):
    predicted = json.loads((_artifact(a100_project, "report") / METRICS_FILE).read_text())["end_to_end"]["predicted_s"]
    truth = _artifact(a100_project, "ground_truth")
    with atomic_artifact(truth, stage="ground_truth", config={}, config_keys=KEYS) as tmp:
        (tmp / "summary.json").write_text(json.dumps({"status": "measured", "step_time_median_s": 2 * predicted,
                                                      "step_time_spread_s": 0.1 * predicted}))
    plan = _snakemake(a100_project, workflow_env, "-n", "--cores", "1", "--quiet", "rules").stdout
    assert "report" in plan and "compose" not in plan and "trace" not in plan
    _snakemake(a100_project, workflow_env, "--cores", "1")
    report = _artifact(a100_project, "report")
    metrics = json.loads((report / METRICS_FILE).read_text())["end_to_end"]
    assert metrics["measured"] == 1 and metrics["error_pct"] == pytest.approx(-50.0)
    assert metrics["normalised"] == pytest.approx(0.5)
    assert str(truth.relative_to(a100_project)) in read_manifest(report)["inputs"]
    shutil.rmtree(truth)


@pytest.mark.slow
def test_a_corrupt_input_stops_the_report_and_keeps_the_old_one(a100_project, tmp_path):
    inputs = {name: tmp_path / name for name in STAGES["report"].inputs}
    for name, path in inputs.items():
        shutil.copytree(_artifact(a100_project, name), path)
    summary = inputs["compose"] / "summary.json"
    summary.write_text(summary.read_text().replace('"step_time_s": ', '"step_time_s": 1'))
    output = tmp_path / "report"
    shutil.copytree(_artifact(a100_project, "report"), output)
    before = (output / HTML_FILE).read_bytes()
    with pytest.raises(ArtifactError, match="summary.json does not match the SHA-256"):
        write_report_artifact(KEYS, inputs, output, tmp_path / "no-ground-truth")
    assert (output / HTML_FILE).read_bytes() == before


@pytest.mark.slow
def test_a_token_budget_re_renders_only_the_pages_with_training_totals(a100_project, workflow_env):
    compose = read_manifest(_artifact(a100_project, "compose"))
    budget = ["--config", f"hardware={KEYS['hardware']}", "overrides=[train.tokens=3e11]", "sweep_name=budget"]
    plan = subprocess.run(["snakemake", "-n", "--cores", "1", "--quiet", "rules", *budget], cwd=a100_project,
                          env=workflow_env, capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stderr
    assert "report" in plan.stdout and "compose" not in plan.stdout and "trace" not in plan.stdout
    run = subprocess.run(["snakemake", "--cores", "1", *budget], cwd=a100_project, env=workflow_env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert read_manifest(_artifact(a100_project, "compose")) == compose  # nothing re-simulated
    efficiency = json.loads((_artifact(a100_project, "report") / METRICS_FILE).read_text())["efficiency"]
    steps = -(-300_000_000_000 // efficiency["tokens_per_step"])
    assert efficiency["training_steps"] == steps
    assert efficiency["training_days"] == pytest.approx(steps * compose_step_s(a100_project) / 86400)
    price = compose_run([f"hardware={KEYS['hardware']}"]).hardware.price_per_device_hour  # read, not copied
    assert efficiency["training_cost_usd"] == pytest.approx(efficiency["training_gpu_hours"] * price)
    rendered = render_report(_artifact(a100_project, "report") / HTML_FILE, browser=_browser())
    assert {t["id"]: t["rows"] for t in rendered["tables"]}["training-table"] == 6
    summary = pd.read_csv(a100_project / "artifacts/sweeps/budget/summary.csv")
    assert summary["training_days"].tolist() == [pytest.approx(efficiency["training_days"])]
    _snakemake(a100_project, workflow_env, "--cores", "1")  # back to no budget for the other tests


def compose_step_s(project: Path) -> float:
    return json.loads((project / STAGES["compose"].path(KEYS) / "summary.json").read_text())["step_time_s"]


@pytest.mark.slow
def test_plan_answers_days_and_dollars_in_one_page(a100_project, monkeypatch, capsys):
    """`trainsim plan`: the search, the chosen layout composed in full (the project's calibration and slowdown
    model reused), the answer in plan.json equal to composing those overrides, and the page whole in Chromium."""
    from trainsim.api import predict
    from trainsim.cli import main
    from trainsim.search.plan import SECTIONS as PLAN_SECTIONS

    monkeypatch.chdir(a100_project)
    args = ["plan", "hardware=a100-80g-dgx", "model=gpt-tiny", "--gpus", "8", "--micro-batch-sizes", "1", "2",
            "--schedules", "1f1b", "--recompute", "none", "--jobs", "1", "train.tokens=2e9"]
    assert main(args) == 0
    out = a100_project / "artifacts/plans/a100-80g-dgx/gpt-tiny/8gpu"
    answer = json.loads((out / "plan.json").read_text())
    layouts = pd.read_csv(out / "layouts.csv")
    fitting = layouts[layouts["status"] == "ok"]
    assert answer["layout"] == fitting.loc[fitting["step_time_s"].idxmin(), "layout"]  # the fastest
    composed = predict(*answer["overrides"])
    assert answer["step_time_s"] == composed.step_time_s
    assert answer["training_days"] == pytest.approx(composed.efficiency["training_days"])
    assert answer["training_steps"] == -(-2_000_000_000 // answer["tokens_per_step"])
    printed = capsys.readouterr().out
    assert f"{answer['layout']} on {answer['world_size']} GPUs" in printed and "days" in printed
    rendered = render_report(out / "plan.html", browser=_browser())
    assert broken_elements(rendered, PLAN_SECTIONS) == [] and rendered["sections"] == list(PLAN_SECTIONS)
    assert {"breakdown-figure", "timeline-figure", "step-time-heatmap", "memory-heatmap", "pareto-figure"} <= {
        img["id"] for img in rendered["images"]}
    assert rendered["downloads"][0]["events"] > 0
    assert main([*args[:-1], "--within-days", "30"]) == 2  # a deadline needs train.tokens: an error, no plan
    assert "needs the run's token budget" in capsys.readouterr().err
    assert main([*args, "--by", "cost", "--within-days", "1e6"]) == 0
    cheapest = json.loads((out / "plan.json").read_text())
    assert cheapest["layout"] == fitting.loc[fitting["cost_per_million_tokens_usd"].idxmin(), "layout"]
