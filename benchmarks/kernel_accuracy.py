"""The kernel model against every op of the H100 published rows, each measured alone on one H100.

The H100 kernel model's GEMM and memory efficiencies are fitted to whole training steps at scale
(`scale_accuracy.py`): they carry everything those runs do beyond one idle GPU's kernels. This separates the
two. `--measure` takes the distinct ops of trainsim's traces of the 21 H100 rows in data/published (the same
traces `scale_accuracy.py` composes) and times each on the GPU with the profile stage's CUDA backend (cold
cache; CUDA-graph replay, kernel sum and events), writing data/kernels/h100_published-rows-ops_trainsim.csv.
Without it, the file is priced with the hardware's kernel model:

* dense GEMMs (bf16 and FP8): the model at the config's values, and with its GEMM parameters (bf16 and FP8
  efficiency, matmul_half_flops) fitted to the measured GEMMs with each GEMM shape left out in turn (a shape =
  the three sizes of one linear at one token count: its forward, input and weight gradient GEMMs together);
  the baseline is a plain roofline on the same protocol (no tile/wave/split-K shape model, no fixed cost);
* streaming kernels (standard elementwise, reduction, copy and optimizer ops over 100 MB, not noted fused):
  the fraction of the datasheet bandwidth they reach;
* the ratios of the config's efficiencies (fitted at scale) to these single-GPU ones;
* the fits behind the kernel model's small-kernel and shape constants (their `# fit:` tags point here):
  launch_overhead_s and memory_half_bytes from the single-kernel streaming ops of every size, and
  profile/analytical.py's GEMM_TILES speeds, SPLIT_K (one speed per doubling of the splits) and MIN_SPLIT_K with
  matmul_half_flops from every measured GEMM (least squares on log time, the efficiencies fitted alongside).

    python benchmarks/kernel_accuracy.py --measure OUT.csv   (on an H100; about 2 min after the traces)
    python benchmarks/kernel_accuracy.py [--data FILE]        (anywhere)

prints `figure kernel_model_mape_pct_h100_gemm_config`, `..._gemm_leave_one_shape_out`,
`baseline_kernel_model_mape_pct_h100_gemm_roofline`, `kernel_gemm_efficiency_h100_<bf16|fp8>`,
`kernel_streaming_bandwidth_fraction_h100`, `sustained_ratio_h100_<bf16|fp8|memory>`, `kernel_launch_overhead_us_h100`,
`kernel_memory_half_bytes_h100`, `kernel_gemm_half_flops_h100_with_shape_fit`, `kernel_gemm_tile_speed_h100_<tile>`,
`kernel_split_k_speed_per_doubling_h100` and `kernel_min_split_k_h100`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from figures import figure
from scipy.optimize import least_squares

from trainsim.config import compose_run
from trainsim.profile.analytical import (
    GEMM_TILES,
    SPLIT_K,
    gemm_dims,
    gemm_shape_efficiency,
    kernel_notes,
    matmul_efficiency,
    op_kind,
    predict,
    predict_rows,
    rates_for,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "data/kernels/h100_published-rows-ops_trainsim.csv"
TABLES = ("mcore2024_h100", "nemo2407_h100_fp8")
HARDWARE = "h100-sxm-dgx"
STREAMING_KINDS = ("elementwise", "reduction", "copy", "optimizer")
STREAMING_MIN_BYTES = 1e8
MIN_SPLIT_K_CANDIDATES = (256, 512, 1024)
"""Shortest reduction per split-K slice tried by the shape fit."""
HEADER = "".join(f"# {line}\n" for line in (
    "source: MEASURED by trainsim's benchmarks/kernel_accuracy.py --measure (the profile stage's CUDA backend), {date}",
    "hardware: {device} (one GPU, idle); software: torch {torch}",
    "what: the distinct ops ({n} of {total}) of trainsim's ex-situ traces of the H100 rows of data/published "
    "({tables}), rebuilt from its recorded shapes, strides and dtypes and timed alone; the columns op .. bytes_moved "
    "are the trace's (trainsim/trace/schema.py)",
    "timing: graph_ms = median of 20 CUDA-graph replays (device time, no host gaps; empty where the op cannot be "
    "captured), kernel_ms = the profiled call's kernels summed, event_ms = median of 20 CUDA events around an eager "
    "call; L2 flushed before each (cold cache)",
    "not measured: {missing}",
    "caveats: ops the trace notes as fused (op_args \"fused\") and trainsim's own fused ops (trainsim::rms_norm, "
    "swiglu, rotary) ran as separate kernels / their reference composition, not as the fused kernels Transformer "
    "Engine runs; GEMMs noted with comm_sms ran on all SMs"))


def published_ops() -> pd.DataFrame:
    """The distinct ops of the H100 tables' row traces (traced on first use, as scale_accuracy.py does)."""
    from trainsim.validation.published import TABLES as PUBLISHED
    from trainsim.validation.published import RowRun, read_table, row_configs, trace_rows
    from trainsim.validation.traces import trace_tables

    base = compose_run([f"hardware={HARDWARE}", "model=gpt-small", "parallelism=single"])
    runs = []
    for name in TABLES:
        rows = read_table(name)
        runs += [RowRun(*row_configs(PUBLISHED[name], row, base.model, base.parallelism), Path())
                 for _, row in rows[rows["skip_reason"].isna()].iterrows()]
    ops = pd.concat([trace_tables(run.directory)[2] for run in trace_rows(runs)])
    return ops.drop_duplicates("signature").reset_index(drop=True)


