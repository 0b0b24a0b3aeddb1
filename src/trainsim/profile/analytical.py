"""Analytical kernel time: a roofline with efficiency curves, and its fit to measured kernels.

  t = launch + max(flops / (R_mm * sat(flops, F_half)), bytes / (R_mem * e_k * sat(bytes, B_half)))   matmul-class
  t = launch + max(flops / (R_vec * e_k),               bytes / (R_mem * e_k * sat(bytes, B_half)))   other ops
  sat(x, h) = x / (x + h)

R_mm = peak FLOP/s of the op's dtype x matmul_efficiency, R_mem = memory bandwidth x memory_efficiency
(Williams et al. 2009 roofline; the saturation terms model that small kernels cannot fill the device,
as vTrain and Calculon do with size-dependent efficiency). e_k is the efficiency of the op's kind
(normalisation, softmax/loss, optimizer, ...; 1 for elementwise): kernels of one kind share an access
pattern. Parameters live in `hardware.kernel_model`; `fit_rates` estimates them from measured rows
(least squares on log time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError

FLOAT_DTYPES = ("fp32", "bf16", "fp16", "fp64")
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution")
# op kind -> name fragments (first match wins; anything else is 'elementwise')
OP_KIND_PATTERNS = {
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention"),
    "optimizer": ("_foreach_", "_fused_adam"),
    "normalization": ("layer_norm", "rms_norm", "batch_norm", "group_norm"),
    "softmax_loss": ("softmax", "nll_loss", "cross_entropy"),
    "reduction": ("sum", "mean", "max", "min", "norm", "amax", "var", "std"),
    "indexing": ("embedding", "gather", "scatter", "index", "masked_fill", "where"),
    "copy": ("copy", "clone", "cat", "stack", "fill", "zero", "ones", "zeros", "full", "arange", "uniform", "normal"),
}
MATMUL_KINDS = ("matmul", "attention")


def op_kind(op: str) -> str:
    base = op.removeprefix("aten::").split(".")[0]
    if base.lstrip("_") in MATMUL_OPS:
        return "matmul"
    for kind, fragments in OP_KIND_PATTERNS.items():
        if any(f in base for f in fragments):
            return kind
    return "elementwise"


def is_matmul(op: str) -> bool:
    return op_kind(op) in MATMUL_KINDS


def op_dtype(input_dtypes: str) -> str:
    """The compute dtype of an op: its first floating-point input (fp32 if none)."""
    return next((d for d in input_dtypes.split(",") if d in FLOAT_DTYPES), "fp32")


@dataclass(frozen=True)
class RooflineRates:
    matmul_flops_per_s: float
    matmul_half_flops: float
    memory_bytes_per_s: float
    memory_half_bytes: float
    vector_flops_per_s: float
    launch_overhead_s: float
    kind_efficiency: tuple[tuple[str, float], ...] = ()
    """(op kind, efficiency) pairs; kinds not listed have 1."""


def rates_for(hw: HardwareConfig, dtype: str) -> RooflineRates:
    """The hardware's rates for one dtype; names the missing field when the config lacks one."""
    if dtype not in hw.peak_flops_per_s:
        known = ", ".join(sorted(hw.peak_flops_per_s)) or "none"
        raise ConfigError(f"hardware '{hw.name}': the analytical backend needs hardware.peak_flops_per_s.{dtype} "
                          f"(known: {known}); add it, or fit the kernel model with `trainsim profile-fit`")
    if hw.memory_bandwidth_bytes_per_s <= 0:
        raise ConfigError(f"hardware '{hw.name}': the analytical backend needs "
                          "hardware.memory_bandwidth_bytes_per_s > 0")
    km = hw.kernel_model
    vector = km.vector_flops_per_s or hw.peak_flops_per_s.get("fp32", hw.peak_flops_per_s[dtype]) / 2
    return RooflineRates(
        matmul_flops_per_s=hw.peak_flops_per_s[dtype] * km.matmul_efficiency,
        matmul_half_flops=km.matmul_half_flops,
        memory_bytes_per_s=hw.memory_bandwidth_bytes_per_s * km.memory_efficiency,
        memory_half_bytes=km.memory_half_bytes,
        vector_flops_per_s=vector,
        launch_overhead_s=km.launch_overhead_s,
        kind_efficiency=tuple(sorted(km.kind_efficiency.items())),
    )


def predict(rates: RooflineRates, flops, bytes_moved, kinds) -> np.ndarray:
    """Seconds per op (vectorised); `kinds` are op kinds from `op_kind`."""
    flops = np.asarray(flops, dtype=float)
    bytes_moved = np.asarray(bytes_moved, dtype=float)
    kinds = np.asarray(kinds, dtype=object)
    efficiency = dict(rates.kind_efficiency)
    kind_eff = np.array([efficiency.get(k, 1.0) for k in kinds])
    matmul = np.isin(kinds, MATMUL_KINDS)
    memory = (bytes_moved + rates.memory_half_bytes) / (rates.memory_bytes_per_s * kind_eff)
    mm = (flops + rates.matmul_half_flops) / rates.matmul_flops_per_s
    vector = flops / (rates.vector_flops_per_s * kind_eff)
    compute = np.where(matmul, mm, vector)
    return rates.launch_overhead_s + np.maximum(compute, memory)


