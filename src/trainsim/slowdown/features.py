"""Features of the slowdown model, as Echo uses them (arXiv 2412.12487, section on overlap slowdown).

  communication: collective, algorithm, protocol (categorical, '' = unknown), message_bytes,
                 num_ranks, channels
  compute:       solo_duration_s, flops, bytes_moved, arithmetic_intensity (flops / byte), op_kind,
                 and the profiler's metrics of the solo kernel where the device has them
                 (compute / memory / DRAM throughput, achieved and maximum occupancy, L1 / L2 hit rate)
  device:        device_type

Numeric features may be NaN (unknown): XGBoost learns a default branch for missing values, so a CPU
row without Nsight metrics or an imported row without FLOPs is still a valid input. Categorical
features are pandas categories whose categories the saved model fixes (see predictor.py).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trainsim.profile.analytical import op_kind
from trainsim.slowdown.dataset import METRIC_COLUMNS

CATEGORICAL = ("collective", "algorithm", "protocol", "op_kind", "device_type")
NUMERIC = ("message_bytes", "num_ranks", "channels", "solo_duration_s", "flops", "bytes_moved",
           "arithmetic_intensity", *METRIC_COLUMNS)
FEATURES = (*NUMERIC, *CATEGORICAL)

# CUDA kernel name fragments -> op kind (first match wins), so GPU kernels share the aten vocabulary
# of trainsim.profile.analytical.op_kind. Unmatched kernels are 'other'.
CUDA_KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention")),
    ("matmul", ("gemm", "cutlass", "cublas", "wgmma")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("normalization", ("layer_norm", "gammabeta", "rms_norm", "batch_norm")),
    ("softmax_loss", ("softmax", "nll_loss", "cross_entropy")),
    ("reduction", ("reduce_kernel", "reduce")),
    ("indexing", ("embedding", "index", "scatter", "gather", "radixsort", "unique", "segment",
                  "compute_grad_weight", "scan")),
    ("copy", ("copy", "cat", "fill")),
    ("elementwise", ("elementwise",)),
)
DEVICE_FAMILIES = ("A100", "A800", "H100", "H800", "H200", "H20", "B200", "V100", "L40", "A40", "RTX 3090",
                   "RTX 4090")


def cuda_kernel_kind(kernel_name: str) -> str:
    name = kernel_name.lower()
    for kind, fragments in CUDA_KERNEL_KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


def compute_op_kind(op: str) -> str:
    """Op kind of an aten op ('aten::mm') or a CUDA kernel name ('ampere_sgemm_128x64_tn')."""
    return op_kind(op) if op.startswith("aten::") else cuda_kernel_kind(op)


def device_type_of(device_kind: str, device_name: str, configured: str = "") -> str:
    """The device-type feature: `configured` if set, 'cpu' for CPUs, else the GPU family in the name
    ('NVIDIA A100-SXM4-80GB' -> 'A100'), else the name itself."""
    if configured:
        return configured
    if device_kind == "cpu":
        return "cpu"
    upper = device_name.upper()
    for family in DEVICE_FAMILIES:
        if re.search(rf"(?<![A-Z0-9]){re.escape(family)}(?![0-9])", upper):
            return family
    return device_name


def arithmetic_intensity(flops: pd.Series, bytes_moved: pd.Series) -> pd.Series:
    flops, bytes_moved = flops.astype(float), bytes_moved.astype(float)
    return (flops / bytes_moved.where(bytes_moved > 0)).astype(float)


def feature_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The FEATURES columns of dataset rows (plain dtypes; categories are fixed by the model)."""
    out = pd.DataFrame(index=rows.index)
    for name in NUMERIC:
        if name == "arithmetic_intensity":
            out[name] = arithmetic_intensity(rows["flops"], rows["bytes_moved"])
        else:
            out[name] = pd.to_numeric(rows[name], errors="raise").astype(float) if name in rows else np.nan
    for name in CATEGORICAL:
        out[name] = rows[name].fillna("").astype(str) if name in rows else ""
    return out[list(FEATURES)]


def overlap_features(compute: pd.DataFrame, comm: pd.DataFrame, device_type: str) -> pd.DataFrame:
    """Features of compute op i overlapped by communication op i (the composer's entry point).

    compute: op (aten name or kernel name), flops, bytes_moved, duration_s (solo time), and optionally
    the METRIC_COLUMNS of a GPU profile. comm: collective, message_bytes, num_ranks, and optionally
    algorithm, protocol, channels. Missing optional columns become NaN / '' (unknown).
    """
    if len(compute) != len(comm):
        raise ValueError(f"overlap_features: {len(compute)} compute rows but {len(comm)} comm rows; "
                         "row i of each must describe the same overlap")
    for frame, label, needed in ((compute, "compute", ("op", "flops", "bytes_moved", "duration_s")),
                                 (comm, "comm", ("collective", "message_bytes", "num_ranks"))):
        missing = [c for c in needed if c not in frame]
        if missing:
            raise ValueError(f"overlap_features: {label} frame lacks column(s) {missing}; it has {list(frame)}")
    compute, comm = compute.reset_index(drop=True), comm.reset_index(drop=True)
    rows = pd.DataFrame({
        "solo_duration_s": compute["duration_s"].astype(float),
        "flops": compute["flops"].astype(float),
        "bytes_moved": compute["bytes_moved"].astype(float),
        "op_kind": compute["op"].astype(str).map(compute_op_kind),
        "collective": comm["collective"].astype(str),
        "message_bytes": comm["message_bytes"].astype(float),
        "num_ranks": comm["num_ranks"].astype(float),
        "device_type": device_type,
    })
    for name in ("algorithm", "protocol", "channels"):
        if name in comm:
            rows[name] = comm[name]
    for name in METRIC_COLUMNS:
        if name in compute:
            rows[name] = compute[name]
    return feature_frame(rows)
