"""Features of the slowdown model: one function, `overlap_features`, builds them for training and for compose.

Echo (arXiv 2412.12487) feeds its XGBoost model Nsight Compute metrics of the solo kernel. The composer
has no profiler: it knows an op's name, FLOPs, bytes and (analytical or measured) solo time, the
concurrent collective, and the hardware's datasheet numbers. A model trained on columns the composer
cannot supply takes branches at compose time that it never trained (every value missing), so the model
here uses only what both ends supply, computed by the same code:

  communication: collective, algorithm, protocol (categorical, '' = unknown), message_bytes,
                 num_ranks, channels
  compute:       solo_duration_s, bytes_moved, op_kind (categorical),
                 flops and arithmetic_intensity = flops / bytes: for FLOP-bound kinds (matmul,
                     attention) only, NaN for the others (below),
                 memory_bandwidth_fraction = bytes_moved / (solo_duration_s * memory bandwidth)
                 compute_fraction = flops / (solo_duration_s * peak), where peak is the slowest of the
                     device's two dense pipes able to reach that rate: the vector (fp32, CUDA-core)
                     peak if flops / (t * vector peak) <= 1, else the matrix (tensor-core) peak.
                     An fp32 SIMT GEMM and a bf16 tensor-core GEMM that both keep their pipe busy
                     then both read near 1, and an elementwise kernel near 0, without a dtype column.
  device:        device_sm_count, device_memory_bandwidth_bytes_per_s, device_vector_flops_per_s,
                 device_matrix_flops_per_s: physical numbers instead of a device-type category, so an
                 unseen GPU is a point in a numeric space rather than an unknown category.

Why FLOPs only for matmul and attention: the FLOPs of a memory-bound kernel do not set how much it
interferes (its bytes do), and they are not comparable between the two ends: the composer has the
trace's convention (one FLOP per output element of an add), the imported Nsight rows only the busiest
SM pipe's share, which counts address and load/store instructions (a100_import.py). Measured at both
ends on GPT-2 DDP (docs/slowdown.md): the median elementwise compute fraction was 0.065 from Nsight
against 0.003 from the trace convention, a matmul's 0.89 against 0.61. So flops, arithmetic_intensity
and compute_fraction are NaN for the other kinds, at training and at compose alike.

Numeric features may be NaN (unknown): XGBoost learns a default branch for missing values; a CPU whose
peaks are not configured has NaN fractions at both ends alike. Categorical features are pandas
categories whose categories the saved model fixes (see predictor.py). The profiler metrics stay in the
dataset (METRIC_COLUMNS) as measurements, but are not model inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainsim.profile.analytical import op_kind

CATEGORICAL = ("collective", "algorithm", "protocol", "op_kind")
DEVICE_COLUMNS = ("device_sm_count", "device_memory_bandwidth_bytes_per_s", "device_vector_flops_per_s",
                  "device_matrix_flops_per_s")
NUMERIC = ("message_bytes", "num_ranks", "channels", "solo_duration_s", "flops", "bytes_moved",
           "arithmetic_intensity", "memory_bandwidth_fraction", "compute_fraction", *DEVICE_COLUMNS)
FEATURES = (*NUMERIC, *CATEGORICAL)
COMPUTE_COLUMNS = ("op", "flops", "bytes_moved", "duration_s")
FLOP_BOUND_KINDS = ("matmul", "attention")
"""Op kinds whose FLOPs are features (module docstring)."""
COMM_COLUMNS = ("collective", "message_bytes", "num_ranks")
COMM_OPTIONAL = ("algorithm", "protocol", "channels")

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
@dataclass(frozen=True)
class DeviceNumbers:
    """The datasheet numbers of a device that the slowdown features use (NaN = unknown)."""

    sm_count: float = math.nan
    memory_bandwidth_bytes_per_s: float = math.nan
    vector_flops_per_s: float = math.nan
    """Dense fp32 peak of the CUDA cores (the pipe of non-tensor-core arithmetic)."""
    matrix_flops_per_s: float = math.nan
    """Highest dense peak the configuration lists (tensor cores, bf16 / fp16)."""
    name: str = ""
    """For messages only; never a feature."""

    def columns(self) -> dict[str, float]:
        return dict(zip(DEVICE_COLUMNS, (float(self.sm_count), float(self.memory_bandwidth_bytes_per_s),
                                         float(self.vector_flops_per_s), float(self.matrix_flops_per_s))))


def _known(value: float) -> float:
    return float(value) if value and value > 0 else math.nan


def device_numbers(hw) -> DeviceNumbers:
    """The DeviceNumbers of a HardwareConfig (0 or an empty peak table there = unknown = NaN)."""
    # the matrix peak of 16- and 32-bit types: FP8 and FP4 rates are not what the trained kernels ran at
    peaks = {k: float(v) for k, v in (hw.peak_flops_per_s or {}).items() if v and v > 0 and k not in ("fp8", "fp4")}
    return DeviceNumbers(sm_count=_known(hw.sm_count),
                         memory_bandwidth_bytes_per_s=_known(hw.memory_bandwidth_bytes_per_s),
                         vector_flops_per_s=peaks.get("fp32", math.nan),
                         matrix_flops_per_s=max(peaks.values()) if peaks else math.nan, name=hw.name)


def cuda_kernel_kind(kernel_name: str) -> str:
    name = kernel_name.lower()
    for kind, fragments in CUDA_KERNEL_KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


def compute_op_kind(op: str) -> str:
    """Op kind of an aten op ('aten::mm') or a CUDA kernel name ('ampere_sgemm_128x64_tn')."""
    return op_kind(op) if op.startswith("aten::") else cuda_kernel_kind(op)


def arithmetic_intensity(flops: pd.Series, bytes_moved: pd.Series) -> pd.Series:
    flops, bytes_moved = flops.astype(float), bytes_moved.astype(float)
    return (flops / bytes_moved.where(bytes_moved > 0)).astype(float)


def utilisation(flops, bytes_moved, duration_s, device: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(memory_bandwidth_fraction, compute_fraction) per row; see the module docstring. NaN where a
    duration or device number is unknown or not positive."""
    flops, moved, t = (np.asarray(x, dtype=float) for x in (flops, bytes_moved, duration_s))
    bandwidth, vector, matrix = (device[c].to_numpy(dtype=float) for c in DEVICE_COLUMNS[1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(t > 0, t, np.nan)
        memory = moved / (t * np.where(bandwidth > 0, bandwidth, np.nan))
        on_vector = flops / (t * np.where(vector > 0, vector, np.nan))
        on_matrix = flops / (t * np.where(matrix > 0, matrix, np.nan))
    compute = np.where(on_vector <= 1.0, on_vector, on_matrix)  # NaN on_vector (no fp32 peak): the matrix pipe
    return memory, np.where(np.isnan(on_vector) & np.isnan(on_matrix), np.nan, compute)


def _device_frame(device, n: int) -> pd.DataFrame:
    if isinstance(device, DeviceNumbers):
        return pd.DataFrame({c: np.full(n, v) for c, v in device.columns().items()})
    if isinstance(device, pd.DataFrame):
        missing = [c for c in DEVICE_COLUMNS if c not in device]
        if missing:
            raise ValueError(f"overlap_features: device frame lacks column(s) {missing}; it has {list(device)}")
        if len(device) != n:
            raise ValueError(f"overlap_features: {n} compute rows but {len(device)} device rows")
        out = device[list(DEVICE_COLUMNS)].reset_index(drop=True)
        return out.apply(lambda col: pd.to_numeric(col, errors="raise")).astype(float)
    raise TypeError(f"overlap_features: device must be a DeviceNumbers (trainsim.slowdown.features.device_numbers"
                    f"(hardware)) or a frame with {list(DEVICE_COLUMNS)}; got {type(device).__name__} {device!r}")


def overlap_features(compute: pd.DataFrame, comm: pd.DataFrame, device) -> pd.DataFrame:
    """The FEATURES of compute op i overlapped by communication op i: the composer's entry point, and
    the function training calls on the dataset rows (`dataset_features`).

    compute: op (aten name or kernel name), flops, bytes_moved, duration_s (solo time). comm:
    collective, message_bytes, num_ranks, and optionally algorithm, protocol, channels (missing: ''
    / NaN, unknown). device: the DeviceNumbers of the device (`device_numbers(hardware)`), or a frame
    of DEVICE_COLUMNS with one row per compute row.
    """
    if len(compute) != len(comm):
        raise ValueError(f"overlap_features: {len(compute)} compute rows but {len(comm)} comm rows; "
                         "row i of each must describe the same overlap")
    for frame, label, needed in ((compute, "compute", COMPUTE_COLUMNS), (comm, "comm", COMM_COLUMNS)):
        missing = [c for c in needed if c not in frame]
        if missing:
            raise ValueError(f"overlap_features: {label} frame lacks column(s) {missing}; it has {list(frame)}")
    compute, comm = compute.reset_index(drop=True), comm.reset_index(drop=True)
    dev = _device_frame(device, len(compute))
    out = pd.DataFrame(index=compute.index)
    for name, source, column in (("message_bytes", comm, "message_bytes"), ("num_ranks", comm, "num_ranks"),
                                 ("channels", comm, "channels"), ("solo_duration_s", compute, "duration_s"),
                                 ("flops", compute, "flops"), ("bytes_moved", compute, "bytes_moved")):
        out[name] = (pd.to_numeric(source[column], errors="raise").astype(float) if column in source
                     else np.full(len(out), np.nan))
    kind = compute["op"].fillna("").astype(str).map(compute_op_kind)
    out["flops"] = out["flops"].where(kind.isin(FLOP_BOUND_KINDS))
    out["arithmetic_intensity"] = arithmetic_intensity(out["flops"], out["bytes_moved"])
    out["memory_bandwidth_fraction"], out["compute_fraction"] = utilisation(
        out["flops"], out["bytes_moved"], out["solo_duration_s"], dev)
    for name in DEVICE_COLUMNS:
        out[name] = dev[name].to_numpy(dtype=float)
    out["collective"] = comm["collective"].fillna("").astype(str)
    for name in ("algorithm", "protocol"):
        out[name] = comm[name].fillna("").astype(str) if name in comm else ""
    out["op_kind"] = kind
    return out[list(FEATURES)]


def dataset_features(rows: pd.DataFrame) -> pd.DataFrame:
    """The FEATURES of slowdown-dataset rows (SLOWDOWN_SCHEMA): the training path. It splits each row
    into the compose-time inputs (compute op, concurrent collective, device numbers) and calls
    `overlap_features`, so training and compose compute features with the same code."""
    needed = ("op", "flops", "bytes_moved", "solo_duration_s", *COMM_COLUMNS, *DEVICE_COLUMNS)
    missing = [c for c in needed if c not in rows]
    if missing:
        raise ValueError(f"slowdown dataset lacks column(s) {missing} (a dataset written before the slowdown "
                         "features used device numbers: re-run the slowdown_dataset stage)")
    rows = rows.reset_index(drop=True)
    compute = rows[["op", "flops", "bytes_moved", "solo_duration_s"]].rename(columns={"solo_duration_s": "duration_s"})
    comm = rows[[c for c in (*COMM_COLUMNS, *COMM_OPTIONAL) if c in rows]]
    return overlap_features(compute, comm, rows[list(DEVICE_COLUMNS)])
