"""One GPU, for real: measured kernels against the kernel model, and a real training step against its prediction.

Runs where torch sees a CUDA device (the hardware config must name it). For each case (a few full-width
layers of a 7-8B dense model, bf16 or FP8 (Transformer Engine-style, workloads/fp8.py), or two layers of an MoE
(Mixtral 8x7B, Qwen3-30B-A3B); one GPU, fused attention) this
  1. runs the real step on the GPU (trainsim/validation/ground_truth.py: warm-up steps discarded, median of
     the measured steps; an MoE's routing histogram recorded),
  2. traces the step ex-situ (an MoE with its real run's routing) and times its distinct ops on the GPU (the
     profile stage's CUDA backend: CUDA events, and beside them the kernels' profiled durations, a CUDA-graph
     replay and the host's issue time), and also prices them with the hardware's analytical kernel model,
  3. composes the step with each set of op times,
and prints per case `figure gpu_step_error_pct_<case>_<source>` (|predicted / measured - 1|; source
`measured` (events), `measured_kernel`, `measured_graph`, `measured_graph_host` (graph times plus the measured
issue time per op as hardware.host_dispatch_s), `analytical`), `figure gpu_memory_error_pct_<case>` (the trace's
peak memory against the CUDA allocator's peak over the measured steps), `figure gpu_kernel_model_ratio_<case>_<kind>`
(analytical / measured seconds summed over the step's ops of one kind: matmul, attention, elementwise, ...), and
the raw rates the kernel model's datasheet-derived parameters stand for: `figure gpu_matmul_tflops_<dtype>` of an
8192^3 GEMM (bf16, and fp8 through torch._scaled_mm when the GPU has it) and
`figure gpu_flash_attention_tflops_<fwd|bwd>` (causal, 8192 tokens, head dim 128). It also prints where the real
step's device time goes against the replayed ops' (busy time, per op name).

    python benchmarks/gpu_accuracy.py [--hardware h100-sxm-dgx] [--cases llama8b-4l gpt7b-4l] [--steps 5]
One case per process is safest: on an H200 a 128-expert case once left 73 GiB held by the profiling process and
the next case's real step ran out of memory (ops are now rebuilt one at a time on a GPU; not rerun since).
On a machine without a GPU it says so and stops (`--hardware local-cpu --small` runs the same path on the CPU
with tiny models: a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from figures import figure

from trainsim.comm.model import CommModel
from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.schedules import pipeline_actions
from trainsim.profile.analytical import op_kind, predict_rows
from trainsim.profile.database import ProfileDatabase
from trainsim.profile.stage import distinct_ops, profile_ops
from trainsim.timeline.compose import compose_step
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step
from trainsim.validation.ground_truth import measure
from trainsim.workloads.routing import RoutingHistogram

ONE_GPU = ["parallelism=single", "parallelism.precision=bf16", "parallelism.micro_batch_size=1",
           "parallelism.global_batch_size=2", "hardware.num_nodes=1"]
CASES = {
    "llama8b-4l": ["model=llama3-8b", "model.num_layers=4", "model.seq_length=4096"],
    "llama8b-4l-fp8": ["model=llama3-8b", "model.num_layers=4", "model.seq_length=4096", "parallelism.precision=fp8"],
    "gpt7b-4l": ["model=gpt-13b", "model.hidden_size=4096", "model.num_attention_heads=32", "model.num_layers=4",
                 "model.seq_length=4096"],
    # Megatron-Core's 1.7B row (tp 1) as one of its 48 data-parallel ranks runs it: 4 micro-batches, all layers
    "gpt1.7b-mcore": ["model=gpt-13b", "model.hidden_size=2048", "model.num_attention_heads=16",
                      "model.num_layers=24", "model.seq_length=4096", "model.vocab_size=131072", "model.dropout=0.1",
                      "model.attention_dropout=0.1", "parallelism.global_batch_size=4"],
    # the same 4 sequences in 2 micro-batches (the tables' micro-batch size is not stated)
    "gpt1.7b-mcore-mb2": ["model=gpt-13b", "model.hidden_size=2048", "model.num_attention_heads=16",
                          "model.num_layers=24", "model.seq_length=4096", "model.vocab_size=131072",
                          "model.dropout=0.1", "model.attention_dropout=0.1", "parallelism.global_batch_size=4",
                          "parallelism.micro_batch_size=2"],
    "mixtral-2l": ["model=mixtral-8x7b", "model.num_layers=2"],
    "qwen3moe-2l": ["model=qwen3-30b-a3b", "model.num_layers=2"],
}
SMALL = {"tiny": ["model=gpt-tiny"], "tiny-moe": ["model=gpt-tiny", "model.num_experts=4", "model.moe_top_k=2"]}
ROUTING_FILE = "routing.csv"


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


SPLIT_GEMMS = {"fc1_32b_tp8": (4096, 7168, 3584), "fc2_32b_tp8": (4096, 3584, 7168)}
"""[tokens, k] x [k, n] GEMMs of Megatron-Core's 32B row (hidden 7168, tp 8, seq 4096) that tp_comm_overlap
runs in tp = 8 token blocks."""


def _split_gemm_calls(m: int, k: int, n: int, chunks: int, side: list) -> dict:
    """A [m, k] x [k, n] GEMM whole, in `chunks` row blocks on one stream, and in blocks round-robin on `side`."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    rows = m // chunks
    blocks = [(a[i * rows:(i + 1) * rows], out[i * rows:(i + 1) * rows]) for i in range(chunks)]

    def one_stream():
        for x, y in blocks:
            torch.mm(x, b, out=y)

    def round_robin():
        ready = torch.cuda.current_stream()
        for stream in side:
            stream.wait_stream(ready)
        for i, (x, y) in enumerate(blocks):
            with torch.cuda.stream(side[i % len(side)]):
                torch.mm(x, b, out=y)
        for stream in side:
            ready.wait_stream(stream)

    return {"whole": lambda: torch.mm(a, b, out=out), "blocks_one_stream": one_stream,
            f"blocks_{len(side)}_streams": round_robin}