def _kinds(rows: pd.DataFrame) -> np.ndarray:
    return rows["op"].map(op_kind).to_numpy(dtype=object)


def predict_rows(rows: pd.DataFrame, hw: HardwareConfig) -> np.ndarray:
    """Analytical seconds for execution-graph or profile rows on `hw` (per-dtype rates)."""
    out = np.zeros(len(rows))
    dtypes = rows["input_dtypes"].map(op_dtype).to_numpy()
    kinds = _kinds(rows)
    for dtype in set(dtypes):
        sel = dtypes == dtype
        out[sel] = predict(rates_for(hw, dtype), rows["flops"].to_numpy()[sel], rows["bytes_moved"].to_numpy()[sel],
                           kinds[sel])
    return out


def fit_rates(rows: pd.DataFrame) -> RooflineRates:
    """Least-squares fit (on log time, robust loss) of the rates and per-kind efficiencies to measured rows."""
    if len(rows) < 6:
        raise ValueError(f"fitting the kernel model needs at least 6 measured ops, got {len(rows)}")
    flops = rows["flops"].to_numpy(float)
    bytes_moved = rows["bytes_moved"].to_numpy(float)
    kinds = _kinds(rows)
    measured = rows["median_s"].to_numpy(float)
    matmul = np.isin(kinds, MATMUL_KINDS)
    fitted_kinds = sorted(k for k in set(kinds) if k not in ("elementwise", "matmul"))
    mm_rate = np.quantile(flops[matmul] / measured[matmul], 0.9) if matmul.any() else 1e10
    mem_rate = np.quantile(bytes_moved / measured, 0.9)
    start = np.concatenate([np.log([mm_rate, 1e6, mem_rate, 1e5, mem_rate / 4, max(np.min(measured) / 2, 1e-7)]),
                            np.zeros(len(fitted_kinds))])

    def rates_of(x) -> RooflineRates:
        return RooflineRates(*np.exp(x[:6]), kind_efficiency=tuple(zip(fitted_kinds, np.exp(x[6:]))))

    def residuals(x):
        return np.log(predict(rates_of(x), flops, bytes_moved, kinds)) - np.log(measured)

    result = least_squares(residuals, start, loss="soft_l1", f_scale=0.1)
    return rates_of(result.x)


def fitted_kernel_model(rates: RooflineRates, hw: HardwareConfig, dtype: str = "fp32") -> dict:
    """Rates expressed as the hardware config's fields (a YAML-ready dict of plain floats to paste into
    conf/hardware)."""
    peak = hw.peak_flops_per_s.get(dtype)
    bandwidth = hw.memory_bandwidth_bytes_per_s
    config: dict = {
        "kernel_model": {
            "matmul_efficiency": float(rates.matmul_flops_per_s / peak) if peak else 1.0,
            "matmul_half_flops": float(rates.matmul_half_flops),
            "memory_efficiency": float(rates.memory_bytes_per_s / bandwidth) if bandwidth else 1.0,
            "memory_half_bytes": float(rates.memory_half_bytes),
            "vector_flops_per_s": float(rates.vector_flops_per_s),
            "launch_overhead_s": float(rates.launch_overhead_s),
            "kind_efficiency": {kind: float(e) for kind, e in rates.kind_efficiency},
        }
    }
    if not peak:
        config["peak_flops_per_s"] = {dtype: float(rates.matmul_flops_per_s)}
    if not bandwidth:
        config["memory_bandwidth_bytes_per_s"] = float(rates.memory_bytes_per_s)
    return config


@dataclass(frozen=True)
class FitReport:
    rates: RooflineRates
    train_ops: int
    test_ops: int
    median_error_pct: float
    p90_error_pct: float


def evaluate_fit(rows: pd.DataFrame, train_fraction: float = 0.5, seed: int = 0) -> FitReport:
    """Fit on a random `train_fraction` of the distinct signatures, report |error| on the rest."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction={train_fraction} must be in (0, 1)")
    shuffled = rows.drop_duplicates("signature").sample(frac=1.0, random_state=seed)
    cut = int(round(len(shuffled) * train_fraction))
    train, test = shuffled.iloc[:cut], shuffled.iloc[cut:]
    if len(test) == 0:
        raise ValueError(f"no held-out ops: {len(shuffled)} distinct signatures with train_fraction={train_fraction}")
    rates = fit_rates(train)
    predicted = predict(rates, test["flops"], test["bytes_moved"], _kinds(test))
    error = 100 * np.abs(predicted / test["median_s"].to_numpy() - 1)
    return FitReport(rates, len(train), len(test), float(np.median(error)), float(np.quantile(error, 0.9)))
