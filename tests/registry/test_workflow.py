"""The Snakemake and DVC front ends: plans, incremental re-runs, sweeps, and the stage registry."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trainsim.artifacts import read_manifest
from trainsim.artifacts.store import file_sha256
from trainsim.registry import STAGES, render_dvc_yaml


def _run(args: list[str], cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _planned_jobs(cwd: Path, env: dict, *config: str) -> dict[str, int]:
    """Rule -> job count of `snakemake -n` (dry run) with the given --config overrides."""
    args = ["snakemake", "-n", "--cores", "1", "--quiet", "rules"]
    if config:
        args += ["--config", *config]
    out = _run(args, cwd, env).stdout
    jobs = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
            jobs[parts[0]] = int(parts[1])
    return jobs


def test_committed_dvc_yaml_is_generated_from_the_registry(repo):
    assert (repo / "dvc.yaml").read_text() == render_dvc_yaml()


def test_snakefile_rules_come_from_the_registry(repo, workflow_env):
    rules = _run(["snakemake", "--list-rules"], repo, workflow_env).stdout.split()
    assert set(STAGES) <= set(rules)


@pytest.mark.slow
def test_snakemake_runs_then_reruns_only_what_changed(project_copy, workflow_env):
    slowdown = {"calibration": 1, "slowdown_dataset": 1, "slowdown_model": 1}  # keyed by hardware only
    # the timeline, its report and the sweep's summary: every change below redoes them
    compose = {"compose": 1, "report": 1, "sweep_summary": 1}
    assert _planned_jobs(project_copy, workflow_env) == {"all": 1, "trace": 1, "profile": 1, **slowdown, **compose}
    _run(["snakemake", "--cores", "2"], project_copy, workflow_env)
    artifact = project_copy / STAGES["trace"].path({"model": "gpt-tiny", "parallelism": "dp2"})
    assert read_manifest(artifact)["config_keys"] == {"model": "gpt-tiny", "parallelism": "dp2"}
    assert (project_copy / "logs/traces/gpt-tiny/dp2.log").is_file()

    assert (project_copy / "artifacts/profiles/local-cpu/kernels.parquet").is_dir()
    read_manifest(project_copy / STAGES["compose"].path({"hardware": "local-cpu", "model": "gpt-tiny",
                                                         "parallelism": "dp2"}))

    assert _planned_jobs(project_copy, workflow_env) == {}  # nothing changed: nothing to do
    # a hardware change re-profiles (and rebuilds the slowdown dataset and model) but never re-traces
    hardware_jobs = {"all": 1, "profile": 1, **slowdown, **compose}
    assert _planned_jobs(project_copy, workflow_env, "hardware=a100-80g-dgx") == hardware_jobs
    assert _planned_jobs(project_copy, workflow_env, "overrides=hardware.num_nodes=4") == hardware_jobs
    # a parallelism change re-traces only that layout
    both = {"all": 1, "trace": 1, "profile": 1, **compose}
    assert _planned_jobs(project_copy, workflow_env, "parallelism=tp2") == both
    assert _planned_jobs(project_copy, workflow_env, "overrides=[parallelism.recompute=full]") == both
    # a sweep is one cached job per point
    assert _planned_jobs(project_copy, workflow_env, "parallelism=dp2,tp2,pp2") == {"all": 1, "trace": 2, "profile": 2,
                                                                                     "compose": 2, "report": 2,
                                                                                     "sweep_summary": 1}
    # editing a hardware YAML re-profiles only; editing the model's YAML re-traces (params track values)
    hardware_yaml = project_copy / "conf/hardware/local-cpu.yaml"
    hardware_yaml.write_text(hardware_yaml.read_text().replace("threads_per_device: 1", "threads_per_device: 2"))
    assert _planned_jobs(project_copy, workflow_env) == hardware_jobs
    model_yaml = project_copy / "conf/model/gpt-tiny.yaml"
    model_yaml.write_text(model_yaml.read_text().replace("seq_length: 64", "seq_length: 32"))
    assert _planned_jobs(project_copy, workflow_env) == {**both, **slowdown}  # the hardware edit is still pending


@pytest.mark.slow
def test_snakemake_rejects_an_impossible_layout_before_running(project_copy, workflow_env):
    proc = _run(["snakemake", "-n", "--cores", "1", "--config", "overrides=parallelism.tp=3"], project_copy,
                workflow_env, check=False)
    assert proc.returncode != 0
    assert "tp=3 does not divide model.num_attention_heads=4" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_dvc_repro_runs_the_trace_then_does_nothing(project_copy, workflow_env):
    _run(["git", "init", "-q"], project_copy, workflow_env)
    _run(["dvc", "init", "-q"], project_copy, workflow_env)
    _run(["git", "add", "-A"], project_copy, workflow_env)
    _run(["git", "commit", "-qm", "init"], project_copy, workflow_env)
    first = _run(["dvc", "repro"], project_copy, workflow_env)
    assert "Running stage 'trace'" in first.stdout and "Running stage 'profile'" in first.stdout
    assert "Running stage 'slowdown_dataset'" in first.stdout and "Running stage 'slowdown_model'" in first.stdout
    assert "Running stage 'compose'" in first.stdout and "Running stage 'report'" in first.stdout
    read_manifest(project_copy / "artifacts/traces/gpt-tiny/dp2")
    # dvc repro builds every stage, ground truth included, so the report compares with a real measurement
    metrics = json.loads(_run(["dvc", "metrics", "show", "--json"], project_copy, workflow_env).stdout)
    report_metrics = next(iter(metrics.values()))["data"]["artifacts/reports/local-cpu/gpt-tiny/dp2/metrics.json"]
    end_to_end = report_metrics["data"]["end_to_end"]
    assert end_to_end["measured"] == 1 and end_to_end["predicted_s"] > 0 and "error_pct" in end_to_end
    plots = project_copy / "plots-out"
    _run(["dvc", "plots", "show", "-o", str(plots)], project_copy, workflow_env)
    assert "comm_error.csv" in (plots / "index.html").read_text()
    second = _run(["dvc", "repro"], project_copy, workflow_env)
    assert "Running stage" not in second.stdout
    assert "didn't change" in second.stdout or "up to date" in second.stdout.lower()
    third = _run(["dvc", "repro", "--dry"], project_copy, workflow_env)
    assert "Running stage" not in third.stdout

    # the profile database is a versioned dataset: push it, clone, pull it back bit for bit
    remote = project_copy.parent / "dvc-remote"
    _run(["dvc", "remote", "add", "-d", "local", str(remote)], project_copy, workflow_env)
    _run(["dvc", "push"], project_copy, workflow_env)
    _run(["git", "add", "-A"], project_copy, workflow_env)
    _run(["git", "commit", "-qm", "profiled"], project_copy, workflow_env)
    clone = project_copy.parent / "clone"
    _run(["git", "clone", "-q", str(project_copy), str(clone)], project_copy.parent, workflow_env)
    _run(["dvc", "pull"], clone, workflow_env)
    database = "artifacts/profiles/local-cpu/kernels.parquet"
    assert _tree_digest(clone / database) == _tree_digest(project_copy / database) != {}
    trace = "artifacts/traces/gpt-tiny/dp2"
    assert _tree_digest(clone / trace) == _tree_digest(project_copy / trace)
    for dataset in ("artifacts/slowdown/local-cpu", "artifacts/models/local-cpu"):  # measured data and its model
        assert _tree_digest(clone / dataset) == _tree_digest(project_copy / dataset) != {}
    status = _run(["dvc", "status"], clone, workflow_env).stdout
    assert "up to date" in status.lower() or "changed" not in status

    # a layout change re-runs only what the layout keys (never calibration or the slowdown model)
    params = project_copy / "params.yaml"
    params.write_text(params.read_text().replace("parallelism: dp2", "parallelism: pp2"))
    changed = json.loads(_run(["dvc", "status", "--json"], project_copy, workflow_env).stdout)
    assert {"trace", "profile", "compose", "report"} <= set(changed)
    assert not {"calibration", "slowdown_dataset", "slowdown_model"} & set(changed)


def _tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}
