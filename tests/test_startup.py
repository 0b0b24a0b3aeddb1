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
