"""Grouped expert GEMMs: the kernel model against measured torch._grouped_mm times on a GPU.

An MoE step's expert GEMMs run as one grouped kernel over all local experts (Megatron-Core's GroupedMLP, TE's
GroupedLinear; trainsim::grouped_mm in the trace). Their cost depends on how many tokens each expert got: few
tokens per expert make short, padded tiles (forward and input gradient) or short reductions (weight gradient).
This checks `profile/analytical.py`'s grouped-GEMM pricing on the shapes of real MoEs' expert layers.

    python benchmarks/grouped_gemm_accuracy.py --measure data/kernels/h100_grouped-gemm-bf16_trainsim.csv
        (on a GPU: sweeps experts x tokens per expert x the expert FFN shapes of Qwen3-30B-A3B, DeepSeek-V3 and
        Mixtral 8x7B, balanced and skewed routing, forward and weight gradient; writes the measurements)
    python benchmarks/grouped_gemm_accuracy.py [--hardware h100-sxm-dgx] [--data FILE]
        (anywhere: prices every measured point with the hardware's kernel model)

prints `figure grouped_gemm_model_mape_pct_<hardware> <v> %` (mean |model / measured - 1| over the points,
measured = the CUDA-graph replay: device time without host gaps), the same per op and routing, and the worst
points. The kernel model's two efficiencies are fitted on dense GEMM step tables, never on these points.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import numpy as np
import pandas as pd
from figures import figure
from scipy.optimize import least_squares

from trainsim.config import compose_run
from trainsim.profile.analytical import predict_rows

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "data/kernels/h100_grouped-gemm-bf16_trainsim.csv"
EXPERT_FFNS = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048), "mixtral-8x7b": (4096, 14336)}
"""Hidden size and expert FFN width: fc1 is [h, 2 f] (gate and up fused), fc2 [f, h]."""
EXPERTS = (4, 16, 64)
TOKENS_PER_EXPERT = (64, 256, 1024, 4096)
MAX_TOKENS, MAX_WEIGHT_BYTES = 65536, 8 << 30
SKEW = 1.0
"""Skewed routing: expert e gets tokens in proportion to 1 / (e + 1)^SKEW (Zipf; 0 is balanced)."""


def routing(experts: int, tokens: int, skew: float) -> list[int]:
    """Tokens per expert summing to `tokens`, in proportion to 1 / (e + 1)^skew (largest remainders)."""
    share = 1.0 / np.arange(1, experts + 1) ** skew
    exact = tokens * share / share.sum()
    counts = np.floor(exact).astype(int)
    counts[np.argsort(counts - exact)[: tokens - counts.sum()]] += 1
    return counts.tolist()


def sweep() -> list[dict]:
    """The points measured: (op, k, n, counts) for every expert FFN GEMM, expert count and load."""
    points = []
    for model, (hidden, ffn) in EXPERT_FFNS.items():
        for layer, (k, n) in (("fc1", (hidden, 2 * ffn)), ("fc2", (ffn, hidden))):
            for experts in EXPERTS:
                if experts * k * n * 2 > MAX_WEIGHT_BYTES:
                    continue
                for per_expert in TOKENS_PER_EXPERT:
                    tokens = experts * per_expert
                    if tokens > MAX_TOKENS:
                        continue
                    for skew in (0.0, SKEW):
                        for op in ("grouped_mm", "grouped_mm_weight_grad"):
                            points.append({"model": model, "layer": layer, "op": op, "experts": experts,
                                           "k": k, "n": n, "tokens": tokens, "skew": skew,
                                           "counts": " ".join(map(str, routing(experts, tokens, skew)))})
    return points


def grouped_call(point: dict):
    """The measured call of one point, on fresh random operands on the GPU."""
    import torch

    from trainsim.workloads.grouped_gemm import grouped_mm, grouped_mm_weight_grad

    counts = [int(c) for c in point["counts"].split()]
    tokens, k, n = point["tokens"], point["k"], point["n"]
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    if point["op"] == "grouped_mm":
        w = torch.randn(point["experts"], k, n, device="cuda", dtype=torch.bfloat16)
        return lambda: grouped_mm(x, w, counts)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    return lambda: grouped_mm_weight_grad(x, grad, counts)


def measure(out: Path) -> None:
    import torch

    from trainsim.profile.measure import CacheFlush, measured_kernel_point, write_measurements

    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a GPU")
    flush, rows = CacheFlush("cuda"), []
    for point in sweep():
        rows.append({**point, **measured_kernel_point(grouped_call(point), flush)[0]})
        print(f"{point['model']} {point['layer']} {point['op']} E={point['experts']} T={point['tokens']} "
              f"skew={point['skew']}: graph {rows[-1]['graph_ms']:.3f} ms, kernels {rows[-1]['kernel_ms']:.3f} ms",
              flush=True)
        torch.cuda.empty_cache()
    header = [
        f"# source: MEASURED by trainsim's benchmarks/grouped_gemm_accuracy.py --measure, {datetime.date.today()}",
        f"# hardware: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count}"
        f" SMs); software: torch {torch.__version__}, torch._grouped_mm (one kernel per call)",
        "# what: bf16 grouped GEMMs of MoE expert layers, x [tokens, k] times w [experts, k, n] (op grouped_mm) and"
        " the weight gradient x^T grad per expert -> [experts, k, n] (op grouped_mm_weight_grad);"
        " counts = tokens per expert",
        "# timing: graph_ms = median of 20 CUDA-graph replays (device time, no host gaps), caches flushed before each;"
        " kernel_ms = the profiled call's kernels summed; event_ms = CUDA events around an eager call",
    ]
    write_measurements(out, header, rows)


def trace_rows(points: pd.DataFrame) -> pd.DataFrame:
    """The execution-graph rows the tracer records for these calls (shapes, dtypes, FLOPs, bytes, counts)."""
    rows = []
    for p in points.itertuples():
        counts = [int(c) for c in p.counts.split()]
        if p.op == "grouped_mm":
            shapes, out_elems = [[p.tokens, p.k], [p.experts, p.k, p.n]], p.tokens * p.n
        else:
            shapes, out_elems = [[p.tokens, p.k], [p.tokens, p.n]], p.experts * p.k * p.n
        elems = sum(int(np.prod(s)) for s in shapes) + out_elems
        rows.append({"op": f"trainsim::{p.op}", "input_shapes": json.dumps(shapes), "input_dtypes": "bf16,bf16",
                     "flops": 2 * p.tokens * p.k * p.n, "bytes_moved": 2 * elems,
                     "op_args": json.dumps({"args": [{"$t": 0}, {"$t": 1}, counts], "kwargs": {}})})
    return pd.DataFrame(rows)


def with_grouped(hw, setup_s: float, memory_efficiency: float):
    """The hardware with these grouped-GEMM parameters (0, 0: priced as plain GEMMs)."""
    return dataclasses.replace(hw, kernel_model=dataclasses.replace(
        hw.kernel_model, grouped_gemm_setup_s=setup_s, grouped_gemm_memory_efficiency=memory_efficiency))


def fit_grouped(points: pd.DataFrame, hw) -> tuple[float, float]:
    """(setup seconds, memory efficiency) minimising the log error over `points` (the matmul efficiency and
    tile model stay the hardware's)."""
    rows, measured = trace_rows(points), points["graph_ms"].to_numpy() / 1e3

    def residuals(x):
        return np.log(predict_rows(rows, with_grouped(hw, x[0] * 1e-6, x[1])) / measured)

    return tuple(least_squares(residuals, [5.0, 0.8], bounds=([0.1, 0.2], [100.0, 1.0])).x * [1e-6, 1.0])


def mape(points: pd.DataFrame, hw) -> np.ndarray:
    return np.abs(predict_rows(trace_rows(points), hw) / (points["graph_ms"].to_numpy() / 1e3) - 1) * 100


def evaluate(hardware: str, data: Path) -> None:
    points = pd.read_csv(data, comment="#").dropna(subset=["graph_ms"])
    hw = compose_run([f"hardware={hardware}"]).hardware
    name = hardware.split("-")[0]
    km = hw.kernel_model
    print(f"{len(points)} points from {data.relative_to(REPO) if data.is_relative_to(REPO) else data}; "
          f"{hardware}: grouped_gemm_setup_s {km.grouped_gemm_setup_s:.3g}, "
          f"grouped_gemm_memory_efficiency {km.grouped_gemm_memory_efficiency:.3g}")
    points["model_ms"] = 1e3 * predict_rows(trace_rows(points), hw)
    points["error_pct"] = 100 * (points["model_ms"] / points["graph_ms"] - 1)
    points["routing"] = np.where(points["skew"] > 0, "skewed", "balanced")
    points["tflops"] = 2 * points["tokens"] * points["k"] * points["n"] / points["graph_ms"] / 1e9
    print(points.groupby(["op", "routing"])["error_pct"].agg(["count", "mean", lambda e: e.abs().mean()])
          .rename(columns={"<lambda_0>": "mape"}).round(1).to_string())
    print("worst points:")
    worst = points.reindex(points["error_pct"].abs().sort_values(ascending=False).index).head(8)
    print(worst[["model", "layer", "op", "experts", "tokens", "routing", "graph_ms", "model_ms", "tflops",
                 "error_pct"]].round(3).to_string(index=False))
    figure(f"grouped_gemm_model_mape_pct_{name}", points['error_pct'].abs().mean(), "%")
    for (op, kind), errors in points.groupby(["op", "routing"])["error_pct"]:
        figure(f"grouped_gemm_model_mape_pct_{name}_{op}_{kind}", errors.abs().mean(), "%")
    held_out = []
    for model in sorted(points["model"].unique()):
        setup_s, efficiency = fit_grouped(points[points["model"] != model], hw)
        errors = mape(points[points["model"] == model], with_grouped(hw, setup_s, efficiency))
        held_out.append(errors)
        print(f"{model} held out: fitted on the others setup {setup_s * 1e6:.1f} us, memory efficiency "
              f"{efficiency:.3f}; MAPE {errors.mean():.2f} %, max {errors.max():.1f} %")
    setup_s, efficiency = fit_grouped(points, hw)
    print(f"fitted on all points (the values for conf/hardware): grouped_gemm_setup_s {setup_s:.3g}, "
          f"grouped_gemm_memory_efficiency {efficiency:.3f}")
    figure(f"grouped_gemm_model_mape_pct_{name}_leave_one_model_out", np.concatenate(held_out).mean(), "%")
    dense = mape(points, with_grouped(hw, 0, 0)).mean()
    figure(f"baseline_grouped_gemm_mape_pct_{name}_as_dense_gemm", dense, "%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", type=Path, help="measure on this machine's GPU and write the points here")
    parser.add_argument("--hardware", default="h100-sxm-dgx")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
    else:
        evaluate(args.hardware, args.data)


if __name__ == "__main__":
    main()
