"""Apply `hardware.what_if` to the costs the composer and the layout search use.

Measurements and fits describe the hardware as it is; a what-if changes the answer, not the data:
* communication: every fitted or prior bandwidth of a hop is multiplied by that hop's scale, every
  latency and launch cost by latency_scale (the model's structure, channels and chunking stay);
* compute: each kernel's time is multiplied by the ratio of its roofline time on the changed device to
  its roofline time on the configured one (peak FLOP/s of its dtype, memory bandwidth, launch floor
  unchanged), so compute-bound kernels follow the peak rate and memory-bound ones the bandwidth.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from trainsim.config.schema import HardwareConfig, WhatIfConfig
from trainsim.profile.analytical import predict_rows

IDENTITY = WhatIfConfig()


def is_identity(what_if: WhatIfConfig) -> bool:
    return what_if == IDENTITY


def scale_comm_values(values: dict[str, float], what_if: WhatIfConfig) -> dict[str, float]:
    """CollectiveParams.values with the what-if applied (keys 'bandwidth.<hop>.<p>', 'latency.*', 'alpha.*')."""
    bandwidth = {"intra": what_if.intra_node_bandwidth_scale, "inter": what_if.inter_node_bandwidth_scale}
    out = {}
    for key, value in values.items():
        kind = key.split(".")[0]
        if kind == "bandwidth":
            value *= bandwidth.get(key.split(".")[1], 1.0)
        elif kind in ("latency", "alpha"):
            value *= what_if.latency_scale
        out[key] = value
    return out


def compute_scale_factors(rows: pd.DataFrame, hw: HardwareConfig) -> np.ndarray:
    """Per op row (flops, bytes_moved, input_dtypes, op): time multiplier under the compute what-if."""
    if hw.what_if.peak_flops_scale == 1.0 and hw.what_if.memory_bandwidth_scale == 1.0:
        return np.ones(len(rows))
    changed = dataclasses.replace(
        hw, peak_flops_per_s={k: v * hw.what_if.peak_flops_scale for k, v in hw.peak_flops_per_s.items()},
        memory_bandwidth_bytes_per_s=hw.memory_bandwidth_bytes_per_s * hw.what_if.memory_bandwidth_scale)
    before, after = predict_rows(rows, hw), predict_rows(rows, changed)
    return np.divide(after, before, out=np.ones(len(rows)), where=before > 0)


def scaled_compute_times(times: dict[str, float], ops: pd.DataFrame, hw: HardwareConfig) -> dict[str, float]:
    """signature -> seconds with the compute what-if applied; `ops` has one row per signature."""
    if hw.what_if.peak_flops_scale == 1.0 and hw.what_if.memory_bandwidth_scale == 1.0:
        return times
    ops = ops.drop_duplicates("signature")
    ops = ops[ops["signature"].isin(set(times))]
    factors = dict(zip(ops["signature"], compute_scale_factors(ops, hw)))
    return {sig: t * factors.get(sig, 1.0) for sig, t in times.items()}