def split_gemm_rates(chunks: int = 8, streams: int = 3) -> list[tuple[str, float, str]]:
    """TFLOP/s of a tensor-parallel GEMM whole, in `chunks` token blocks one after another on one stream, and in
    blocks issued round-robin on `streams` streams (as Transformer Engine's overlap issues them), beside the
    kernel model's shape efficiency of the whole GEMM and of one block alone (how it prices a block)."""
    from trainsim.profile.analytical import gemm_shape_efficiency

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    side = [torch.cuda.Stream() for _ in range(streams)]
    figures = []
    for name, (m, k, n) in SPLIT_GEMMS.items():
        for variant, call in _split_gemm_calls(m, k, n, chunks, side).items():
            figures.append((f"gpu_split_gemm_tflops_{name}_{variant}", 2 * m * k * n / _seconds(call) / 1e12,
                            "TFLOP/s"))
        print(f"split GEMM {name} [{m}, {k}] x [{k}, {n}] in {chunks} blocks: kernel model's shape efficiency "
              f"whole {gemm_shape_efficiency(1, m, n, k, sm_count):.3f}, one block alone "
              f"{gemm_shape_efficiency(1, m // chunks, n, k, sm_count):.3f}")
    return figures


def step_counts(graph: pd.DataFrame, par) -> pd.Series:
    """How often each signature runs in the step (rank class 0, every micro-batch)."""
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    events = expand_step(graph[graph["rank_class"] == 0], actions)
    kernels = events[(events["kind"] == "compute") & ~events["no_kernel"]]
    return kernels["signature"].value_counts()


