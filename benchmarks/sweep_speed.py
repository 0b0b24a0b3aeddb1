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

4. Mixture of experts: Mixtral 8x7B on 64 H100s (NeMo's layout as the base), searching tensor, expert and
   expert tensor parallelism, pipeline depth, schedule and recompute; `figure search_layouts_mixtral_64gpu`,
   `figure search_fast_vs_full_mape_pct_moe` (the same agreement check on four of its layouts and the fastest
   with expert tensor parallelism), and the same
   search and check with Zipf(1.0) routing (each layer at its busiest expert-parallel rank):
   `figure search_fast_vs_full_mape_pct_moe_skewed`. `--moe-only` runs this part alone.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from figures import figure

HARDWARE, MODEL, BUDGET = "a100-80g-dgx", "gpt-175b", 1024
BASE = [f"hardware={HARDWARE}", f"model={MODEL}", "parallelism=pp16-tp8-dp8", "parallelism.global_batch_size=1536"]
CALIBRATION = Path("artifacts/calibration") / HARDWARE
MOE_BASE = ["hardware=h100-sxm-dgx", "model=mixtral-8x7b", "parallelism=ep8-pp4-dp16"]
MOE_BUDGET = 64


def agreement(base: list[str], budget: int, table, label: str) -> list[float]:
    """|fast - full| / full in % for the fastest, median and slowest layouts that fit, the deepest pipeline and
    the fastest with expert tensor parallelism."""
    from trainsim.config import compose_run
    from trainsim.pipeline import compose_point
    from trainsim.search.run import STATUS_OK, cluster_for, layout_overrides

    run = compose_run(base, check="layout")
    ok = table[table["status"] == STATUS_OK].sort_values("step_time_s").reset_index(drop=True)
    picks = {0, len(ok) // 2, len(ok) - 1, int(ok["pp"].idxmax())}
    if (ok["etp"] > 1).any():
        picks.add(int(ok[ok["etp"] > 1].index[0]))
    nodes = cluster_for(run.hardware, budget).num_nodes
    errors = []
    print(f"\n{label}\n| layout | fast (s) | full (s) | error | full compose wall (s) |\n|---|---|---|---|---|")
    for i in sorted(picks):
        row = ok.iloc[i]
        started = time.perf_counter()
        summary, _ = compose_point(compose_run(base + layout_overrides(row, nodes)))
        wall = time.perf_counter() - started
        error = 100 * (row["step_time_s"] / summary["step_time_s"] - 1)
        errors.append(abs(error))
        print(f"| {row['layout']} | {row['step_time_s']:.3f} | {summary['step_time_s']:.3f} | {error:+.1f} % "
              f"| {wall:.1f} |")
    return errors


def dense() -> None:
    from trainsim.config import compose_run
    from trainsim.search.run import search_layouts

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
    print("\nstatus:", warm.table["status"].value_counts().to_dict())
    errors = agreement(BASE, BUDGET, warm.table, f"{MODEL} on {BUDGET} GPUs")
    print()
    figure("sweep_layouts_per_second_gpt175b_1024gpu", rates[max(rates)], "1/s", ".1f")
    figure("sweep_layouts_per_second_1core", rates[1], "1/s", ".1f")
    figure("sweep_slices_cold_seconds_gpt175b", cold.slices_s, "s", ".1f")
    figure("search_fast_vs_full_mape_pct", np.mean(errors), "%")


def mixture_of_experts(routing: str = "balanced") -> tuple[int, float]:
    """(layouts, fast-vs-full MAPE %) of the Mixtral search with `routing`."""
    from trainsim.config import compose_run
    from trainsim.search.layouts import SearchSpace
    from trainsim.search.run import search_layouts

    base = [*MOE_BASE, f"model.moe_routing={routing}"]
    run = compose_run(base, check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), recompute=("none", "full"), tp_sizes=(1, 2))
    result = search_layouts(run, MOE_BUDGET, space, jobs=os.cpu_count() or 1,
                            calibration_dir=Path("artifacts/calibration") / "h100-sxm-dgx")
    table = result.table
    print(f"\nMixtral 8x7B, {routing} routing: {len(table)} layouts ({table['status'].value_counts().to_dict()}), "
          f"slices {result.slices_s:.1f} s, estimates {result.estimate_s:.2f} s; expert-parallel degrees "
          f"{sorted(table['ep'].unique().tolist())}")
    best = table[table["status"] == "ok"].nsmallest(5, "step_time_s")
    print(best[["layout", "step_time_s", "peak_memory_gib", "tp_comm_s"]].to_string(index=False))
    errors = agreement(base, MOE_BUDGET, table, f"mixtral-8x7b on {MOE_BUDGET} GPUs, {routing} routing")
    return len(table), float(np.mean(errors))


def main() -> int:
    if "--moe-only" not in sys.argv:
        dense()
    layouts, balanced = mixture_of_experts()
    _, skewed = mixture_of_experts("zipf:1.0")
    print()
    figure("search_layouts_mixtral_64gpu", layouts, "layouts", "")
    figure("search_fast_vs_full_mape_pct_moe", balanced, "%")
    figure("search_fast_vs_full_mape_pct_moe_skewed", skewed, "%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
