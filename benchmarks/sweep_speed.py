"""Layout-search speed for GPT-175B on 1,024 A100s, how it scales with cores, and how far its fast path is
from the full composer.

1. Cold: the search traces and profiles its per-layer slices (one pair of small traces per tensor-parallel
   degree, micro-batch size and recompute mode) into artifacts/search/slices and the profile database.
2. Warm, once slices and calibration are cached (the issue's condition), with 1 process and with every
   core: layouts per second = layouts enumerated / wall time of the whole `search_layouts` call
   (enumeration, cache reads, memory screen, estimates, Pareto front).
3. Agreement: for a handful of the layouts that fit (fastest, median, slowest, a pipeline-heavy one), the
   step time of the fast path against the full pipeline (full trace, analytical kernel profile, event-driven
   compose with the calibrated NCCL model and the trained slowdown model when their artifacts exist).

Global batch 1,536 sequences of 2,048 tokens (GPT-3), bf16, hardware a100-80g-dgx (analytical kernels,
NCCL model calibrated from the A100 nccl-tests tables when artifacts/calibration/a100-80g-dgx exists).
Prints `figure sweep_layouts_per_second_gpt175b_1024gpu <v> 1/s`, `figure sweep_layouts_per_second_1core
<v> 1/s`, `figure search_fast_vs_full_mape_pct <v> %` and the tables behind them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

HARDWARE, MODEL, BUDGET = "a100-80g-dgx", "gpt-175b", 1024
BASE = [f"hardware={HARDWARE}", f"model={MODEL}", "parallelism=pp16-tp8-dp8", "parallelism.global_batch_size=1536"]
CALIBRATION = Path("artifacts/calibration") / HARDWARE


def main() -> int:
    from trainsim.config import compose_run
    from trainsim.search.run import STATUS_OK, cluster_for, layout_overrides, search_layouts
    from trainsim.timeline.stage import compose_run_artifacts

    run = compose_run(BASE, check="layout")
    cold = search_layouts(run, BUDGET, jobs=1, calibration_dir=CALIBRATION)
    print(f"cold: {len(cold.table)} layouts, slices traced and profiled in {cold.slices_s:.1f} s")

    cores = os.cpu_count() or 1
    rates = {}
    print("\n| processes | layouts | wall (s) | layouts/s |\n|---|---|---|---|")
    for jobs in sorted({1, cores}):
        started = time.perf_counter()
        warm = search_layouts(run, BUDGET, jobs=jobs, calibration_dir=CALIBRATION)
        wall = time.perf_counter() - started
        rates[jobs] = len(warm.table) / wall
        print(f"| {jobs} | {len(warm.table)} | {wall:.2f} | {rates[jobs]:.1f} |")
    table = warm.table
    print("\nstatus:", table["status"].value_counts().to_dict())

    ok = table[table["status"] == STATUS_OK].sort_values("step_time_s").reset_index(drop=True)
    picks = {0, len(ok) // 2, len(ok) - 1, int(ok["pp"].idxmax())}
    nodes = cluster_for(run.hardware, BUDGET).num_nodes
    errors = []
    print("\n| layout | fast (s) | full (s) | error | full compose wall (s) |\n|---|---|---|---|---|")
    for i in sorted(picks):
        row = ok.iloc[i]
        full_run = compose_run(BASE + layout_overrides(row, nodes))
        started = time.perf_counter()
        summary, _ = compose_run_artifacts(full_run)
        wall = time.perf_counter() - started
        error = 100 * (row["step_time_s"] / summary["step_time_s"] - 1)
        errors.append(abs(error))
        print(f"| {row['layout']} | {row['step_time_s']:.3f} | {summary['step_time_s']:.3f} | {error:+.1f} % "
              f"| {wall:.1f} |")

    print()
    print(f"figure sweep_layouts_per_second_gpt175b_1024gpu {rates[max(rates)]:.1f} 1/s")
    print(f"figure sweep_layouts_per_second_1core {rates[1]:.1f} 1/s")
    print(f"figure sweep_slices_cold_seconds_gpt175b {cold.slices_s:.1f} s")
    print(f"figure search_fast_vs_full_mape_pct {np.mean(errors):.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
