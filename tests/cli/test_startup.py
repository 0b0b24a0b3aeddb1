"""What only reads traces and artifacts starts without torch (seconds to import) or scipy's optimisers (half a
second; only calibration and fits use them): compose, report, the slowdown model and the profile stage's
analytical path, and a cached `trainsim compose`."""

from __future__ import annotations

import subprocess
import sys

READERS = ["trainsim.trace", "trainsim.trace.stage", "trainsim.timeline.stage", "trainsim.report.stage",
           "trainsim.slowdown.stage", "trainsim.profile.stage", "trainsim.validation.ground_truth", "trainsim.cli"]


def test_modules_that_read_traces_import_no_torch_nor_scipy_optimize():
    code = (f"import sys\nfor name in {READERS!r}: __import__(name)\n"
            "print([m for m in ('torch', 'scipy.optimize') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


CACHED_COMPOSE_SKIPS = ("hydra", "omegaconf", "torch", "scipy.optimize", "xgboost", "matplotlib")
"""Modules a cached `trainsim compose --quick` has no use for: Hydra and OmegaConf compose configs (cached in
artifacts/config-cache), torch traces, scipy's optimisers fit, xgboost loads a slowdown model (--quick composes
without one), matplotlib draws pages."""


def test_a_cached_compose_imports_none_of_the_modules_it_does_not_need(project_copy):
    point = ["model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx"]
    compose = f"import sys\nfrom trainsim.cli import main\nassert main(['compose', *{point!r}, '--quick']) == 0\n"

    def run(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=project_copy).stdout

    run(compose)  # traces and profiles the point, composes its config with Hydra
    out = run(compose + f"print('imported', [m for m in {CACHED_COMPOSE_SKIPS!r} if m in sys.modules])")
    assert out.splitlines()[-1] == "imported []"
