"""Fused attention: the kernel model against measured scaled_dot_product_attention times on a GPU.

A training step's attention runs as one fused kernel per pass (cuDNN's on Hopper: Transformer Engine prefers its
FusedAttention there, and torch's dispatcher picks cuDNN too). Its throughput depends on the sequence length (each
query tile's fixed work is amortised over the keys it visits) and on attention dropout (a random number per
score, generated inside the kernel). This checks `profile/analytical.py`'s attention pricing on causal bf16
shapes of the models trainsim ships, with and without dropout, forward and backward.

    python benchmarks/attention_accuracy.py --measure data/kernels/h100_sdpa-attention_trainsim.csv
        (on a GPU: sweeps sequence length x heads x dropout, forward and backward; writes the measurements)
    python benchmarks/attention_accuracy.py [--hardware h100-sxm-dgx] [--data FILE]
        (anywhere: prices every measured point with the hardware's kernel model)

prints `figure attention_model_mape_pct_<gpu> <v> %` (mean |model / measured - 1| over the points), the same per
pass and dropout, the worst points, and the parameters fitted leaving each sequence length out in turn
(`figure attention_model_mape_pct_<gpu>_leave_one_seq_out`).
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
DEFAULT_DATA = REPO / "data/kernels/h100_sdpa-attention_trainsim.csv"
HEAD_DIM = 128
SEQS = (1024, 2048, 4096, 8192, 16384)
HEADS = (8, 16, 32, 64)
GQA = ((32, 8), (64, 8))
"""(query heads, key/value heads) measured as grouped-query attention, without dropout."""
DROPOUT = 0.1
FORWARD_OP, BACKWARD_OP = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
"""The ops a CPU trace records for fused attention (profile/replay.py replays them through SDPA on a GPU)."""


def sweep() -> list[dict]:
    points = []
    for seq in SEQS:
        for heads in HEADS:
            for dropout in (0.0, DROPOUT):
                points.append({"seq": seq, "heads": heads, "kv_heads": heads, "dropout": dropout})
        for heads, kv_heads in GQA:
            points.append({"seq": seq, "heads": heads, "kv_heads": kv_heads, "dropout": 0.0})
    return [{**p, "pass": which} for p in points for which in ("fwd", "bwd")]


def attention_call(point: dict):
    """The measured call of one point (batch 1, causal, bf16) on fresh random operands."""
    import torch

    shape = (1, point["heads"], point["seq"], HEAD_DIM)
    kv_shape = (1, point["kv_heads"], point["seq"], HEAD_DIM)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=point["dropout"], is_causal=True, enable_gqa=point["kv_heads"] != point["heads"])

    if point["pass"] == "fwd":
        return forward
    out = forward()
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def measure(out: Path) -> None:
    import torch

    from trainsim.profile.measure import CacheFlush, measured_kernel_point, write_measurements

    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a GPU")
    flush, rows = CacheFlush("cuda"), []
    for point in sweep():
        times, timing = measured_kernel_point(attention_call(point), flush)
        attention = [n for n in timing.kernels if "attn" in n.lower() or "sdpa" in n.lower() or "fmha" in n.lower()]
        rows.append({**point, **times, "attention_kernel": (attention or timing.kernels or [""])[0][:80]})
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        torch.cuda.empty_cache()
    header = [
        f"# source: MEASURED by trainsim's benchmarks/attention_accuracy.py --measure, {datetime.date.today()}",
        f"# hardware: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count}"
        f" SMs); software: torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
        "# what: causal bf16 torch.nn.functional.scaled_dot_product_attention, batch 1, head dim 128, the kernel"
        " torch's dispatcher picks (attention_kernel); pass fwd = the forward call, bwd = autograd.grad of its"
        " output (q, k, v); dropout = dropout_p inside the kernel",
        "# timing: event_ms = median of 20 calls between CUDA events, caches flushed before each; kernel_ms = the"
        " profiled call's kernels summed; graph_ms = median of CUDA-graph replays (empty: not capturable)",
    ]
    write_measurements(out, header, rows)


def trace_rows(points: pd.DataFrame) -> pd.DataFrame:
    """The execution-graph rows the tracer records for these calls (trace/recorder.py: shapes, FLOPs of the
    full square, bytes, and the dropout the model asked for in op_args)."""
    rows = []
    for _, p in points.iterrows():
        q, kv = [1, p.heads, p.seq, HEAD_DIM], [1, p.kv_heads, p.seq, HEAD_DIM]
        forward = 4 * p.heads * p.seq * p.seq * HEAD_DIM
        if p["pass"] == "fwd":
            op, shapes, flops, tensors = FORWARD_OP, [q, kv, kv], forward, 3
        else:
            op, shapes, flops, tensors = BACKWARD_OP, [q, q, kv, kv, q, [1, p.heads, p.seq]], int(2.5 * forward), 6
        elements = sum(int(np.prod(s)) for s in shapes) + int(np.prod(q))
        args = [{"$t": i} for i in range(tensors)] + [0.0, True]
        rows.append({"op": op, "input_shapes": json.dumps(shapes), "input_dtypes": ",".join(["bf16"] * tensors),
                     "flops": flops, "bytes_moved": 2 * elements,
                     "op_args": json.dumps({"args": args, "kwargs": {}, "dropout_p": float(p.dropout)})})
    return pd.DataFrame(rows)


FITTED = ("attention_forward_efficiency", "attention_backward_efficiency", "attention_tile_keys",
          "attention_dropout_forward_s_per_score", "attention_dropout_backward_s_per_score",
          "attention_setup_forward_s", "attention_setup_backward_s")
SCALE = np.array([1.0, 1.0, 1e3, 1e-12, 1e-12, 1e-6, 1e-6])
"""Units the fit works in: efficiencies, thousands of keys, ps per score, us."""
PRIOR = (0.637, 0.538, 0, 0, 0, 0, 0)
"""The model before these measurements: FlashAttention-3's causal H100 rates at seq 8192 (data/kernels), nothing
else."""


def with_attention(hw, values):
    return dataclasses.replace(hw, kernel_model=dataclasses.replace(hw.kernel_model, **dict(zip(FITTED, values))))


def device_seconds(points: pd.DataFrame) -> np.ndarray:
    """The calls' device time: the CUDA-graph replay (events around an eager call also count the host's issue
    time, which a training step hides), else the profiled kernels' sum."""
    return points["graph_ms"].fillna(points["kernel_ms"]).to_numpy() / 1e3


