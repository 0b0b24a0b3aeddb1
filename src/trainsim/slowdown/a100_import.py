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
  SM (number of SMs; 108 = A100)                                           -> device_type

The file has no per-kernel communication columns: every overlapping NCCL kernel is a DDP gradient
all-reduce of one bucket, so collective='all_reduce', message_bytes = the bucket cap and num_ranks =
the GPU count, both parsed from the header ('bucket_cap_mb=2', 'on 2 GPUs'); algorithm, protocol and
channels are unknown ('' / NaN). FLOPs and bytes are unknown (NaN).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.slowdown.dataset import check_instances, invalid_reason, slowdown_of
from trainsim.slowdown.features import cuda_kernel_kind

TIMING_COLUMNS = {"ground_truth": "solo_duration_s", "duration": "overlapped_duration_s",
                  "overlap_ratio": "overlap_fraction"}
METRIC_MAP = {"Compute throughput": "compute_throughput_pct", "Memory throughput": "memory_throughput_pct",
              "DRAM throughput": "dram_throughput_pct", "Achieved occupancy": "achieved_occupancy_pct",
              "Maximum occupancy": "max_occupancy_pct", "L1 hit rate": "l1_hit_pct", "L2 hit rate": "l2_hit_pct"}
REQUIRED = ("id", "kShortName", "kDemangledName", *TIMING_COLUMNS, "slowdown", "SM", *METRIC_MAP)
SM_COUNT_DEVICE = {108: "A100", 132: "H100"}  # SMs per GPU: A100 SXM/PCIe 108, H100 SXM 132 (NVIDIA datasheets)
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


def import_echo_csv(path: Path, hardware: str, device_type: str = "", message_bytes: float | None = None,
                    num_ranks: int | None = None) -> ImportResult:
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
    rows = pd.DataFrame({
        "source": f"import:{path.name}",
        "hardware": hardware,
        "device_type": _device_type(path, values["SM"], device_type),
        "instance_id": "echo:" + raw["id"].astype(str),
        "op": raw["kShortName"],
        "kernel_name": raw["kDemangledName"],
        "op_kind": raw["kShortName"].fillna("").map(cuda_kernel_kind),
        "flops": np.nan,
        "bytes_moved": np.nan,
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