def measure(out: Path) -> None:
    """Time every op on this GPU; ops run one batch at a time and any that failed (out of memory) once more
    alone. The ones still failing are named in the file's header. (Until session 29 the profiling process
    stranded GPU memory on a new warm-up stream per op, and the three largest optimizer steps ran out of it
    after ~1,000 ops; with one warm-up stream and the cache emptied after each op, an H200 kept 5.8 GiB
    reserved over 600 ops, against 18.8 GiB, and ran the five largest after 1,000.)"""
    import datetime
    import tempfile

    import torch

    from trainsim.profile.database import ProfileDatabase
    from trainsim.profile.stage import profile_ops

    run = compose_run([f"hardware={HARDWARE}", "model=gpt-small", "parallelism=single"])
    ops = published_ops()
    db = ProfileDatabase(Path(tempfile.mkdtemp(prefix="trainsim-kernels-")) / "kernels.parquet")

    def profile(batch: pd.DataFrame, remeasure: bool = False) -> list[dict]:
        """Time `batch` into the database with the GPU's cache emptied first; the ops that fell back."""
        gc.collect()
        torch.cuda.empty_cache()
        _, summary = profile_ops(batch.reset_index(drop=True), run.hardware, run.key("hardware"), db,
                                 remeasure=remeasure)
        return summary.fallback

    failed = [f["signature"] for start in range(0, len(ops), 100) for f in profile(ops.iloc[start:start + 100])]
    still = [f for signature in failed for f in profile(ops[ops["signature"] == signature], remeasure=True)]
    for f in still:
        print(f"not measured: {f['op']}: {f['reason'][:200]}")
    missing = [f"{f['op']} ({f['reason'].split('.')[0][:60]})" for f in still]
    rows = db.read()
    rows = rows[rows["backend"] == "cuda"]
    metrics = rows["metrics"].map(json.loads)
    table = rows[["op", "input_shapes", "input_strides", "input_dtypes", "op_args", "flops", "bytes_moved"]].assign(
        graph_ms=metrics.map(lambda m: m.get("graph_s")).astype(float) * 1e3,
        kernel_ms=metrics.map(lambda m: m.get("kernel_s")).astype(float) * 1e3,
        event_ms=rows["median_s"] * 1e3,
        kernels=rows["kernels"].map(lambda k: len(json.loads(k))),
        first_kernel=rows["kernels"].map(lambda k: next((n[:120] for n in json.loads(k)
                                                          if not n.startswith(("Memset", "Memcpy"))), "")))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        f.write(HEADER.format(date=datetime.date.today(), device=torch.cuda.get_device_name(),
                              torch=torch.__version__, n=len(table), total=len(ops), tables=", ".join(TABLES),
                              missing=f"{len(missing)} ops: " + "; ".join(missing) if missing else "none"))
        table.sort_values(["op", "flops"]).to_csv(f, index=False)
    print(f"wrote {len(table)} ops to {out}")


