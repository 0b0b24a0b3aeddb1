"""Shared fixtures: the repository root and a throwaway copy of the project for workflow runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("Snakefile", "dvc.yaml", "params.yaml", "conf", "stages", "src", "report", "pyproject.toml")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def copy_project(dest: Path) -> Path:
    """A fresh copy of the workflow files in `dest`, so runs never touch the checkout's artifacts/."""
    dest.mkdir()
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
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
