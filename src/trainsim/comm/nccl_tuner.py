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
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.optimize import minimize_scalar

_RING_FACTOR = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
_TREE_FACTOR = {"LL": 1 / 3.8, "LL128": 120 / 128, "Simple": 0.92}


@cache
def nccl_constants() -> dict:
    return yaml.safe_load((Path(__file__).with_name("nccl_constants.yaml")).read_text())


def release_constants(version: str) -> dict:
    """The latency tables of the NCCL release `version` ('' or unknown: the newest)."""
    releases = nccl_constants()["releases"]

    def key(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2])

    if not version:
        return releases[-1]
    try:
        wanted = key(version)
    except ValueError:
        raise ValueError(f"hardware.nccl.version={version!r} is not a release number like '2.20.5'") from None
    eligible = [r for r in releases if key(r["from"]) <= wanted]
    return eligible[-1] if eligible else releases[0]


def tuner_estimates(version: str, collective: str, pairs: list[tuple[str, str]], size: np.ndarray,
                    num_ranks: int, num_nodes: int, bus_bandwidth_bytes_per_s: float) -> np.ndarray:
    """NCCL's estimate (s) per (algorithm, protocol) pair (rows) and size (columns); a pair NCCL's model
    has no formula for here (nvls) gets +inf."""
    constants = release_constants(version)
    base, hw = constants["base_latency_us"], constants["hw_latency_us"]
    all_reduce = collective == "all_reduce"
    nsteps = 2 * (num_ranks - 1) if all_reduce else num_ranks - 1 if collective in (
        "all_gather", "reduce_scatter") else num_ranks
    ninter = (2 if all_reduce else 1) * (num_nodes - 1)
    size = np.asarray(size, dtype=float)
    rows = []
    for algorithm, p in pairs:
        if algorithm == "ring":
            latency = base["ring"][p] + (nsteps - ninter) * hw["NVLINK"]["ring"][p] + ninter * hw["NET"]["ring"][p]
            algbw = bus_bandwidth_bytes_per_s * _RING_FACTOR[p] * num_ranks / max(nsteps, 1)
        elif algorithm == "tree" and all_reduce and num_nodes > 1:
            per_node = num_ranks // num_nodes
            latency = base["tree"][p] + 2 * ((per_node - 1) * hw["NVLINK"]["tree"][p]
                                             + math.log2(num_nodes) * hw["NET"]["tree"][p])
            algbw = bus_bandwidth_bytes_per_s * _TREE_FACTOR[p] / 2
        else:
            rows.append(np.full(size.shape, np.inf))
            continue
        rows.append(latency * 1e-6 + size / algbw)
    return np.array(rows)


def tuner_seconds(version: str, collective: str, size: np.ndarray, num_ranks: int, num_nodes: int,
                  bus_bandwidth_bytes_per_s: float, protocols=("LL", "LL128", "Simple")) -> np.ndarray:
    """NCCL's estimate for the cheapest (algorithm, protocol), per size."""
    algorithms = ("ring", "tree") if collective == "all_reduce" and num_nodes > 1 else ("ring",)
    pairs = [(a, p) for p in protocols for a in algorithms]
    return tuner_estimates(version, collective, pairs, size, num_ranks, num_nodes,
                           bus_bandwidth_bytes_per_s).min(axis=0)


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