def read(data: Path) -> pd.DataFrame:
    ops = pd.read_csv(data, comment="#", keep_default_na=False, na_values={"graph_ms": [""]})
    ops["measured_s"] = ops["graph_ms"].fillna(ops["event_ms"]) / 1e3
    ops["kind"] = ops["op"].map(op_kind)
    return ops


def gemms(ops: pd.DataFrame) -> pd.DataFrame:
    """The dense GEMMs, priced as measured: alone, on all SMs (the comm-overlap notes dropped)."""
    g = ops[ops["kind"] == "matmul"].copy()
    g["op_args"] = "{}"
    g["fp8"] = g["input_dtypes"].str.startswith("float8")
    g["shape"] = [tuple(sorted(gemm_dims(op, json.loads(s))[1:])) for op, s in zip(g["op"], g["input_shapes"])]
    return g.reset_index(drop=True)


def with_gemm(hw, bf16: float, fp8: float, half_flops: float, shapes: bool = True):
    km = dataclasses.replace(hw.kernel_model, matmul_efficiency=bf16, fp8_matmul_efficiency=fp8,
                             matmul_half_flops=half_flops)
    return dataclasses.replace(hw, kernel_model=km, sm_count=hw.sm_count if shapes else 0)


def fit_gemm(g: pd.DataFrame, hw, shapes: bool = True) -> tuple[float, float, float]:
    """bf16 and FP8 efficiency and matmul_half_flops (GFLOP) by least squares on log time; the roofline baseline
    (shapes=False) fits the two efficiencies only."""
    def residuals(x):
        half = x[2] * 1e9 if shapes else 0.0
        return np.log(predict_rows(g, with_gemm(hw, x[0], x[1], half, shapes)) / g["measured_s"].to_numpy())

    start, upper = ([0.8, 0.8, 1.0], [1.0, 1.0, 100.0]) if shapes else ([0.8, 0.8], [1.0, 1.0])
    x = least_squares(residuals, start, bounds=([0.2] * len(start), upper)).x
    return float(x[0]), float(x[1]), float(x[2] * 1e9) if shapes else 0.0


def leave_one_shape_out(g: pd.DataFrame, hw, shapes: bool = True) -> np.ndarray:
    errors = np.empty(len(g))
    for shape in g["shape"].unique():
        held = (g["shape"] == shape).to_numpy()
        params = fit_gemm(g[~held], hw, shapes)
        errors[held] = predict_rows(g[held], with_gemm(hw, *params, shapes)) / g.loc[held, "measured_s"] - 1
    return errors


def streaming(ops: pd.DataFrame, min_bytes: float = STREAMING_MIN_BYTES) -> pd.DataFrame:
    fused = ops["op_args"].map(lambda a: kernel_notes(a).get("fused", 0) > 0)
    return ops[ops["kind"].isin(STREAMING_KINDS) & ~fused & ~ops["op"].str.startswith("trainsim::")
               & (ops["bytes_moved"] > min_bytes)]


def fit_small_kernels(ops: pd.DataFrame, hw) -> tuple[float, float, float]:
    """(launch_overhead_s, memory_half_bytes, memory efficiency) of the single-kernel streaming ops of every size
    (elementwise, reduction, copy, optimizer; not noted fused): t = launch + (bytes + B_half) / (R_mem), least
    squares on log time with a robust loss (the ops' access patterns differ: a few are far off any one line)."""
    s = streaming(ops, min_bytes=0)
    s = s[s["kernels"] == 1]
    b, t = s["bytes_moved"].to_numpy(float), s["measured_s"].to_numpy(float)

    def residuals(x):
        return np.log((x[0] * 1e-6 + (b + x[1] * 1e6) / (hw.memory_bandwidth_bytes_per_s * x[2])) / t)

    x = least_squares(residuals, [4.0, 0.1, 0.8], bounds=([0, 0, 0.1], [50, 1e3, 1.0]), loss="soft_l1",
                      f_scale=0.1).x
    return float(x[0] * 1e-6), float(x[1] * 1e6), float(x[2])


