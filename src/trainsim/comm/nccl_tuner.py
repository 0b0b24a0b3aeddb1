"""NCCL's own cost model (src/graph/tuning.cc): how NCCL picks an (algorithm, protocol) across nodes
where no tuner plugin does, and the second baseline the collective model is compared with.

NCCL estimates, per (algorithm, protocol), `time = latency + size / algbw` and runs the cheapest:
  ring: latency = base + (nsteps - ninter) * max(hwLat[NVLINK], net overhead) + ninter * hwLat[NET],
        x 1.4 for Simple all-reduce across nodes (1.9 before sm80; "plateau effect of ring");
        nsteps = 2(N-1) for all-reduce, N-1 for all-gather / reduce-scatter, N otherwise;
        ninter = 2(M-1) for all-reduce, M-1 otherwise; algbw = busbw_p * N / nsteps
  tree (all-reduce, M > 1): latency = base + 2((K-1) hwLat[NVLINK] + floor(log2 M) hwLat[NET]); algbw = busbw_p / 2,
        times the tree correction factor of the size below 512 MiB
  busbw = channels x the per-channel bandwidth of the algorithm's graph, then per protocol: ring LL x 1/2 (at most
        llMaxBw), ring LL128 x 0.92 (at most channels x perChMaxRingLL128Bw); tree x 0.92 (at most channels x
        perChMaxTreeBw), LL x 1/3.8 (at most llMaxBw), LL128 x 120/128 (at most channels x perChMaxTreeLL128Bw).
The per-channel bandwidth is what NCCL's topology search found (TunerTopology): a ring channel runs through one
NIC at the fastest step of NCCL's speed ladder the NIC and NVLink carry; on up to 2 nodes NCCL prices every graph
by its intra-node bandwidth, and the search raises a tree's (up to twice the ring's, as far as NVLink carries), so
there a tree can beat a ring where it cannot on more nodes. Without a topology (the baseline below) one fitted
bus bandwidth stands for every graph, and the caps and the plateau (which needs the channel count) are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from trainsim.config.choices import OLDEST_NCCL_RELEASE


@cache
def nccl_constants() -> dict:
    """nccl_constants.yaml; its oldest release must be the one config validation accepts from."""
    path = Path(__file__).with_name("nccl_constants.yaml")
    constants = yaml.safe_load(path.read_text())
    if constants["releases"][0]["from"] != OLDEST_NCCL_RELEASE:
        raise ValueError(f"{path}: releases[0].from={constants['releases'][0]['from']!r}, but "
                         f"config.choices.OLDEST_NCCL_RELEASE={OLDEST_NCCL_RELEASE!r}; make them equal")
    return constants


def release_key(version: str) -> tuple[int, ...]:
    """(major, minor) of an NCCL release number like '2.20.5'."""
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        raise ValueError(f"hardware.nccl.version={version!r} is not a release number like '2.20.5'") from None


def release_constants(version: str) -> dict:
    """The latency tables of the NCCL release `version` ('' or unknown: the newest)."""
    releases = nccl_constants()["releases"]
    if not version:
        return releases[-1]
    wanted = release_key(version)
    eligible = [r for r in releases if release_key(r["from"]) <= wanted]
    return eligible[-1] if eligible else releases[0]


@dataclass(frozen=True)
class TunerTopology:
    """What NCCL's topology search hands its tuner on a multi-node communicator (search.cc)."""

    channels: int
    ring_bytes_per_s: float
    """Per-channel bandwidth of the ring graph (its intra- and inter-node bandwidth are equal)."""
    tree_intra_bytes_per_s: float
    """Per-channel intra-node bandwidth of the tree graph, which NCCL uses on up to 2 nodes."""
    generation: str
    """GPU generation of the per-channel caps and the speed ladder."""


@cache  # same fabric, same answer: asked once per estimate, on the search's hot path
def tuner_topology(nics_per_node: int, nic_bytes_per_s: float, nvlink_bytes_per_s: float, generation: str
                   ) -> TunerTopology | None:
    """The search's result as NCCL finds it on a rail-optimised node: one ring channel per NIC at the fastest
    step of the speed ladder at most the NIC's rate and within NVLink (channels x speed); the tree graph then
    raises its intra-node speed step by step while below twice the ring's and within NVLink. None without
    NICs or a known generation."""
    t = nccl_constants()["tuner"]
    if not (nics_per_node and nic_bytes_per_s and generation):
        return None
    ladder = [v * 1e9 for v in t["speed_ladder_inter_gbps"][generation]]
    nvlink = nvlink_bytes_per_s * t["nvlink_fraction"][generation] if nvlink_bytes_per_s else math.inf
    fits = [i for i, v in enumerate(ladder) if v <= nic_bytes_per_s and v * nics_per_node <= nvlink]
    if not fits:
        return None
    ring = tree = fits[0]
    while tree > 0 and ladder[tree] < 2 * ladder[ring] and ladder[tree - 1] * nics_per_node <= nvlink:
        tree -= 1
    return TunerTopology(nics_per_node, ladder[ring], ladder[tree], generation)


