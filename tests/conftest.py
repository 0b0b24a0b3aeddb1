"""Shared fixtures: the repository root and a throwaway copy of the project for workflow runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("Snakefile", "dvc.yaml", "params.yaml", "conf", "stages", "src", "report", "pyproject.toml")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


LIGHT_HARDWARE = {
    "local-cpu": {"cold_cache_profiling": False,
                  "calibration": {"sweep_ranks": [2, 3], "sweep_max_bytes": 256 * 1024, "sweep_repeats": 2,
                                  "system_noise": False},
                  "slowdown": {"collectives": ["all_reduce"], "message_bytes": [1 << 20], "matmul_sizes": [128, 256],
                               "memory_bound_ops": ["add", "softmax"], "memory_bound_elements": [1 << 18, 1 << 20]}},
    "a100-80g-dgx": {"slowdown": {"model": {"tuning": {"learning_rate": [0.1, 0.3], "n_estimators": [100],
                                                       "max_depth": [3], "min_child_weight": [1]}}}},
}
"""Measurement settings of the project copies: workflow tests check what runs, is cached and is written, so
their copies time kernels without evicting the cache first, sweep fewer sizes and tune over a smaller grid
(CI's own `snakemake --cores 2` runs the full settings of conf/)."""


def _merge(base: dict, extra: dict) -> dict:
    return {**base, **{k: _merge(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in extra.items()}}


def copy_project(dest: Path) -> Path:
    """A fresh copy of the workflow files in `dest`, so runs never touch the checkout's artifacts/, with the
    lighter measurement settings of LIGHT_HARDWARE."""
    dest.mkdir()
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    for hardware, settings in LIGHT_HARDWARE.items():
        path = dest / "conf/hardware" / f"{hardware}.yaml"
        path.write_text(yaml.safe_dump(_merge(yaml.safe_load(path.read_text()), settings), sort_keys=False))
    return dest


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "project")


@pytest.fixture(scope="session")
def workflow_env() -> dict[str, str]:
    """Environment for snakemake / dvc / git subprocesses (read-only: copy before changing it)."""
    env = dict(os.environ)
    env["DVC_NO_ANALYTICS"] = "1"
    env.setdefault("GIT_AUTHOR_NAME", "trainsim-tests")
    env.setdefault("GIT_AUTHOR_EMAIL", "tests@trainsim.invalid")
    env.setdefault("GIT_COMMITTER_NAME", "trainsim-tests")
    env.setdefault("GIT_COMMITTER_EMAIL", "tests@trainsim.invalid")
    return env


@pytest.fixture(scope="session")
def chromium() -> str:
    """The headless browser that pages are checked in (report/browser.py); a test needing it is skipped only
    where none is installed (.ci/run installs Debian's chromium)."""
    from trainsim.report.browser import find_browser

    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    return browser


@pytest.fixture(scope="session")
def rate_ops():
    """A few of the tp2 model's matmuls and two elementwise kinds: enough for the analytical kernel model's matmul
    and memory rates, timed in seconds (all of the model's ops take minutes; tests/profile builds and runs each)."""
    from trainsim.config import compose_run
    from trainsim.profile.stage import distinct_ops
    from trainsim.trace import trace_layout

    run = compose_run(["parallelism=tp2"], check="layout")
    ops = distinct_ops(trace_layout(run.model, run.parallelism).graph.to_pandas())
    ops = ops[ops["op"].isin(["aten::mm", "aten::addmm", "aten::add_.Tensor", "aten::sum.dim_IntList"])]
    return ops.groupby("op").head(4).reset_index(drop=True)


def squared_gradient_norms(rank, layout, model_cfg, par):
    """spawn_ranks body: one training step of a rank; the squared gradient norms its optimizer computed (the
    clipping's: set parallelism.clip_grad), to compare the gradients of two ways of running a step."""
    import torch

    from trainsim.parallel.schedules import step_actions
    from trainsim.workloads.launch import synthetic_batch
    from trainsim.workloads.optimizer import MixedPrecisionAdamW
    from trainsim.workloads.train_step import build_rank_model, create_groups, train_step

    groups = create_groups(layout, rank, every_group=True, experts=True)
    torch.manual_seed(1234)
    rm = build_rank_model(model_cfg, par, rank, groups)
    seen, norm = [], MixedPrecisionAdamW._squared_norm
    MixedPrecisionAdamW._squared_norm = staticmethod(lambda *args: seen.append(norm(*args)) or seen[-1])
    make = synthetic_batch(model_cfg, par, seed=layout.position(rank).dp_rank)
    batches = [make(mb) for mb in range(par.num_microbatches)]
    train_step(rm, step_actions(par, layout.position(rank).pp_rank), batches.__getitem__)
    return sum(float(s) for s in seen)