def print_real_against_replay(name: str, in_step: pd.DataFrame, table: pd.DataFrame) -> None:
    """Where the real step's time goes that the replayed ops do not carry: its kernels' busy time against its
    length (the rest is the device waiting for the host), and device seconds per op name, real (one profiled
    step; an op's own kernels) against the replayed ops' sum. A trainsim:: fused op shows in the real step as
    the aten ops it is made of."""
    kernels = in_step[(in_step["total_s"] == 0) & (in_step["device_s"] > 0)]
    replayed = table.assign(name=table["op"].str.split(".").str[0]).groupby("name")["measured_s"].sum()
    real = in_step[in_step["total_s"] > 0].groupby("name")["device_s"].sum()
    both = pd.DataFrame({"real_s": real, "replayed_s": replayed}).fillna(0.0)
    both = both[(both["real_s"] > 0) | (both["replayed_s"] > 0)]
    both["difference_s"] = both["replayed_s"] - both["real_s"]
    print(f"{name}: kernels of the profiled real step busy {kernels['device_s'].sum() * 1e3:.2f} ms; "
          f"replayed ops {table['measured_s'].sum() * 1e3:.2f} ms; per op name, largest differences:")
    print(both.reindex(both["difference_s"].abs().sort_values(ascending=False).index).head(12).round(5).to_string())


