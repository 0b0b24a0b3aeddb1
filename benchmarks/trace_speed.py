"""Trace speed: ex-situ tracing of GPT-175B layouts on this machine (Echo needs a GPU run per rank).

Prints `figure trace_seconds_gpt175b_<N>gpu <seconds> s` for 96, 1024 and 8192 GPUs, each the wall
time of `trace_layout` (all rank classes, including the fake-world set-up) in one fresh process,
so no warm-up from an earlier layout is counted. Target: 8192 GPUs in under 60 s on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
import time

from trainsim.config import compose_run
from trainsim.trace import trace_layout

LAYOUTS = [(96, "pp12-tp8-dp1"), (1024, "pp16-tp8-dp8"), (8192, "pp16-tp8-dp64")]


def measure(parallelism: str) -> None:
    run = compose_run(["model=gpt-175b", f"parallelism={parallelism}"], check="layout")
    start = time.perf_counter()
    result = trace_layout(run.model, run.parallelism)
    seconds = time.perf_counter() - start
    print(f"{seconds:.3f} {result.graph.num_rows} {run.parallelism.pp} {result.rank_classes.num_rows}")


def main() -> None:
    print(f"{'GPUs':>6} {'layout':>15} {'classes':>8} {'events':>8} {'seconds':>8}")
    figures = []
    for gpus, parallelism in LAYOUTS:
        out = subprocess.run([sys.executable, __file__, "--one", parallelism], capture_output=True, text=True,
                             check=True).stdout.split()
        seconds, events, classes, ranks = float(out[0]), int(out[1]), int(out[2]), int(out[3])
        assert ranks == gpus
        print(f"{gpus:>6} {parallelism:>15} {classes:>8} {events:>8} {seconds:>8.2f}")
        figures.append((gpus, seconds))
    for gpus, seconds in figures:
        print(f"figure trace_seconds_gpt175b_{gpus}gpu {seconds:.2f} s")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        measure(sys.argv[2])
    else:
        main()
