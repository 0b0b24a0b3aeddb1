"""The overlap-slowdown dataset: one row per compute-kernel instance, timed solo and overlapped.

A compute op that runs while a communication op runs on the same device takes longer (shared SMs,
caches and DRAM on a GPU; shared cores, caches and memory bandwidth on a CPU). Following Echo
(arXiv 2412.12487, and its slowdown_collection/analyse.py), each instance records

  solo_duration_s        the op's time with nothing else on the device
  overlapped_duration_s  the same op's time in the run where a collective was in flight
  overlap_fraction r     the share of overlapped_duration_s during which the collective ran
  slowdown s             (overlapped - solo) / (r * solo): the fractional slow-down per unit of
                         overlapped time, so that  overlapped = (1 - r) * solo + r * solo * (1 + s)

SLOWDOWN_SCHEMA (Parquet) columns:

  source, hardware, device_type    where the row comes from ('measured-cpu', 'measured-cuda',
                                   'import:<file>'), the hardware key, the device type (a label for
                                   summaries and the baseline; not a model feature)
  device_sm_count, device_memory_bandwidth_bytes_per_s, device_vector_flops_per_s,
  device_matrix_flops_per_s        datasheet numbers of the device the row was measured on (NaN =
                                   unknown; trainsim.slowdown.features.DeviceNumbers)
  instance_id                      unique within the dataset (e.g. 'echo:17', 'w12-c3')
  op, kernel_name, op_kind         aten op name (measured) or kernel short name (imported); the full
                                   kernel name where known; the op kind shared by both vocabularies
                                   (matmul, attention, elementwise, reduction, normalization,
                                   softmax_loss, indexing, copy, optimizer, other)
  flops, bytes_moved               the op's FLOPs and bytes (trace conventions; imported Echo rows:
                                   reconstructed from the Nsight metrics, see a100_import.py); NaN = unknown
  collective, algorithm, protocol  the concurrent collective; algorithm/protocol '' = unknown
  message_bytes, num_ranks         its size (nccl-tests semantics) and group size
  channels                         NCCL channels or gloo threads; NaN = unknown
  solo_duration_s, overlapped_duration_s, overlap_fraction, slowdown   as above (seconds)
  status                           'ok' (a training target) or 'zero_overlap' (r = 0: kept, counted,
                                   never a target; slowdown is 0 there, Echo's convention)
  compute_throughput_pct, memory_throughput_pct, dram_throughput_pct, achieved_occupancy_pct,
  max_occupancy_pct, l1_hit_pct, l2_hit_pct   profiler metrics of the solo kernel (Nsight Compute
                                   on a GPU); NaN where the device does not expose them (CPU). Kept
                                   as measurements; not model inputs (the composer has no profiler)

Rows with NaN or negative timings or an overlap fraction outside [0, 1] are not valid instances:
`check_instances` separates them and returns their count per reason, so callers report them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

METRIC_COLUMNS = ("compute_throughput_pct", "memory_throughput_pct", "dram_throughput_pct",
                  "achieved_occupancy_pct", "max_occupancy_pct", "l1_hit_pct", "l2_hit_pct")

SLOWDOWN_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("hardware", pa.string()),
    ("device_type", pa.string()),
    ("device_sm_count", pa.float64()),
    ("device_memory_bandwidth_bytes_per_s", pa.float64()),
    ("device_vector_flops_per_s", pa.float64()),
    ("device_matrix_flops_per_s", pa.float64()),
    ("instance_id", pa.string()),
    ("op", pa.string()),
    ("kernel_name", pa.string()),
    ("op_kind", pa.string()),
    ("flops", pa.float64()),
    ("bytes_moved", pa.float64()),
    ("collective", pa.string()),
    ("algorithm", pa.string()),
    ("protocol", pa.string()),
    ("message_bytes", pa.float64()),
    ("num_ranks", pa.int64()),
    ("channels", pa.float64()),
    ("solo_duration_s", pa.float64()),
    ("overlapped_duration_s", pa.float64()),
    ("overlap_fraction", pa.float64()),
    ("slowdown", pa.float64()),
    ("status", pa.string()),
    *[(name, pa.float64()) for name in METRIC_COLUMNS],
])

STATUS_OK = "ok"
STATUS_ZERO_OVERLAP = "zero_overlap"
INVALID_REASONS = ("nan_timing", "negative_timing", "fraction_out_of_range")


def slowdown_of(solo_s, overlapped_s, fraction) -> np.ndarray:
    """s = (overlapped - solo) / (r * solo) (Echo, analyse.py); 0 where r = 0 (no overlap, no target)."""
    solo, overlapped, r = (np.asarray(x, dtype=float) for x in (solo_s, overlapped_s, fraction))
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (overlapped - solo) / (r * solo)
    return np.where(r > 0, s, 0.0)


def invalid_reason(solo_s: pd.Series, overlapped_s: pd.Series, fraction: pd.Series) -> pd.Series:
    """Per row: '' if the timings are a valid instance, else the first reason in INVALID_REASONS."""
    reason = pd.Series("", index=solo_s.index, dtype=object)
    out_of_range = (fraction < 0) | (fraction > 1)
    negative = (solo_s <= 0) | (overlapped_s <= 0)
    nan = solo_s.isna() | overlapped_s.isna() | fraction.isna()
    reason[out_of_range] = "fraction_out_of_range"
    reason[negative] = "negative_timing"   # a zero duration is as impossible as a negative one
    reason[nan] = "nan_timing"
    return reason


def check_instances(rows: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int], pd.DataFrame]:
    """Split rows into valid instances (with slowdown and status recomputed) and invalid ones.

    Returns (valid rows, {reason: count} for every reason in INVALID_REASONS, invalid rows with a
    'reason' column), so nothing is dropped silently and no NaN reaches a target.
    """
    reason = invalid_reason(rows["solo_duration_s"], rows["overlapped_duration_s"], rows["overlap_fraction"])
    invalid = rows[reason != ""].assign(reason=reason[reason != ""])
    valid = rows[reason == ""].copy()
    valid["slowdown"] = slowdown_of(valid["solo_duration_s"], valid["overlapped_duration_s"],
                                    valid["overlap_fraction"])
    valid["status"] = np.where(valid["overlap_fraction"] > 0, STATUS_OK, STATUS_ZERO_OVERLAP)
    counts = {name: int((invalid["reason"] == name).sum()) for name in INVALID_REASONS}
    return valid.reset_index(drop=True), counts, invalid.reset_index(drop=True)


def to_table(rows: pd.DataFrame) -> pa.Table:
    """The rows in SLOWDOWN_SCHEMA (missing optional columns become null / NaN)."""
    frame = rows.copy()
    for f in SLOWDOWN_SCHEMA:
        if f.name not in frame:
            frame[f.name] = np.nan if pa.types.is_floating(f.type) else ("" if pa.types.is_string(f.type) else 0)
    return pa.Table.from_pandas(frame[SLOWDOWN_SCHEMA.names], schema=SLOWDOWN_SCHEMA, preserve_index=False)


def status_counts(rows: pd.DataFrame) -> dict[str, int]:
    return {status: int((rows["status"] == status).sum()) for status in (STATUS_OK, STATUS_ZERO_OVERLAP)}