def evaluate_case(name: str, overrides: list[str], hardware: str, steps: int, db: ProfileDatabase,
                  scratch: Path) -> list[tuple]:
    started = time.perf_counter()
    run = compose_run([f"hardware={hardware}", *ONE_GPU, *overrides])
    hw, par = run.hardware, run.parallelism
    # the real step first (its own process: the GPU's memory is all its own); an MoE model is then traced
    # with the routing its real run took (the router's choice is data: a trace cannot know it)
    routing = RoutingHistogram()
    truth, in_step = measure(hw, run.model, par, steps=steps, warmup=2, profile=True, routing=routing)
    real = truth["step_time_median_s"]
    if routing.tokens:
        routing.write(scratch / f"{name}-{ROUTING_FILE}", f"gpu_accuracy.py case {name}, real run on one GPU")
        run = compose_run([f"hardware={hardware}", *ONE_GPU, *overrides,
                           f"model.moe_routing={scratch / f'{name}-{ROUTING_FILE}'}"])
        per_expert = np.array([counts for _, counts in sorted(routing.tokens.items())])
        print(f"{name}: routing of the real run, busiest / mean expert per layer: "
              f"{np.round(per_expert.max(axis=1) / per_expert.mean(axis=1), 2).tolist()}")
    traced = trace_layout(run.model, par)
    graph, rank_classes = traced.graph.to_pandas(), traced.rank_classes.to_pandas()
    ops = distinct_ops(graph)
    profiling = time.perf_counter()
    rows, summary = profile_ops(ops, hw, run.key("hardware"), db)
    print(f"{name}: {len(ops)} distinct ops profiled with backend {summary.backend} in "
          f"{time.perf_counter() - profiling:.1f} s ({summary.analytical} fell back to the kernel model)")
    reasons = {f["signature"]: f["reason"] for f in summary.fallback}
    for op, signature in zip(ops["op"], ops["signature"]):
        if signature in reasons:
            print(f"  not measured: {op}: {reasons[signature]}")
    sources = {"measured": dict(zip(rows["signature"], rows["median_s"]))}
    # the same ops by the other device timings the profile records (profile/measure.py time_cuda)
    metrics = rows.drop_duplicates("signature", keep="last").set_index("signature")["metrics"].map(json.loads)
    for variant in ("kernel_s", "graph_s"):
        timed = metrics.map(lambda m, v=variant: m.get(v))
        if timed.notna().any():
            sources[f"measured_{variant.removesuffix('_s')}"] = {
                sig: (t if t is not None and t == t else sources["measured"][sig]) for sig, t in timed.items()}
    host_s = metrics.map(lambda m: m.get("host_s"))
    try:
        sources["analytical"] = dict(zip(ops["signature"], predict_rows(ops, hw)))
    except ConfigError as exc:  # a CPU has no datasheet peak: measured only
        print(f"{name}: no analytical prediction ({exc})")
    comm = CommModel.from_hardware(hw)
    predicted = {source: compose_step(graph, rank_classes, par, hw, times, comm).step_time_s
                 for source, times in sources.items()}
    counts = step_counts(graph, par)
    if host_s.notna().any() and "measured_graph" in sources:  # the host as measured: issue time per op
        calls = ops["signature"].map(counts).fillna(0).to_numpy()
        issue = ops["signature"].map(host_s).fillna(0).to_numpy()
        dispatch_s = float((calls * issue).sum() / max(calls.sum(), 1))
        print(f"{name}: host issue time per op, replayed, weighted by the step's calls: {dispatch_s * 1e6:.1f} us")
        with_host = dataclasses.replace(hw, host_dispatch_s=dispatch_s)
        predicted["measured_graph_host"] = compose_step(graph, rank_classes, par, with_host,
                                                        sources["measured_graph"], comm).step_time_s
    attention = in_step[in_step["name"].str.contains("attention|flash|fmha", case=False)]
    print(f"{name}: attention inside one profiled real step (torch.profiler, device seconds):")
    print(attention[["name", "calls", "device_s"]].to_string(index=False))
    print(f"{name}: real step {real * 1e3:.2f} ms (spread {truth['step_time_spread_s'] * 1e3:.2f} ms); predicted "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in predicted.items()))

    table = ops.assign(kind=ops["op"].map(op_kind), calls=ops["signature"].map(counts).fillna(0),
                       measured_s=ops["signature"].map(sources["measured"]),
                       analytical_s=ops["signature"].map(sources.get("analytical", {})))
    table["measured_s"] *= table["calls"]
    table["analytical_s"] *= table["calls"]
    by_kind = table.groupby("kind")[["calls", "measured_s", "analytical_s"]].sum()
    by_kind["ratio"] = by_kind["analytical_s"] / by_kind["measured_s"]
    print(by_kind.round(5).to_string())
    print(table[table["kind"] == "attention"][["op", "calls", "measured_s", "analytical_s"]].to_string(index=False))
    print_real_against_replay(name, in_step, table)
    if torch.cuda.is_available():  # the next case's real step runs in its own process: hand it the GPU's memory
        gc.collect()
        torch.cuda.empty_cache()
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
    print(f"{name}: {time.perf_counter() - started:.0f} s in all")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default="h100-sxm-dgx")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny model (a check of the script on any device)")
    parser.add_argument("--database", type=Path, help="kernel profile database (default: a new temporary one)")
    args = parser.parse_args()
    # the same figure names on another GPU (--hardware h200-sxm-dgx) go to a results file of their own
    results = "gpu_accuracy" if args.hardware == "h100-sxm-dgx" else f"gpu_accuracy_{args.hardware}"
    cases = SMALL if args.small else {name: CASES[name] for name in args.cases}
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.small:
        print("no CUDA device on this machine: nothing measured")
        return
    pd.set_option("display.width", 160)
    db = ProfileDatabase(args.database or Path(tempfile.mkdtemp(prefix="trainsim-gpu-")) / "kernels.parquet")
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    scratch = Path(tempfile.mkdtemp(prefix="trainsim-gpu-routing-"))
    figures = raw_rates() + split_gemm_rates() if on_gpu else []  # first: seconds, and they need nothing else
    for name, overrides in cases.items():
        figures += evaluate_case(name, overrides, args.hardware, args.steps, db, scratch)
        for figure_name, value, unit in figures:  # as each case ends: a run cut short keeps what it measured
            figure(figure_name, value, unit, ".3f", script=results, keep=not args.small)
        figures = []


if __name__ == "__main__":
    main()