class ShapeModel(NamedTuple):
    """analytical.py's GEMM shape constants: each tile's and split's speed (the largest tiles and no split at 1)."""

    tiles: tuple
    splits: tuple
    min_split_k: int


def shape_model(x, min_split_k: int) -> ShapeModel:
    """x: the speeds of the tiles after the two largest, then the speed kept per doubling of the splits."""
    sizes = [(rows, cols) for rows, cols, _ in GEMM_TILES]
    speeds = [1.0, 1.0, *x[:len(sizes) - 2]]
    per_doubling = float(x[len(sizes) - 2])
    return ShapeModel(tuple((r, c, float(v)) for (r, c), v in zip(sizes, speeds)),
                      tuple((n, per_doubling ** math.log2(n)) for n, _ in SPLIT_K), min_split_k)


def predict_shape(g: pd.DataFrame, hw, model: ShapeModel, bf16: float, fp8: float, half_flops: float) -> np.ndarray:
    """The GEMMs' times at these shape constants, efficiencies and matmul_half_flops (other parameters as hw)."""
    km = dataclasses.replace(hw.kernel_model, matmul_efficiency=bf16, fp8_matmul_efficiency=fp8,
                             matmul_half_flops=half_flops)
    hw = dataclasses.replace(hw, kernel_model=km)
    out = np.empty(len(g))
    for fp8_rows in (False, True):
        sel = (g["fp8"] == fp8_rows).to_numpy()
        dtype = "fp8" if fp8_rows else "bf16"
        q = [gemm_shape_efficiency(*gemm_dims(op, json.loads(s)), hw.sm_count, dtype, model.tiles, model.splits,
                                   model.min_split_k) for op, s in zip(g.loc[sel, "op"], g.loc[sel, "input_shapes"])]
        out[sel] = predict(rates_for(hw, dtype), g.loc[sel, "flops"], g.loc[sel, "bytes_moved"],
                           ["matmul"] * int(sel.sum()), q)
    return out


def fit_shape_model(g: pd.DataFrame, hw) -> tuple[ShapeModel, float, float, float]:
    """The shape constants with the GEMM efficiencies and matmul_half_flops, by least squares on log time over
    every measured GEMM, at each candidate MIN_SPLIT_K (the best kept); tile and split speeds bounded to (0.2, 1]."""
    def residuals(x, min_split_k: int):
        model = shape_model(x[3:], min_split_k)
        return np.log(predict_shape(g, hw, model, x[0], x[1], x[2] * 1e9) / g["measured_s"].to_numpy())

    best = None
    free = len(GEMM_TILES) - 2 + 1
    bounds = ([0.2, 0.2, 0.0, *[0.2] * free], [1.0, 1.0, 100.0, *[1.0] * free])
    for min_split_k in MIN_SPLIT_K_CANDIDATES:
        result = least_squares(residuals, [0.8, 0.8, 1.0, *[0.8] * free], bounds=bounds, args=(min_split_k,))
        if best is None or result.cost < best[0].cost:
            best = (result, min_split_k)
    result, min_split_k = best
    return shape_model(result.x[3:], min_split_k), float(result.x[0]), float(result.x[1]), float(result.x[2] * 1e9)


