"""One GPU, for real: measured kernels against the kernel model, and a real training step against its prediction.

Runs where torch sees a CUDA device (the hardware config must name it). For each case (a few full-width
layers of a 7-8B model, bf16 or FP8 (Transformer Engine-style, workloads/fp8.py), one GPU, fused attention) this
  1. traces the step ex-situ and times its distinct ops on the GPU with CUDA events (the profile stage's
     CUDA backend), and also prices them with the hardware's analytical kernel model,
  2. composes the step twice: with the measured op times and with the analytical ones,
  3. runs the real step on the GPU (trainsim/validation/ground_truth.py: warm-up steps discarded, median of
     the measured steps), and
prints per case `figure gpu_step_error_pct_<case>_measured` / `_analytical` (|predicted / measured - 1|),
`figure gpu_memory_error_pct_<case>` (the trace's peak memory against the CUDA allocator's peak over the
measured steps),
`figure gpu_kernel_model_ratio_<case>_<kind>` (analytical / measured seconds summed over the step's ops of one
kind: matmul, attention, elementwise, ...), and the raw rates the kernel model's datasheet-derived parameters
stand for: `figure gpu_matmul_tflops_<dtype>` of an 8192^3 GEMM (bf16, and fp8 through torch._scaled_mm when
the GPU has it) and `figure gpu_flash_attention_tflops_<fwd|bwd>` (causal, 8192 tokens, head dim 128).

    python benchmarks/gpu_accuracy.py [--hardware h100-sxm-dgx] [--cases llama8b-4l gpt7b-4l] [--steps 5]
On a machine without a GPU it says so and stops (`--hardware local-cpu --small` runs the same path on the
CPU with a tiny model: a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from trainsim.comm.model import CommModel
from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.profile.analytical import op_kind, predict_rows
from trainsim.profile.database import ProfileDatabase
from trainsim.profile.stage import distinct_ops, profile_ops
from trainsim.timeline.compose import compose_step
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step
from trainsim.validation.ground_truth import measure
from trainsim.workloads.schedules import pipeline_actions

ONE_GPU = ["parallelism=single", "parallelism.precision=bf16", "parallelism.micro_batch_size=1",
           "parallelism.global_batch_size=2", "hardware.num_nodes=1"]
CASES = {
    "llama8b-4l": ["model=llama3-8b", "model.num_layers=4", "model.seq_length=4096"],
    "llama8b-4l-fp8": ["model=llama3-8b", "model.num_layers=4", "model.seq_length=4096", "parallelism.precision=fp8"],
    "gpt7b-4l": ["model=gpt-13b", "model.hidden_size=4096", "model.num_attention_heads=32", "model.num_layers=4",
                 "model.seq_length=4096"],
}
SMALL = {"tiny": ["model=gpt-tiny"]}


def _seconds(call, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def raw_rates() -> list[tuple[str, float, str]]:
    """TFLOP/s of one large GEMM per dtype and of causal flash attention (what the kernel model's
    efficiencies stand for)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    figures = [("gpu_matmul_tflops_bf16", 2 * n**3 / _seconds(lambda: a @ b) / 1e12, "TFLOP/s")]
    if torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        seconds = _seconds(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        figures.append(("gpu_matmul_tflops_fp8", 2 * n**3 / seconds / 1e12, "TFLOP/s"))
    batch, heads, seq, dim = 1, 32, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    forward_flops = 4 * batch * heads * seq * seq * dim / 2  # causal: half the scores
    forward_s = _seconds(lambda: attention(q, k, v, is_causal=True))
    out = attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    backward_s = _seconds(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    figures += [("gpu_flash_attention_tflops_fwd", forward_flops / forward_s / 1e12, "TFLOP/s"),
                ("gpu_flash_attention_tflops_bwd", 2.5 * forward_flops / backward_s / 1e12, "TFLOP/s")]
    return figures


def step_counts(graph: pd.DataFrame, par) -> pd.Series:
    """How often each signature runs in the step (rank class 0, every micro-batch)."""
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    events = expand_step(graph[graph["rank_class"] == 0], actions)
    kernels = events[(events["kind"] == "compute") & ~events["no_kernel"]]
    return kernels["signature"].value_counts()


def evaluate_case(name: str, overrides: list[str], hardware: str, steps: int, db: ProfileDatabase) -> list[tuple]:
    run = compose_run([f"hardware={hardware}", *ONE_GPU, *overrides])
    hw, par = run.hardware, run.parallelism
    traced = trace_layout(run.model, par)
    graph, rank_classes = traced.graph.to_pandas(), traced.rank_classes.to_pandas()
    ops = distinct_ops(graph)
    started = time.perf_counter()
    rows, summary = profile_ops(ops, hw, run.key("hardware"), db)
    print(f"{name}: {len(ops)} distinct ops profiled with backend {summary.backend} in "
          f"{time.perf_counter() - started:.1f} s ({summary.analytical} fell back to the kernel model)")
    reasons = {f["signature"]: f["reason"] for f in summary.fallback}
    for op, signature in zip(ops["op"], ops["signature"]):
        if signature in reasons:
            print(f"  not measured: {op}: {reasons[signature]}")
    sources = {"measured": dict(zip(rows["signature"], rows["median_s"]))}
    try:
        sources["analytical"] = dict(zip(ops["signature"], predict_rows(ops, hw)))
    except ConfigError as exc:  # a CPU has no datasheet peak: measured only
        print(f"{name}: no analytical prediction ({exc})")
    comm = CommModel.from_hardware(hw)
    predicted = {source: compose_step(graph, rank_classes, par, hw, times, comm).step_time_s
                 for source, times in sources.items()}
    if torch.cuda.is_available():  # the real step runs in its own process: hand it the GPU's memory
        gc.collect()
        torch.cuda.empty_cache()
    truth, in_step = measure(hw, run.model, par, steps=steps, warmup=2, profile=True)
    real = truth["step_time_median_s"]
    attention = in_step[in_step["name"].str.contains("attention|flash|fmha", case=False)]
    print(f"{name}: attention inside one profiled real step (torch.profiler, device seconds):")
    print(attention[["name", "calls", "device_s"]].to_string(index=False))
    print(f"{name}: real step {real * 1e3:.2f} ms (spread {truth['step_time_spread_s'] * 1e3:.2f} ms); predicted "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in predicted.items()))

    counts = step_counts(graph, par)
    table = ops.assign(kind=ops["op"].map(op_kind), calls=ops["signature"].map(counts).fillna(0),
                       measured_s=ops["signature"].map(sources["measured"]),
                       analytical_s=ops["signature"].map(sources.get("analytical", {})))
    table["measured_s"] *= table["calls"]
    table["analytical_s"] *= table["calls"]
    by_kind = table.groupby("kind")[["calls", "measured_s", "analytical_s"]].sum()
    by_kind["ratio"] = by_kind["analytical_s"] / by_kind["measured_s"]
    print(by_kind.round(5).to_string())
    print(table[table["kind"] == "attention"][["op", "calls", "measured_s", "analytical_s"]].to_string(index=False))
    figures = [(f"gpu_step_error_pct_{name}_{source}", 100 * abs(p / real - 1), "%") for source, p in predicted.items()]
    measured_peak = truth["ranks"][0]["peak_memory_bytes"]
    if measured_peak:  # the allocator's record (a GPU): against the trace's peak of the same rank
        memory = traced.memory.to_pandas().iloc[0]
        gib = (memory[["peak_bytes", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                       "peak_activation_bytes", "transient_bytes"]] / 2**30).round(2)
        print(f"{name}: peak memory {measured_peak / 2**30:.2f} GiB measured; traced (GiB) {gib.to_dict()}")
        figures.append((f"gpu_memory_error_pct_{name}", 100 * abs(memory["peak_bytes"] / measured_peak - 1), "%"))
    if "analytical" in sources:
        figures += [(f"gpu_kernel_model_ratio_{name}_{kind}", r, "ratio") for kind, r in by_kind["ratio"].items()
                    if by_kind.loc[kind, "measured_s"] > 0]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default="h100-sxm-dgx")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny model (a check of the script on any device)")
    parser.add_argument("--database", type=Path, help="kernel profile database (default: a new temporary one)")
    args = parser.parse_args()
    cases = SMALL if args.small else {name: CASES[name] for name in args.cases}
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.small:
        print("no CUDA device on this machine: nothing measured")
        return
    pd.set_option("display.width", 160)
    db = ProfileDatabase(args.database or Path(tempfile.mkdtemp(prefix="trainsim-gpu-")) / "kernels.parquet")
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    figures = []
    for name, overrides in cases.items():
        figures += evaluate_case(name, overrides, args.hardware, args.steps, db)
    if on_gpu:
        figures += raw_rates()
    for name, value, unit in figures:
        print(f"figure {name} {value:.3f} {unit}")


if __name__ == "__main__":
    main()
