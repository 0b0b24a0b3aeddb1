"""Analytical kernel time: a roofline with efficiency curves, and its fit to measured kernels.

  t = launch + max(flops / (R_mm * sat(flops, F_half)), bytes / (R_mem * sat(bytes, B_half)))   matmul-class
  t = launch + max(flops / R_vec,                       bytes / (R_mem * sat(bytes, B_half)))   other ops
  sat(x, h) = x / (x + h)

R_mm = peak FLOP/s of the op's dtype x matmul_efficiency, R_mem = memory bandwidth x memory_efficiency
(Williams et al. 2009 roofline; the saturation terms model that small kernels cannot fill the device,
as vTrain and Calculon do with size-dependent efficiency). Parameters live in `hardware.kernel_model`;
`fit_rates` estimates them from measured rows (least squares on log time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution",
              "scaled_dot_product", "flash_attention", "efficient_attention")
FLOAT_DTYPES = ("fp32", "bf16", "fp16", "fp64")


def is_matmul(op: str) -> bool:
    base = op.removeprefix("aten::").split(".")[0].lstrip("_")
    return base in MATMUL_OPS or any(tag in base for tag in MATMUL_OPS[-3:])


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

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


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
    )


def predict(rates: RooflineRates, flops, bytes_moved, matmul) -> np.ndarray:
    """Seconds per op (vectorised over numpy arrays)."""
    flops = np.asarray(flops, dtype=float)
    bytes_moved = np.asarray(bytes_moved, dtype=float)
    matmul = np.asarray(matmul, dtype=bool)
    memory = bytes_moved / (rates.memory_bytes_per_s * bytes_moved / (bytes_moved + rates.memory_half_bytes) + 1e-300)
    mm = flops / (rates.matmul_flops_per_s * flops / (flops + rates.matmul_half_flops) + 1e-300)
    vector = flops / rates.vector_flops_per_s
    compute = np.where(matmul, mm, vector)
    return rates.launch_overhead_s + np.maximum(compute, memory)


def predict_rows(rows: pd.DataFrame, hw: HardwareConfig) -> np.ndarray:
    """Analytical seconds for execution-graph or profile rows on `hw` (per-dtype rates)."""
    out = np.zeros(len(rows))
    dtypes = rows["input_dtypes"].map(op_dtype).to_numpy()
    matmul = rows["op"].map(is_matmul).to_numpy()
    for dtype in set(dtypes):
        sel = dtypes == dtype
        out[sel] = predict(rates_for(hw, dtype), rows["flops"].to_numpy()[sel], rows["bytes_moved"].to_numpy()[sel],
                           matmul[sel])
    return out


def fit_rates(rows: pd.DataFrame) -> RooflineRates:
    """Least-squares fit (on log time, robust loss) of all six rates to measured rows."""
    flops = rows["flops"].to_numpy(float)
    bytes_moved = rows["bytes_moved"].to_numpy(float)
    matmul = rows["op"].map(is_matmul).to_numpy()
    measured = rows["median_s"].to_numpy(float)
    if len(rows) < 6:
        raise ValueError(f"fitting the kernel model needs at least 6 measured ops, got {len(rows)}")
    mm_rate = np.quantile(flops[matmul] / measured[matmul], 0.9) if matmul.any() else 1e10
    mem_rate = np.quantile(bytes_moved / measured, 0.9)
    start = np.log([mm_rate, 1e6, mem_rate, 1e5, mem_rate / 4, max(np.min(measured) / 2, 1e-7)])

    def residuals(x):
        rates = RooflineRates(*np.exp(x))
        return np.log(predict(rates, flops, bytes_moved, matmul)) - np.log(measured)

    result = least_squares(residuals, start, loss="soft_l1", f_scale=0.1)
    return RooflineRates(*np.exp(result.x))


def fitted_kernel_model(rates: RooflineRates, hw: HardwareConfig, dtype: str = "fp32") -> dict:
    """Rates expressed as the hardware config's fields (a YAML-ready dict to paste into conf/hardware)."""
    peak = hw.peak_flops_per_s.get(dtype)
    bandwidth = hw.memory_bandwidth_bytes_per_s
    config = {
        "kernel_model": {
            "matmul_efficiency": rates.matmul_flops_per_s / peak if peak else 1.0,
            "matmul_half_flops": rates.matmul_half_flops,
            "memory_efficiency": rates.memory_bytes_per_s / bandwidth if bandwidth else 1.0,
            "memory_half_bytes": rates.memory_half_bytes,
            "vector_flops_per_s": rates.vector_flops_per_s,
            "launch_overhead_s": rates.launch_overhead_s,
        }
    }
    if not peak:
        config["peak_flops_per_s"] = {dtype: rates.matmul_flops_per_s}
    if not bandwidth:
        config["memory_bandwidth_bytes_per_s"] = rates.memory_bytes_per_s
    return json.loads(json.dumps(config))