def evaluate(data: Path) -> None:
    hw = compose_run([f"hardware={HARDWARE}", "model=gpt-small", "parallelism=single"]).hardware
    km = hw.kernel_model
    ops = read(data)
    g = gemms(ops)
    config_error = predict_rows(g, hw) / g["measured_s"] - 1
    bf16, fp8, half = fit_gemm(g, hw)
    held_out = leave_one_shape_out(g, hw)
    roofline = leave_one_shape_out(g, hw, shapes=False)
    print(f"{len(g)} GEMMs ({int(g['fp8'].sum())} FP8) in {g['shape'].nunique()} shapes; measured "
          f"{(g['flops'] / g['measured_s']).max() / 1e12:.0f} TFLOP/s at most")
    for fp8_rows, name in ((False, "bf16"), (True, "fp8")):
        sel = (g["fp8"] == fp8_rows).to_numpy()
        print(f"  {name}: config {100 * np.abs(config_error[sel]).mean():.2f} % (bias "
              f"{100 * config_error[sel].mean():+.2f} %), fitted with each shape left out "
              f"{100 * np.abs(held_out[sel]).mean():.2f} %, roofline {100 * np.abs(roofline[sel]).mean():.2f} %")
    worst = g.assign(error_pct=100 * held_out).reindex(np.argsort(-np.abs(held_out))).head(8)
    print("worst held out:\n" + worst[["op", "input_shapes", "input_dtypes", "measured_s", "error_pct"]]
          .to_string(index=False))
    stream = streaming(ops)
    fraction = float(np.median(stream["bytes_moved"] / stream["measured_s"] / hw.memory_bandwidth_bytes_per_s))
    print(f"{len(stream)} streaming ops over {STREAMING_MIN_BYTES / 1e6:.0f} MB: median "
          f"{fraction:.3f} of the datasheet bandwidth")
    launch_s, memory_half_bytes, _ = fit_small_kernels(ops, hw)
    shapes, _, _, shape_half_flops = fit_shape_model(g, hw)
    print(f"fitted shape constants (profile/analytical.py): tiles {shapes.tiles}, splits "
          f"{tuple((n, round(v, 3)) for n, v in shapes.splits)}, MIN_SPLIT_K {shapes.min_split_k}")
    figures = {
        "kernel_model_mape_pct_h100_gemm_config": (100 * np.abs(config_error).mean(), "%"),
        "kernel_model_bias_pct_h100_gemm_config": (100 * config_error.mean(), "%"),
        "kernel_model_mape_pct_h100_gemm_leave_one_shape_out": (100 * np.abs(held_out).mean(), "%"),
        "baseline_kernel_model_mape_pct_h100_gemm_roofline": (100 * np.abs(roofline).mean(), "%"),
        "kernel_gemm_efficiency_h100_bf16": (bf16, "ratio"),
        "kernel_gemm_efficiency_h100_fp8": (fp8, "ratio"),
        "kernel_gemm_half_flops_h100": (half / 1e9, "GFLOP"),
        "kernel_gemm_half_flops_h100_with_shape_fit": (shape_half_flops / 1e9, "GFLOP"),
        "kernel_launch_overhead_us_h100": (launch_s * 1e6, "us"),
        "kernel_memory_half_bytes_h100": (memory_half_bytes / 1e6, "MB"),
        **{f"kernel_gemm_tile_speed_h100_{r}x{c}": (v, "ratio") for r, c, v in shapes.tiles[2:]},
        "kernel_split_k_speed_per_doubling_h100": (shapes.splits[1][1], "ratio"),
        "kernel_min_split_k_h100": (shapes.min_split_k, "elements"),
        "kernel_streaming_bandwidth_fraction_h100": (fraction, "ratio"),
        "sustained_ratio_h100_bf16": (matmul_efficiency(km, "bf16") / bf16, "ratio"),
        "sustained_ratio_h100_fp8": (matmul_efficiency(km, "fp8") / fp8, "ratio"),
        "sustained_ratio_h100_memory": (km.memory_efficiency / fraction, "ratio"),
    }
    for name, (value, unit) in figures.items():
        figure(name, value, unit, ".3f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--measure", type=Path, metavar="OUT.csv", help="time the ops on this GPU, write them here")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
    else:
        evaluate(args.data)


if __name__ == "__main__":
    main()
