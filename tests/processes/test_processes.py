"""Worker processes come from one fork server per parent, which has imported torch and the training code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainsim import processes


def _report(index: int, out: str) -> None:
    preloaded = "trainsim.workloads.launch" in sys.modules
    Path(out, f"{index}.txt").write_text(f"{os.getppid()} {preloaded}")


def test_workers_fork_from_one_server_that_preloaded_the_training_code(tmp_path):
    reports = []
    for start in range(2):
        out = tmp_path / str(start)
        out.mkdir()
        processes.start(_report, 2, (str(out),))
        reports += [(out / f"{index}.txt").read_text().split() for index in range(2)]
    parents = {parent for parent, _ in reports}
    assert len(parents) == 1 and parents != {str(os.getpid())}  # the same server for both starts, not this process
    assert all(preloaded == "True" for _, preloaded in reports)
