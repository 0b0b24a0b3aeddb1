"""Import Echo's published slowdown dataset (merged_features.csv of NetX-lab/Echo-slowdown) into SLOWDOWN_SCHEMA.

The file (data/overlap-slowdown/echo_gpt2_ddp_2gpu_a100_kernel_overlap_slowdown.csv) has '#'
comment lines describing the run, then one row per kernel instance of GPT-2 trained with PyTorch DDP
on 2 A100s:

  ground_truth (ns)   kernel time in the world-size-1 run (no NCCL)       -> solo_duration_s
  duration (ns)       the same kernel in the 2-GPU DDP run                -> overlapped_duration_s
  overlap_ratio       share of the kernel overlapped by an NCCL kernel    -> overlap_fraction
  slowdown            (duration - ground_truth) / (overlap_ratio * ground_truth); recomputed here,
                      disagreements are counted
  kShortName / kDemangledName                                              -> op / kernel_name
  Compute throughput, Memory throughput, DRAM throughput, Achieved occupancy, Maximum occupancy,
  L1 hit rate, L2 hit rate (Nsight Compute, %)                             -> *_pct metrics
  SM (number of SMs; 108 = A100)                                           -> device_type and the
                                                                              device numbers

The file has no per-kernel communication columns: every overlapping NCCL kernel is a DDP gradient
all-reduce of one bucket, so collective='all_reduce', message_bytes = the bucket cap and num_ranks =
the GPU count, both parsed from the header ('bucket_cap_mb=2', 'on 2 GPUs'); algorithm, protocol and
channels are unknown ('' / NaN).

FLOPs and bytes are not in the file; they are reconstructed from the measured Nsight percentages, so
that the utilisation features the model uses (features.py) mean at training what they mean at compose:

  bytes_moved = DRAM throughput % / 100 x memory bandwidth x solo duration
  flops       = Compute (SM) throughput % / 100 x fp32 (vector) peak x solo duration, for the
                FLOP-bound kinds (features.FLOP_BOUND_KINDS: matmul, attention); NaN for the others

with the device's datasheet numbers (DEVICE_NUMBERS, the values of conf/hardware/a100-80g-dgx.yaml for
108 SMs). Then memory_bandwidth_fraction = bytes / (t x bandwidth) is the DRAM throughput fraction and
compute_fraction = flops / (t x fp32 peak) the SM throughput fraction, whatever the exact SKU (the
bandwidth cancels). Assumptions: the GPT-2 run is fp32 (its GEMMs are ampere_sgemm, CUDA-core kernels,
so the fp32 peak is the pipe they use); Nsight's SM throughput is the busiest SM pipe's share, an upper
bound of the FLOP share that is close for GEMMs but not for an elementwise kernel (it counts address
and load/store instructions too), hence NaN there; DRAM throughput misses traffic that hits in L2
(small kernels read as moving few bytes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.slowdown.dataset import check_instances, invalid_reason, slowdown_of
from trainsim.slowdown.features import DEVICE_COLUMNS, FLOP_BOUND_KINDS, DeviceNumbers, cuda_kernel_kind

TIMING_COLUMNS = {"ground_truth": "solo_duration_s", "duration": "overlapped_duration_s",
                  "overlap_ratio": "overlap_fraction"}
METRIC_MAP = {"Compute throughput": "compute_throughput_pct", "Memory throughput": "memory_throughput_pct",
              "DRAM throughput": "dram_throughput_pct", "Achieved occupancy": "achieved_occupancy_pct",
              "Maximum occupancy": "max_occupancy_pct", "L1 hit rate": "l1_hit_pct", "L2 hit rate": "l2_hit_pct"}
REQUIRED = ("id", "kShortName", "kDemangledName", *TIMING_COLUMNS, "slowdown", "SM", *METRIC_MAP)
# cite: NVIDIA A100 and H100 datasheets
SM_COUNT_DEVICE = {108: "A100", 132: "H100"}  # SMs per GPU: A100 SXM/PCIe 108, H100 SXM 132 (NVIDIA datasheets)
# Datasheet numbers per SM count, as in conf/hardware/a100-80g-dgx.yaml and h100-sxm-dgx.yaml (tests check it).
# cite: NVIDIA A100 and H100 datasheets
DEVICE_NUMBERS = {108: DeviceNumbers(108, 2.039e12, 19.5e12, 312.0e12, "A100"),
                  132: DeviceNumbers(132, 3.35e12, 67.0e12, 989.0e12, "H100")}
# set: a unit
NS = 1e-9


@dataclass
class ImportResult:
    rows: pd.DataFrame
    """Valid instances in SLOWDOWN_SCHEMA columns."""
    skipped: dict[str, int]
    """Invalid rows per reason (nan_timing, negative_timing, fraction_out_of_range)."""
    skipped_ids: list[str] = field(default_factory=list)
    """instance_id of every skipped row."""
    slowdown_mismatch: int = 0
    """Rows whose given slowdown differs from the one recomputed from their timings."""
    header: dict = field(default_factory=dict)
    """What was parsed from the comment lines (bucket bytes, ranks)."""


def _header(path: Path) -> tuple[list[str], int]:
    lines = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.startswith("#"):
                break
            lines.append(line[1:].strip())
    return lines, len(lines)


def _comm_from_header(path: Path, comments: list[str]) -> dict:
    text = " ".join(comments)
    bucket = re.search(r"bucket_cap_mb\s*=\s*([0-9.]+)", text)
    ranks = re.search(r"on\s+(\d+)\s+GPUs", text)
    if not bucket or not ranks:
        raise ValueError(f"{path}: the comment header does not state the DDP bucket size ('bucket_cap_mb=N') and "
                         "GPU count ('on N GPUs'); pass message_bytes= and num_ranks= to import_echo_csv")
    return {"message_bytes": float(bucket.group(1)) * 2**20, "num_ranks": int(ranks.group(1))}


def _numeric(raw: pd.DataFrame, path: Path, first_line: int) -> pd.DataFrame:
    """Numeric columns parsed; a value that is not a number (NaN is allowed) names file, line and field."""
    out = {}
    for column in (*TIMING_COLUMNS, "slowdown", "SM", *METRIC_MAP):
        parsed = pd.to_numeric(raw[column], errors="coerce")
        bad = parsed.isna() & raw[column].notna() & (raw[column].astype(str).str.strip().str.lower() != "nan")
        if bad.any():
            index = int(np.flatnonzero(bad.to_numpy())[0])
            raise ValueError(f"{path}:{first_line + index}: field {column!r} has value {raw[column].iloc[index]!r}, "
                             "expected a number")
        out[column] = parsed.astype(float)
    return pd.DataFrame(out, index=raw.index)


def _device_type(path: Path, sm: pd.Series, device_type: str) -> str:
    if device_type:
        return device_type
    counts = set(sm.dropna().astype(int))
    if len(counts) == 1 and counts <= set(SM_COUNT_DEVICE):
        return SM_COUNT_DEVICE[counts.pop()]
    raise ValueError(f"{path}: field 'SM' has value(s) {sorted(counts)}; known SM counts: {SM_COUNT_DEVICE}; "
                     "pass device_type= to import_echo_csv")


def _device_numbers(path: Path, sm: pd.Series, device: DeviceNumbers | None) -> DeviceNumbers:
    if device is not None:
        return device
    counts = set(sm.dropna().astype(int))
    if len(counts) == 1 and counts <= set(DEVICE_NUMBERS):
        return DEVICE_NUMBERS[counts.pop()]
    raise ValueError(f"{path}: field 'SM' has value(s) {sorted(counts)}; device numbers are known for SM counts "
                     f"{sorted(DEVICE_NUMBERS)}; pass device=DeviceNumbers(...) to import_echo_csv")


def reconstructed_work(dram_pct, compute_pct, solo_s, device: DeviceNumbers) -> tuple[np.ndarray, np.ndarray]:
    """(bytes_moved, flops) of kernels from their Nsight DRAM and SM throughput percentages (module docstring)."""
    dram, sm, t = (np.asarray(x, dtype=float) for x in (dram_pct, compute_pct, solo_s))
    return dram / 100 * device.memory_bandwidth_bytes_per_s * t, sm / 100 * device.vector_flops_per_s * t


def import_echo_csv(path: Path, hardware: str, device_type: str = "", message_bytes: float | None = None,
                    num_ranks: int | None = None, device: DeviceNumbers | None = None) -> ImportResult:
    """Rows of one Echo-format CSV in SLOWDOWN_SCHEMA; invalid rows are counted in the result."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"slowdown dataset file {path} does not exist")
    comments, skip = _header(path)
    raw = pd.read_csv(path, skiprows=skip, dtype=str, keep_default_na=False, na_values=["", "nan", "NaN"])
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; an Echo merged_features.csv has {list(REQUIRED)}")
    values = _numeric(raw, path, first_line=skip + 2)
    comm = ({"message_bytes": message_bytes, "num_ranks": num_ranks} if message_bytes and num_ranks
            else _comm_from_header(path, comments))
    numbers = _device_numbers(path, values["SM"], device)
    solo = values["ground_truth"] * NS
    moved, flops = reconstructed_work(values["DRAM throughput"], values["Compute throughput"], solo, numbers)
    kinds = raw["kShortName"].fillna("").map(cuda_kernel_kind)
    flops = np.where(kinds.isin(FLOP_BOUND_KINDS), flops, np.nan)
    rows = pd.DataFrame({
        "source": f"import:{path.name}",
        "hardware": hardware,
        "device_type": _device_type(path, values["SM"], device_type),
        **{name: value for name, value in numbers.columns().items() if name in DEVICE_COLUMNS},
        "instance_id": "echo:" + raw["id"].astype(str),
        "op": raw["kShortName"],
        "kernel_name": raw["kDemangledName"],
        "op_kind": kinds,
        "flops": flops,
        "bytes_moved": moved,
        "collective": "all_reduce",
        "algorithm": "",
        "protocol": "",
        "message_bytes": float(comm["message_bytes"]),
        "num_ranks": int(comm["num_ranks"]),
        "channels": np.nan,
        **{name: values[column] * NS for column, name in TIMING_COLUMNS.items() if column != "overlap_ratio"},
        "overlap_fraction": values["overlap_ratio"],
        **{name: values[column] for column, name in METRIC_MAP.items()},
    })
    valid, skipped, invalid = check_instances(rows)
    kept = invalid_reason(rows["solo_duration_s"], rows["overlapped_duration_s"], rows["overlap_fraction"]) == ""
    given = values.loc[kept, "slowdown"]
    recomputed = slowdown_of(valid["solo_duration_s"], valid["overlapped_duration_s"], valid["overlap_fraction"])
    mismatch = ~np.isclose(given.to_numpy(), recomputed, rtol=1e-6, atol=1e-6, equal_nan=False)
    return ImportResult(rows=valid, skipped=skipped, skipped_ids=list(invalid["instance_id"]),
                        slowdown_mismatch=int(mismatch.sum()), header=comm)
