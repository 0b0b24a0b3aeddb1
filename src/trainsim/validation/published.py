"""Predict published large-scale Megatron runs (achieved TFLOP/s per GPU) as step times.

Tables (data/published, each file's header names its source):
  * megatron2021_a100: Megatron-LM weak scaling on Selene (Narayanan et al., SC21, Table 1): GPT 1.7B-1T,
    32-3072 A100-80GB, seq 2048, vocab 51,200, fp16, full recomputation, interleaved 1F1B.
  * mcore2024_h100: Megatron-Core r0.8 on H100 (README model table): GPT 1.7B-462B, 48-6144 H100, seq 4096,
    vocab 131,072, bf16 (assumed), DP 48 everywhere.

Each source reports throughput; its step time follows from the FLOP formula the source states:
  megatron2021: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))          (counts the recomputed forward)
  mcore2024:    F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))          (Megatron-LM's num_floating_point_operations
                                                                      for a GPT with 4h MLP, MHA: model FLOPs)
  step_s = F / (gpus * tflops_per_gpu * 1e12)
Settings the sources leave open are stated in ASSUMPTIONS and applied the same way to every row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.config.data_path import DATA_DIR
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig

CACHE = Path("artifacts/validation/published/traces")


@dataclass(frozen=True)
class Table:
    name: str
    path: str
    hardware: str
    precision: str
    recompute: str
    seq: int
    vocab: int
    attention: str
    """core attention kernel of that Megatron version: 'unfused' before flash attention (2021), 'fused' after"""
    most_virtual_stages: int
    """interleaving: the most virtual stages per pipeline rank that divide its layers, up to this many"""
    sequence_parallel: bool
    """Megatron-Core's scaling runs use sequence parallelism with TP, its communication overlapped with the
    GEMMs (--tp-comm-overlap, stated in the source); neither existed in 2021"""
    flops_factor: float
    """F = flops_factor * B s l h^2 (1 + s/(6h) + V/(vocab_divisor l h))"""
    vocab_divisor: float


TABLES = {
    "megatron2021_a100": Table("megatron2021_a100", "published/megatron-lm_readme_2021_a100_selene_weak_scaling.csv",
                               "a100-80g-selene", "fp16", "full", 2048, 51200, "unfused", 4, False, 96.0, 16.0),
    "mcore2024_h100": Table("mcore2024_h100", "published/megatron-lm_readme_2024_h100_core_r0.8.csv",
                            "h100-sxm-dgx", "bf16", "none", 4096, 131072, "fused", 1024, True, 72.0, 12.0),
}

DROPOUT = 0.1
ASSUMPTIONS = {
    "micro_batch_size": "1 (Megatron's large-model runs; the sources do not state it)",
    "schedule": "interleaved 1F1B where pp > 1 with the most virtual stages that divide the stage's layers: at "
                "most 4 in 2021 (SC21), one layer per virtual stage in 2024 (as NVIDIA's NeMo 24.07 recipes in "
                "data/published use 1-2)",
    "dropout": "0.1 after attention and MLP and on the attention probabilities (Megatron-LM's argument defaults)",
    "sequence_parallel": "on for the 2024 H100 runs (Megatron-Core's scaling scripts; not stated in the README)",
    "dp_bucket": "gradients all-reduced in 25 MiB buckets overlapped with backward (Megatron DDP with overlap)",
}


def read_table(name: str) -> pd.DataFrame:
    table = TABLES[name]
    rows = pd.read_csv(DATA_DIR / table.path, comment="#")
    rows = rows.rename(columns={"attn_heads_unverified": "attn_heads", "tp_unverified": "tp", "pp_unverified": "pp"})
    rows["dp"] = rows["gpus"] // (rows["tp"] * rows["pp"])
    b, s, n, h = rows["global_batch"], table.seq, rows["layers"], rows["hidden"]
    flops = table.flops_factor * b * s * n * h**2 * (1 + s / (6 * h) + table.vocab / (table.vocab_divisor * n * h))
    tflops = rows["achieved_tflops_per_gpu"] if "achieved_tflops_per_gpu" in rows else rows["tflops_per_gpu"]
    rows["measured_s"] = flops / (rows["gpus"] * tflops * 1e12)
    rows["model_flops"] = flops
    return rows


def virtual_stages(layers: int, pp: int, most: int = 4) -> int:
    if pp == 1:
        return 1
    per_stage = layers // pp
    return max(v for v in range(1, most + 1) if per_stage % v == 0)


def row_configs(table: Table, row, base_model: ModelConfig, base_par: ParallelismConfig
                ) -> tuple[ModelConfig, ParallelismConfig]:
    model = dataclasses.replace(base_model, name=f"{table.name}-{row['model']}", family="gpt",
                                hidden_size=int(row["hidden"]), num_attention_heads=int(row["attn_heads"]),
                                num_layers=int(row["layers"]), seq_length=table.seq, vocab_size=table.vocab,
                                num_kv_heads=None, ffn_hidden_size=None, attention=table.attention,
                                dropout=DROPOUT, attention_dropout=DROPOUT)
    pp = int(row["pp"])
    v = virtual_stages(int(row["layers"]), pp, table.most_virtual_stages)
    par = dataclasses.replace(base_par, name=f"{table.name}-{row['model']}", tp=int(row["tp"]), pp=pp,
                              dp=int(row["dp"]), micro_batch_size=1, global_batch_size=int(row["global_batch"]),
                              precision=table.precision, recompute=table.recompute,
                              sequence_parallel=table.sequence_parallel and int(row["tp"]) > 1,
                              tp_comm_overlap=table.sequence_parallel and int(row["tp"]) > 1,
                              schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    return model, par


def trace_dir(model: ModelConfig, par: ParallelismConfig, cache: Path = CACHE) -> Path:
    """Cached ex-situ trace of one row (traced on first use)."""
    from trainsim.validation.vtrain import _trace_file, _trace_one
    path = _trace_file(model, par, cache)
    _trace_one((model, par, str(path)))
    return path


def compose_row(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, comm, slowdown=None):
    """The composed step of one row with the analytical kernel model of `hw`."""
    from trainsim.profile.analytical import predict_rows as analytical
    from trainsim.timeline.compose import compose_step
    from trainsim.validation.vtrain import _trace_tables

    graph, rank_classes, ops = _trace_tables(trace_dir(model, par))
    times = dict(zip(ops["signature"], analytical(ops, hw)))
    return compose_step(graph, rank_classes, par, hw, times, comm, slowdown)


FITTED = ("matmul_efficiency", "memory_efficiency")
"""The kernel model's parameters fitted per hardware across a table's rows (hardware.kernel_model fields):
what large GEMMs and streaming kernels reach on that GPU under that framework. Everything else is physics
or a datasheet/kernel-benchmark number."""
SENSITIVITY_STEP = 0.05


@dataclass
class RowRun:
    model: ModelConfig
    par: ParallelismConfig
    directory: Path


def with_kernel_params(hw: HardwareConfig, params: dict[str, float]) -> HardwareConfig:
    return dataclasses.replace(hw, kernel_model=dataclasses.replace(hw.kernel_model, **params))


def step_seconds(run: RowRun, hw: HardwareConfig, comm) -> float:
    from trainsim.profile.analytical import predict_rows as analytical
    from trainsim.timeline.compose import compose_step
    from trainsim.validation.vtrain import _trace_tables

    graph, rank_classes, ops = _trace_tables(run.directory)
    times = dict(zip(ops["signature"], analytical(ops, hw)))
    return compose_step(graph, rank_classes, run.par, hw, times, comm).step_time_s


def linearise(runs: list[RowRun], hw: HardwareConfig, comm) -> tuple[np.ndarray, np.ndarray]:
    """Each row's step time at `hw` and its derivative by each FITTED parameter's inverse ratio r = p0 / p
    (kernel time is proportional to 1/efficiency where that parameter binds), by finite differences."""
    base = np.array([step_seconds(r, hw, comm) for r in runs])
    slopes = np.zeros((len(runs), len(FITTED)))
    for j, name in enumerate(FITTED):
        moved = with_kernel_params(hw, {name: getattr(hw.kernel_model, name) / (1 + SENSITIVITY_STEP)})
        slopes[:, j] = (np.array([step_seconds(r, moved, comm) for r in runs]) - base) / SENSITIVITY_STEP
    return base, slopes


MATMUL_CEILING = DATA_DIR / "kernels/matmul_max-achievable-tflops_mlengineering.csv"
CEILING_ROW = {"NVIDIA A100-SXM4-80GB": "NVIDIA A100 SXM", "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM"}
"""hardware.device_name -> the accelerator row of the best measured matmul throughput (mamf-finder)."""


def matmul_ceiling(hw: HardwareConfig, dtype: str = "bf16") -> float:
    """The highest matmul_efficiency a fit may reach: the best torch.mm throughput measured on this GPU over
    its datasheet peak (no GEMM of a training step beats a brute-force search for the fastest shape); 1
    where the GPU has no row."""
    table = pd.read_csv(MATMUL_CEILING, comment="#")
    row = table[(table["accelerator"] == CEILING_ROW.get(hw.device_name, "")) & (table["dtype"] == dtype)]
    return float(row["mamf_tflops"].iloc[0] / row["theory_tflops"].iloc[0]) if len(row) else 1.0


def fit_ratios(base: np.ndarray, slopes: np.ndarray, measured: np.ndarray, hw: HardwareConfig) -> dict[str, float]:
    """Least squares on log step time of the linearised rows; efficiencies stay in [0.05, ceiling] (the
    matmul ceiling of `matmul_ceiling`, 1 for memory)."""
    from scipy.optimize import least_squares

    p0 = np.array([getattr(hw.kernel_model, n) for n in FITTED])
    ceiling = np.array([matmul_ceiling(hw) if n == "matmul_efficiency" else 1.0 for n in FITTED])
    lower, upper = p0 / ceiling, p0 / 0.05  # ratio r = p0 / p: p <= ceiling <=> r >= p0 / ceiling

    def residuals(r):
        return np.log(np.maximum(base + slopes @ (r - 1), 1e-9)) - np.log(measured)

    fit = least_squares(residuals, np.clip(np.ones(len(FITTED)), lower, upper), bounds=(lower, upper))
    return {name: float(p / r) for name, p, r in zip(FITTED, p0, fit.x)}


@dataclass
class TableResult:
    rows: pd.DataFrame
    """per row: measured_s, predicted_s (leave-one-row-out), error_pct, and that fold's fitted parameters"""
    all_rows_fit: dict[str, float]
    """FITTED from every row (what the hardware config carries)"""
    seconds: float