def fit_attention(points: pd.DataFrame, hw) -> tuple[float, ...]:
    """The attention parameters (FITTED) minimising the log error over `points`."""
    rows, measured = trace_rows(points), device_seconds(points)

    def residuals(x):
        return np.log(predict_rows(rows, with_attention(hw, x * SCALE)) / measured)

    lower, upper = [0.1, 0.1, 0, 0, 0, 0, 0], [1.0, 1.0, 20, 50, 50, 500, 500]
    return tuple(least_squares(residuals, [0.6, 0.5, 1, 1, 1, 10, 10], bounds=(lower, upper)).x * SCALE)


def mape(points: pd.DataFrame, hw) -> np.ndarray:
    return np.abs(predict_rows(trace_rows(points), hw) / device_seconds(points) - 1) * 100


def evaluate(hardware: str, data: Path) -> None:
    points = pd.read_csv(data, comment="#")
    hw = compose_run([f"hardware={hardware}"]).hardware
    name = hardware.split("-")[0]
    km = hw.kernel_model
    print(f"{len(points)} points from {data.relative_to(REPO) if data.is_relative_to(REPO) else data}; {hardware}: "
          + ", ".join(f"{f} {getattr(km, f):.4g}" for f in FITTED))
    points["device_ms"] = 1e3 * device_seconds(points)
    points["model_ms"] = 1e3 * predict_rows(trace_rows(points), hw)
    points["error_pct"] = 100 * (points["model_ms"] / points["device_ms"] - 1)
    factor = np.where(points["pass"] == "fwd", 4, 10) / 2  # causal: half the square
    points["tflops"] = factor * points["heads"] * points["seq"] ** 2 * HEAD_DIM / points["device_ms"] / 1e9
    print(points.groupby(["pass", "dropout"])["error_pct"].agg(["count", "mean", lambda e: e.abs().mean()])
          .rename(columns={"<lambda_0>": "mape"}).round(1).to_string())
    print("worst points:")
    worst = points.reindex(points["error_pct"].abs().sort_values(ascending=False).index).head(8)
    print(worst[["pass", "seq", "heads", "kv_heads", "dropout", "device_ms", "model_ms", "tflops", "error_pct"]]
          .round(3).to_string(index=False))
    figure(f"attention_model_mape_pct_{name}", points['error_pct'].abs().mean(), "%")
    for (which, dropout), errors in points.groupby(["pass", "dropout"])["error_pct"]:
        figure(f"attention_model_mape_pct_{name}_{which}_dropout{dropout:g}", errors.abs().mean(), "%")
    held_out = []
    for seq in sorted(points["seq"].unique()):
        values = fit_attention(points[points["seq"] != seq], hw)
        errors = mape(points[points["seq"] == seq], with_attention(hw, values))
        held_out.append(errors)
        print(f"seq {seq} held out: fitted on the others " + ", ".join(f"{f} {v:.4g}" for f, v in zip(FITTED, values))
              + f"; MAPE {errors.mean():.2f} %, max {errors.max():.1f} %")
    values = fit_attention(points, hw)
    print("fitted on all points (the values for conf/hardware): " + ", ".join(f"{f} {v:.4g}"
                                                                            for f, v in zip(FITTED, values)))
    figure(f"attention_model_mape_pct_{name}_leave_one_seq_out", np.concatenate(held_out).mean(), "%")
    prior = mape(points, with_attention(hw, PRIOR)).mean()
    figure(f"baseline_attention_mape_pct_{name}_flash_attention3_rates", prior, "%")


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
