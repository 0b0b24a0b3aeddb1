"""The network between nodes as the collective model sees it: node bandwidth, NVLink domains, the fabric,
and the transport priors that let a cluster nobody measured be predicted from its description.

A cluster is described by hardware.network (config/schema.py NetworkConfig). What a datasheet cannot
say, how much of the nominal NIC bandwidth NCCL reaches over a transport and what latency each network hop
adds on it (the network stack: verbs, libfabric/SRD, sockets, the proxy), is learned across
measured clusters (comm/network_fit.py) and kept in network_priors.yaml, per link generation, transport,
NCCL network plugin and over all clusters. A prediction takes the most specific level with data and
reports that level's leave-one-cluster-out error as its uncertainty band.

The "node" of the collective model is the NVLink domain: inside it collectives run over NVLink (a
DGX's 8 GPUs; the 72 GPUs of a GB200 NVL72 rack, 18 trays of 4), between domains over the network. Which
domain a job's rank is in depends on the job's size and the scheduler's placement: comm/placement.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from trainsim.config.schema import HardwareConfig

PRIORS_FILE = Path(__file__).with_name("network_priors.yaml")
PLUGIN = {"infiniband": "ib-verbs", "roce": "ib-verbs", "efa": "aws-ofi-nccl", "tcp": "socket"}
"""The NCCL network plugin each transport runs through: RoCE uses NCCL's InfiniBand verbs transport."""
TUNER = {"aws-ofi-nccl": "model"}
"""Plugins that ship their own tuner (aws-ofi-nccl picks algorithms from measurements of its platforms:
the p4de and p5 all-reduce logs run trees where NCCL's own model keeps rings); the others leave the choice
to NCCL's cost model ('nccl')."""
# cite: data/nccl-tests (vTrain's 8x A100 table, ml-engineering's 8x H200 table), as derived below
NVLINK_EFFICIENCY = 0.94
"""Achieved fraction of NVLink's datasheet rate per direction, once the local buffer work of the model's delta
term (3 bytes at memory bandwidth per byte) is taken out of the measured ring bus bandwidth: A100 229 GB/s of
300 (vTrain's 8-GPU table, 1 GiB) -> 0.947, H200 367 GB/s of 450 (ml-engineering's 8-GPU table, 16 GiB, 4.8 TB/s
HBM3e) -> 0.939 (data/nccl-tests); their mean, as `python -m trainsim.comm.nvlink_fit` computes it. The intra-node
prior of a GPU without a single-node measurement."""


def domain_size(hw: HardwareConfig) -> int:
    """Devices per NVLink domain: the collective model's node."""
    return hw.network.nvlink_domain_size or hw.devices_per_node


def node_bandwidth(hw: HardwareConfig) -> float:
    """Nominal network bandwidth per node (per direction): its NICs, or hardware.inter_node_bandwidth."""
    net = hw.network
    if net.nics_per_node and net.nic_bandwidth_bytes_per_s:
        return net.nics_per_node * net.nic_bandwidth_bytes_per_s
    return hw.inter_node_bandwidth_bytes_per_s


def domain_bandwidth(hw: HardwareConfig) -> float:
    """Nominal network bandwidth of one NVLink domain (the nodes it spans)."""
    nodes = domain_size(hw) // hw.devices_per_node if hw.devices_per_node else 1
    return node_bandwidth(hw) * max(nodes, 1)


def tuner(hw: HardwareConfig) -> str:
    """'model' or 'nccl': who picks a multi-node collective's algorithm on this network (Fabric.tuner)."""
    transport = hw.network.transport
    return TUNER.get(PLUGIN.get(transport, ""), "nccl") if transport else "model"


@dataclass(frozen=True)
class NetworkPrior:
    """Learned parameters of the network hop for one description level."""

    level: str
    """'link_generation', 'transport', 'plugin' or 'all'."""
    key: str
    bandwidth_efficiency: float
    """Achieved fraction of the nominal node bandwidth on the network hop."""
    hop_latency_s: float
    """Latency of one network hop on a collective's critical path (network stack and proxy): paid per inter-node
    step of a ring, per inter-node stage of a tree or chain, once by a send/recv and an all-to-all, so a
    collective over more nodes pays it as NCCL's own model does."""
    clusters: tuple[str, ...]
    """Clusters it was learned from."""
    error_pct: float
    """Mean absolute error (messages >= 1 MiB) of clusters of this level predicted leave-one-cluster-out (for a
    level of one cluster at least the mean over all clusters): the band reported with a prediction from it."""

    def describe(self) -> str:
        return (f"{self.level} {self.key!r} network prior (bandwidth efficiency {self.bandwidth_efficiency:.2f}, "
                f"{self.hop_latency_s * 1e6:.0f} us per network hop; learned from {', '.join(self.clusters)}), "
                f"+-{self.error_pct:.0f} % across clusters")


@cache
def _priors_table() -> dict:
    return yaml.safe_load(PRIORS_FILE.read_text())


def network_prior(hw: HardwareConfig, table: dict | None = None) -> NetworkPrior | None:
    """The most specific learned prior for hw's network: its link generation, transport, plugin, or all
    clusters; None when no transport is configured."""
    transport = hw.network.transport
    if not transport:
        return None
    table = table if table is not None else _priors_table()
    generation = f"{transport}/{hw.network.link_generation}" if hw.network.link_generation else ""
    for level, key in (("link_generation", generation), ("transport", transport),
                       ("plugin", PLUGIN[transport]), ("all", "all")):
        entry = table.get(level, {}).get(key)
        if key and entry:
            return NetworkPrior(level, key, float(entry["bandwidth_efficiency"]), float(entry["hop_latency_s"]),
                                tuple(entry["clusters"]), float(entry["error_pct"]))
    return None
