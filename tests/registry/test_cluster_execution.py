"""Cluster execution on existing engines: the Slurm workflow profile and profiling datasets on a DVC remote.

No Slurm here: `snakemake -n` validates the profile against the slurm executor plugin but plans with the
dry-run executor (no sbatch, sinfo or sacctmgr is called), so the plan shows each job's resources. The
plugin's own functions then render the sbatch options from them, which catches a resource name the plugin
does not read (a dry run accepts any name).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trainsim.profile.database import ProfileDatabase
from trainsim.registry import STAGES

PROFILE = Path("profiles/slurm/config.yaml")
# Stages that time things on the GPU the hardware config names: one node each, alone on it.
GPU_RULES = {"profile", "calibration", "slowdown_dataset", "ground_truth"}
CPU_RULES = {"trace", "slowdown_model", "compose", "report", "sweep_summary"}
HARDWARE, MODEL, LAYOUTS = "h100-sxm-dgx", "gpt-small", ("tp2", "pp2")


def _run(args: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout + proc.stderr


def _planned(out: str) -> dict[str, list[dict]]:
    """Rule -> its jobs ({threads, resources}) from the job listing of `snakemake -n`."""
    jobs: dict[str, list[dict]] = {}
    job = None
    for line in out.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in ("rule", "localrule") and words[1].endswith(":"):
            job = {"threads": 1, "resources": {}}
            jobs.setdefault(words[1][:-1], []).append(job)
        elif job is not None and line.startswith("    threads: "):
            job["threads"] = int(words[1])
        elif job is not None and line.startswith("    resources: "):
            job["resources"] = dict(item.split("=", 1) for item in line.split(": ", 1)[1].split(", "))
    return jobs


def _as_evaluated(value) -> str:
    """A profile value as Snakemake prints it: strings are Python expressions, quoted ones literals."""
    if isinstance(value, str):
        try:
            return str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            return value
    return str(value)


class _Resources(dict):
    """Job resources with the attribute access the plugin uses (`job.resources.runtime`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _sbatch_options(rule: str, job: dict) -> str:
    """The sbatch command line the slurm plugin builds for a planned job (its own functions, no Slurm)."""
    from snakemake_executor_plugin_slurm import Executor
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    resources = _Resources({k: int(v) if v.isdigit() else v for k, v in job["resources"].items()})
    fake = SimpleNamespace(name=rule, resources=resources, threads=job["threads"])
    validate_slurm_extra(fake)  # no executor-managed option (--mem, --gpus ...) hidden in slurm_extra
    partition = Executor.get_partition_arg(SimpleNamespace(_partitions=None, _fallback_partition=None), fake)
    params = {"run_uuid": "test", "slurm_logfile": "slurm.log", "comment_str": f"rule_{rule}",
              "account": f" -A {resources['slurm_account']}", "partition": partition, "workdir": "/work"}
    return get_submit_command(fake, params) + set_gres_string(fake)


@pytest.mark.slow
def test_slurm_profile_resources_reach_every_planned_job(repo, project_copy, workflow_env):
    shutil.copytree(repo / "profiles", project_copy / "profiles")
    profile = yaml.safe_load((repo / PROFILE).read_text())
    assert profile["executor"] == "slurm" and set(profile["set-resources"]) <= set(STAGES) | {"sweep_summary"}
    ground_truth = [STAGES["ground_truth"].path({"hardware": HARDWARE, "model": MODEL, "parallelism": p})
                    for p in LAYOUTS]
    out = _run(["snakemake", "-n", "--workflow-profile", str(PROFILE.parent), "--config", f"hardware={HARDWARE}",
                f"model={MODEL}", f"parallelism={','.join(LAYOUTS)}", "--", "all", *ground_truth],
               project_copy, workflow_env)
    assert f"Using workflow specific profile {PROFILE.parent}" in out
    jobs = _planned(out)
    per_layout = {"trace", "profile", "compose", "report", "ground_truth"}
    assert {rule: len(js) for rule, js in jobs.items()} == {
        **{rule: len(LAYOUTS) for rule in per_layout},
        "calibration": 1, "slowdown_dataset": 1, "slowdown_model": 1, "sweep_summary": 1, "all": 1}

    default = profile["default-resources"]
    for rule in GPU_RULES | CPU_RULES:
        expected = {k: _as_evaluated(v) for k, v in {**default, **profile["set-resources"].get(rule, {})}.items()}
        for job in jobs[rule]:
            resources = job["resources"]
            assert expected.items() <= resources.items(), (rule, resources)
            # a measuring stage takes the whole node (`threads: workflow.cores`: the profile's `cores`, which
            # a real run needs and a dry run does not), and Slurm gives it that many CPUs
            assert job["threads"] == (int(resources["cpus_per_task"]) if rule in GPU_RULES else 1), rule
            sbatch = _sbatch_options(rule, job)
            assert f"-p {resources['slurm_partition']}" in sbatch and f"-A {default['slurm_account']}" in sbatch
            assert f"-t {resources['runtime']}" in sbatch and f"--mem {resources['mem_mb']}" in sbatch
            assert f"--cpus-per-task={resources['cpus_per_task']}" in sbatch
            if rule in GPU_RULES:
                assert resources["slurm_partition"] != default["slurm_partition"], rule
                assert job["threads"] > 1, rule
                assert f"--gpus={resources['gpu']}" in sbatch and "--nodes=1" in sbatch
                assert "--exclusive" in sbatch.split(), sbatch
            else:  # nothing timed: no GPU, the CPU partition
                assert "gpu" not in resources and "gres" not in resources, rule
                assert resources["slurm_partition"] == default["slurm_partition"], rule
                assert "--gpus" not in sbatch and "--ntasks=1" in sbatch, sbatch
    assert int(jobs["calibration"][0]["resources"]["gpu"]) == 8  # one rank per GPU of a DGX node


@pytest.mark.slow
def test_profiling_dataset_round_trips_through_a_dvc_remote(tmp_path, monkeypatch, repo, workflow_env):
    """A kernel database from a real GPU trace, shared as docs/cluster.md says: under data/ (artifacts/ is
    git-ignored, so DVC refuses a .dvc file there), pushed, restored from the remote alone, imported again."""
    from trainsim.cli import main

    project = tmp_path / "project"
    shutil.copytree(repo / "conf", project / "conf")
    shutil.copy2(repo / ".gitignore", project / ".gitignore")
    monkeypatch.chdir(project)
    trace = repo / "data/kineto/a100-80gb-16rank-rank0_kineto_hta-queue-length.json.gz"
    assert main(["profile-import", "--hardware", "a100-80g-dgx", "--no-fit", str(trace)]) == 0
    database = project / "artifacts/profiles/a100-80g-dgx/kernels.parquet"
    rows = len(ProfileDatabase(database).read())
    dataset = project / "data/profiles/a100-80g-dgx"
    shutil.copytree(database, dataset / "kernels.parquet")
    (dataset / "kineto").mkdir()
    shutil.copy2(trace, dataset / "kineto" / trace.name)  # the raw trace travels with the rows made from it
    before = {p.relative_to(dataset).as_posix(): p.read_bytes() for p in sorted(dataset.rglob("*")) if p.is_file()}
    assert rows > 0 and len(before) >= 3

    for args in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "add", "-q", "data/profiles/a100-80g-dgx"],
                 ["dvc", "remote", "add", "-d", "local", str(tmp_path / "remote")], ["dvc", "push"],
                 ["git", "add", "-A"], ["git", "commit", "-qm", "profiling dataset"]):
        _run(args, project, workflow_env)
    tracked = _run(["git", "ls-files"], project, workflow_env).split()
    assert "data/profiles/a100-80g-dgx.dvc" in tracked and not any(f.startswith("data/profiles/a100-80g-dgx/")
                                                                    for f in tracked)
    assert any(p.is_file() for p in (tmp_path / "remote").rglob("*"))

    shutil.rmtree(project / ".dvc" / "cache")  # only the remote has the bytes now
    shutil.rmtree(dataset)
    shutil.rmtree(project / "artifacts")
    _run(["dvc", "pull"], project, workflow_env)
    after = {p.relative_to(dataset).as_posix(): p.read_bytes() for p in sorted(dataset.rglob("*")) if p.is_file()}
    assert after.keys() == before.keys() and all(after[name] == before[name] for name in before)
    assert "up to date" in _run(["dvc", "status", "data/profiles/a100-80g-dgx.dvc"], project, workflow_env).lower()
    # the pulled rows go back into this machine's database: the profile stage reuses them instead of measuring
    assert main(["profile-import", "--hardware", "a100-80g-dgx", str(dataset / "kernels.parquet")]) == 0
    assert len(ProfileDatabase(database).read()) == rows