def calibrated_comm(run):
    """The run's hardware's calibrated collective model, calibrating first (seconds) when its artifact is
    missing, as `trainsim compose` does."""
    from trainsim.comm.calibration import write_calibration_artifact
    from trainsim.registry import STAGES
    from trainsim.timeline.stage import comm_model

    directory = Path(STAGES["calibration"].path(run.keys))
    if not (directory / "manifest.json").is_file():
        write_calibration_artifact(run.hardware, run.keys, directory)
    return comm_model(run.hardware, directory)


def evaluate_table(name: str, workers: int = 2) -> TableResult:
    """Leave-one-row-out: for each row, fit FITTED on the other rows, then compose the row with that fit."""
    import time

    from trainsim.config import compose_run

    started = time.perf_counter()
    table = TABLES[name]
    rows = read_table(name)
    run = compose_run([f"hardware={table.hardware}", "model=gpt-small", "parallelism=single"])
    comm = calibrated_comm(run)
    runs = [RowRun(*row_configs(table, row, run.model, run.parallelism), Path()) for _, row in rows.iterrows()]
    runs = [dataclasses.replace(r, directory=trace_dir(r.model, r.par)) for r in runs]
    hw = run.hardware
    base, slopes = linearise(runs, hw, comm)
    measured = rows["measured_s"].to_numpy()
    predicted, folds = [], []
    for i in range(len(rows)):
        keep = np.arange(len(rows)) != i
        params = fit_ratios(base[keep], slopes[keep], measured[keep], hw)
        predicted.append(step_seconds(runs[i], with_kernel_params(hw, params), comm))
        folds.append(params)
    out = rows.copy()
    out["predicted_s"] = predicted
    out["error_pct"] = 100 * (out["predicted_s"] / out["measured_s"] - 1)
    for name_ in FITTED:
        out[name_] = [f[name_] for f in folds]
    return TableResult(out, fit_ratios(base, slopes, measured, hw), time.perf_counter() - started)
