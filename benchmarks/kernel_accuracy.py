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
* the ratios of the config's efficiencies (fitted at scale) to these single-GPU ones.

    python benchmarks/kernel_accuracy.py --measure OUT.csv   (on an H100; about 2 min after the traces)
    python benchmarks/kernel_accuracy.py [--data FILE]        (anywhere)

prints `figure kernel_model_mape_pct_h100_gemm_config`, `..._gemm_leave_one_shape_out`,
`baseline_kernel_model_mape_pct_h100_gemm_roofline`, `kernel_gemm_efficiency_h100_<bf16|fp8>`,
`kernel_streaming_bandwidth_fraction_h100` and `sustained_ratio_h100_<bf16|fp8|memory>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path

import numpy as np
import pandas as pd
from figures import figure
from scipy.optimize import least_squares

from trainsim.config import compose_run
from trainsim.profile.analytical import gemm_dims, kernel_notes, matmul_efficiency, op_kind, predict_rows

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "data/kernels/h100_published-rows-ops_trainsim.csv"
TABLES = ("mcore2024_h100", "nemo2407_h100_fp8")
HARDWARE = "h100-sxm-dgx"
STREAMING_KINDS = ("elementwise", "reduction", "copy", "optimizer")
STREAMING_MIN_BYTES = 1e8
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


def streaming(ops: pd.DataFrame) -> pd.DataFrame:
    fused = ops["op_args"].map(lambda a: kernel_notes(a).get("fused", 0) > 0)
    return ops[ops["kind"].isin(STREAMING_KINDS) & ~fused & ~ops["op"].str.startswith("trainsim::")
               & (ops["bytes_moved"] > STREAMING_MIN_BYTES)]


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
    figures = {
        "kernel_model_mape_pct_h100_gemm_config": (100 * np.abs(config_error).mean(), "%"),
        "kernel_model_bias_pct_h100_gemm_config": (100 * config_error.mean(), "%"),
        "kernel_model_mape_pct_h100_gemm_leave_one_shape_out": (100 * np.abs(held_out).mean(), "%"),
        "baseline_kernel_model_mape_pct_h100_gemm_roofline": (100 * np.abs(roofline).mean(), "%"),
        "kernel_gemm_efficiency_h100_bf16": (bf16, "ratio"),
        "kernel_gemm_efficiency_h100_fp8": (fp8, "ratio"),
        "kernel_gemm_half_flops_h100": (half / 1e9, "GFLOP"),
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