def _bus_bandwidth(algorithm: str, protocol: str, bus: float, num_nodes: int, topology: TunerTopology | None
                   ) -> float:
    """NCCL's bus bandwidth of one (algorithm, protocol) before the busbw -> algbw ratio (module doc)."""
    t = nccl_constants()["tuner"]
    caps, ll_max = dict.fromkeys(t["per_channel_max_gbps"], math.inf), math.inf
    if topology is not None:
        tree_graph = algorithm == "tree" and num_nodes <= 2
        bus = topology.channels * (topology.tree_intra_bytes_per_s if tree_graph else topology.ring_bytes_per_s)
        nodes = min(num_nodes, 3) - 1  # the tables' columns: 1, 2, 3 or more nodes
        caps = {key: topology.channels * table[topology.generation][nodes] * 1e9
                for key, table in t["per_channel_max_gbps"].items()}
        ll_max = t["ll_max_gbps_multi_node"][nodes] * 1e9
    if algorithm == "ring":
        return {"LL": min(ll_max, bus * 0.5), "LL128": min(bus * 0.92, caps["ring_LL128"]), "Simple": bus}[protocol]
    bus = min(bus * 0.92, caps["tree"])
    return {"LL": min(bus / 3.8, ll_max), "LL128": min(bus * 120 / 128, caps["tree_LL128"]), "Simple": bus}[protocol]


def tuner_estimates(version: str, collective: str, pairs: list[tuple[str, str]], size: np.ndarray,
                    num_ranks: int, num_nodes: int, bus_bandwidth_bytes_per_s: float,
                    topology: TunerTopology | None = None) -> np.ndarray:
    """NCCL's estimate (s) per (algorithm, protocol) pair (rows) and size (columns); a pair NCCL's model
    has no formula for here (nvls) gets +inf. `topology`: what NCCL's search found (the per-channel
    bandwidths and caps); without it `bus_bandwidth_bytes_per_s` stands for every graph."""
    constants, t = release_constants(version), nccl_constants()["tuner"]
    base, hw = constants["base_latency_us"], constants["hw_latency_us"]
    all_reduce = collective == "all_reduce"
    nsteps = 2 * (num_ranks - 1) if all_reduce else num_ranks - 1 if collective in (
        "all_gather", "reduce_scatter") else num_ranks
    ninter = (2 if all_reduce else 1) * (num_nodes - 1)
    size = np.asarray(size, dtype=float)
    log_size = np.floor(np.log2(np.maximum(size, 64) / 64)).astype(int)
    rows = []
    for algorithm, p in pairs:
        if algorithm not in ("ring", "tree") or (algorithm == "tree" and not (all_reduce and num_nodes > 1)):
            rows.append(np.full(size.shape, np.inf))
            continue
        busbw = _bus_bandwidth(algorithm, p, bus_bandwidth_bytes_per_s, num_nodes, topology)
        if algorithm == "ring":
            overhead = t["net_overhead_us"] * (3 if p == "Simple" else 1) if num_nodes > 1 else 0.0
            intra = max(hw["NVLINK"]["ring"][p], overhead)
            net = hw["NET"]["tree" if num_ranks == num_nodes else "ring"][p]  # one rank per node: fully exposed
            latency = np.full(size.shape, base["ring"][p] + (nsteps - ninter) * intra + ninter * net)
            if p == "Simple" and all_reduce and num_nodes > 1 and topology is not None:
                latency = np.where(size / (topology.channels * num_ranks) >= 64,
                                   latency * t["ring_simple_plateau"][topology.generation], latency)
            algbw = np.full(size.shape, busbw * num_ranks / max(nsteps, 1))
        else:
            per_node = num_ranks // num_nodes
            latency = np.full(size.shape, base["tree"][p] + 2 * (
                (per_node - 1) * hw["NVLINK"]["tree"][p] + math.floor(math.log2(num_nodes)) * hw["NET"]["tree"][p]))
            correction = np.asarray(t["tree_correction"][p])
            algbw = busbw / 2 * np.where(log_size < len(correction),
                                         correction[np.minimum(log_size, len(correction) - 1)], 1.0)
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
    from scipy.optimize import minimize_scalar  # here, not at the top: composing never fits, and the import takes 0.5 s
    measured = table["time_s"].to_numpy(float)

    def loss(log_bw: float) -> float:
        predicted = NcclTuner(version, collective, math.exp(log_bw)).predict(table)
        return float(np.sum(((predicted - measured) / measured) ** 2))

    best = minimize_scalar(loss, bounds=(math.log(1e8), math.log(1e13)), method="bounded")
    return NcclTuner(version, collective, math.exp(best.x))
