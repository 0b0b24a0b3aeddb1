"""NCCL's own cost model (src/graph/tuning.cc), the second baseline the collective model is compared with.

NCCL estimates, per (algorithm, protocol), `time = latency + size / algbw` and runs the cheapest:
  ring: latency = base + (nsteps - ninter) * hwLat[NVLINK] + ninter * hwLat[NET],
        nsteps = 2(N-1) for all-reduce, N-1 for all-gather / reduce-scatter, N otherwise;
        ninter = 2(M-1) for all-reduce, M-1 otherwise; algbw = busbw_p * N / nsteps
  tree (all-reduce, M > 1): latency = base + 2((K-1) hwLat[NVLINK] + log2(M) hwLat[NET]); algbw = busbw_p / 2
  busbw_p = busbw * {LL: 1/2, LL128: 0.92, Simple: 1} (ring), {LL: 1/3.8, LL128: 120/128, Simple: 0.92} (tree)
The latencies are the release's constants (nccl_constants.yaml); the one hardware number NCCL gets
from its topology search, the bus bandwidth, is fitted. Simplified: the per-channel caps (llMaxBws,
perChMax*Bw) and the tree correction factors are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import minimize_scalar

from trainsim.comm.model import release_constants

_RING_FACTOR = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
_TREE_FACTOR = {"LL": 1 / 3.8, "LL128": 120 / 128, "Simple": 0.92}


def tuner_seconds(version: str, collective: str, size: np.ndarray, num_ranks: int, num_nodes: int,
                  bus_bandwidth_bytes_per_s: float, protocols=("LL", "LL128", "Simple")) -> np.ndarray:
    """NCCL's estimate for the cheapest (algorithm, protocol), per size."""
    constants = release_constants(version)
    base, hw = constants["base_latency_us"], constants["hw_latency_us"]
    all_reduce = collective == "all_reduce"
    nsteps = 2 * (num_ranks - 1) if all_reduce else num_ranks - 1 if collective in (
        "all_gather", "reduce_scatter") else num_ranks
    ninter = (2 if all_reduce else 1) * (num_nodes - 1)
    size = np.asarray(size, dtype=float)
    estimates = []
    for p in protocols:
        latency = base["ring"][p] + (nsteps - ninter) * hw["NVLINK"]["ring"][p] + ninter * hw["NET"]["ring"][p]
        algbw = bus_bandwidth_bytes_per_s * _RING_FACTOR[p] * num_ranks / max(nsteps, 1)
        estimates.append(latency * 1e-6 + size / algbw)
        if all_reduce and num_nodes > 1:
            per_node = num_ranks // num_nodes
            latency = base["tree"][p] + 2 * ((per_node - 1) * hw["NVLINK"]["tree"][p]
                                             + math.log2(num_nodes) * hw["NET"]["tree"][p])
            estimates.append(latency * 1e-6 + size / (bus_bandwidth_bytes_per_s * _TREE_FACTOR[p] / 2))
    return np.min(estimates, axis=0)


@dataclass
class NcclTuner:
    """NCCL's model with its bus bandwidth fitted to measurements."""

    version: str
    collective: str
    bus_bandwidth_bytes_per_s: float

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        out = np.empty(len(table))
        for (ranks, nodes), index in table.groupby(["num_ranks", "num_nodes"]).indices.items():
            sizes = table["message_bytes"].to_numpy(float)[index]
            out[index] = tuner_seconds(self.version, self.collective, sizes, int(ranks), int(nodes),
                                       self.bus_bandwidth_bytes_per_s)
        return out


def fit_nccl_tuner(table: pd.DataFrame, collective: str, version: str) -> NcclTuner:
    """The bus bandwidth (1e8 .. 1e13 B/s) with the least squared relative error."""
    measured = table["time_s"].to_numpy(float)

    def loss(log_bw: float) -> float:
        predicted = NcclTuner(version, collective, math.exp(log_bw)).predict(table)
        return float(np.sum(((predicted - measured) / measured) ** 2))

    best = minimize_scalar(loss, bounds=(math.log(1e8), math.log(1e13)), method="bounded")
    return NcclTuner(version, collective, math.exp(best.x))
