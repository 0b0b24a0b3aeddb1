"""Trace speed: ex-situ tracing of GPT-175B layouts on this machine (Echo needs a GPU run per rank).

Prints `figure trace_seconds_gpt175b_<N>gpu <seconds> s` for 96, 1024 and 8192 GPUs, each the wall
time of `trace_layout` (all rank classes, including the fake-world set-up) in one fresh process,
so no warm-up from an earlier layout is counted. Target: 8192 GPUs in under 60 s on 2 cores.

Then Llama 3.1 405B's long-context stage (Llama 3 paper, Table 4: TP8 CP16 PP16 DP8, 131,072-token sequences;
PP18 here, as trainsim splits layers evenly: conf/parallelism/tp8-sp-cp16-pp18-dp8.yaml, 18,432 GPUs, sequence
parallelism, ring attention, full recomputation, distributed optimizer): `figure
trace_seconds_llama405b_18432gpu` and `figure compose_seconds_llama405b_18432gpu` (reading nothing: the traced
tables in memory, kernels priced by h100-sxm-dgx's analytical model, the NCCL model uncalibrated, a constant
overlap slowdown). Targets: <= 60 s and <= 30 s. The same with FSDP (zero_stage 3: weights, gradients and states
sharded over the 128 dp x cp ranks) in place of the distributed optimizer: `figure
trace_seconds_llama405b_18432gpu_fsdp`, `figure compose_seconds_llama405b_18432gpu_fsdp`.

Then Llama 3.1 405B's pre-training layout as Meta writes it (TP8 PP16 DP128, 16,384 GPUs, 8,192-token
sequences): interleaved over 4 virtual stages with the embedding and the loss counted as layers, so the first and
last stages hold a layer fewer (conf/parallelism/tp8-sp-pp16-vp4-dp128.yaml): `figure
trace_seconds_llama405b_pp16_vp_uneven_16384gpu`. Target: <= 60 s.
"""

from __future__ import annotations

import subprocess
import sys
import time

from figures import figure

from trainsim.config import compose_run
from trainsim.trace import trace_layout

LAYOUTS = [(96, "pp12-tp8-dp1"), (1024, "pp16-tp8-dp8"), (8192, "pp16-tp8-dp64")]
LLAMA_405B_LONG_CONTEXT = ["hardware=h100-sxm-dgx", "hardware.num_nodes=2304", "model=llama3.1-405b",
                           "model.seq_length=131072", "parallelism=tp8-sp-cp16-pp18-dp8"]
LLAMA_405B_VARIANTS = {"": [], "_fsdp": ["parallelism.zero_stage=3", "parallelism.overlap_param_gather=false"]}
"""figure suffix -> overrides: the layout as given (distributed optimizer), and with FSDP over dp x cp instead"""
LLAMA_405B_PP16_UNEVEN = ["hardware=h100-sxm-dgx", "hardware.num_nodes=2048", "model=llama3.1-405b",
                          "parallelism=tp8-sp-pp16-vp4-dp128"]


def measure(parallelism: str) -> None:
    run = compose_run(["model=gpt-175b", f"parallelism={parallelism}"], check="layout")
    start = time.perf_counter()
    result = trace_layout(run.model, run.parallelism)
    seconds = time.perf_counter() - start
    print(f"{seconds:.3f} {result.graph.num_rows} {run.parallelism.pp} {result.rank_classes.num_rows}")


def measure_llama(*overrides: str) -> None:
    """Trace and compose Llama 3.1 405B as the overrides give it (default: its long-context stage)."""
    from trainsim.profile.analytical import predict_rows
    from trainsim.profile.stage import distinct_ops
    from trainsim.timeline import compose_step
    from trainsim.timeline.costs import ConstantSlowdown
    from trainsim.timeline.stage import comm_model

    run = compose_run(list(overrides) or LLAMA_405B_LONG_CONTEXT)
    start = time.perf_counter()
    result = trace_layout(run.model, run.parallelism)
    trace_s = time.perf_counter() - start
    graph, rank_classes = result.graph.to_pandas(), result.rank_classes.to_pandas()
    ops = distinct_ops(graph)
    times = dict(zip(ops["signature"], predict_rows(ops, run.hardware)))
    start = time.perf_counter()
    timeline = compose_step(graph, rank_classes, run.parallelism, run.hardware, times, comm_model(run.hardware, None),
                            ConstantSlowdown(0.2, name="constant s = 0.2"))
    compose_s = time.perf_counter() - start
    peak = result.memory.to_pandas()["peak_bytes"].max() / 2**30
    print(f"{trace_s:.3f} {compose_s:.3f} {result.graph.num_rows} {run.parallelism.world_size} "
          f"{timeline.step_time_s:.3f} {peak:.2f}")


def llama_in_fresh_process(overrides: list[str], layout: str) -> tuple[float, float, int]:
    """(trace seconds, compose seconds, GPUs) of a Llama 3.1 405B layout traced and composed in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--llama", *overrides], capture_output=True, text=True,
                         check=True).stdout.split()
    trace_s, compose_s, events, gpus, step_s, peak_gib = float(out[0]), float(out[1]), int(out[2]), int(out[3]), \
        float(out[4]), float(out[5])
    print(f"llama3.1-405b, {gpus} GPUs ({layout}): {events} events traced in {trace_s:.1f} s, composed in "
          f"{compose_s:.1f} s; step {step_s:.1f} s, peak memory {peak_gib:.1f} GiB")
    return trace_s, compose_s, gpus


def measure_llama_pp16_uneven() -> None:
    trace_s, _, gpus = llama_in_fresh_process(LLAMA_405B_PP16_UNEVEN, "TP8 PP16 x VP4 DP128, first/last stages a "
                                                                      "layer lighter")
    figure(f"trace_seconds_llama405b_pp16_vp_uneven_{gpus}gpu", trace_s, "s")


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
        figure(f"trace_seconds_gpt175b_{gpus}gpu", seconds, "s")
    for variant, overrides in LLAMA_405B_VARIANTS.items():
        trace_s, compose_s, gpus_405b = llama_in_fresh_process(
            [*LLAMA_405B_LONG_CONTEXT, *overrides],
            f"TP8 CP16 PP18 DP8, 128K tokens, {variant or 'distributed optimizer'}")
        figure(f"trace_seconds_llama405b_{gpus_405b}gpu{variant}", trace_s, "s")
        figure(f"compose_seconds_llama405b_{gpus_405b}gpu{variant}", compose_s, "s")
    measure_llama_pp16_uneven()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        measure(sys.argv[2])
    elif len(sys.argv) >= 2 and sys.argv[1] == "--llama":
        measure_llama(*sys.argv[2:])
    elif sys.argv[1:] == ["--only-pp16-uneven"]:
        measure_llama_pp16_uneven()
    else:
        main()
