"""Execution time of a collective: NCCL's chunked rings and pipelines with fitted per-hop parameters.

Notation: N ranks on M nodes (K = N / M per node), S the message size in nccl-tests' sense
(nccl_tests.py), C channels, p the protocol (LL, LL128, Simple), h a hop kind (intra-, inter-node).

  channels used   c_p(S) = clip(floor(S / (threads_p * threshold_p)), 1, C)   NCCL enqueue.cc: a small
                  message runs on fewer channels (threshold x nRanks for LL rings)
  chunk           chunk_p = buffer_p / NCCL_STEPS * chunk_steps_p * payload_p   device.h, init.cc
  step cost       step_h(b) = l_{h,p} + b / B_{h,p}: per-step latency l and per-channel bandwidth B of
                  hop kind h (Echo's beta for intra-node, gamma for inter-node)
  NIC share       B_inter is the node's network bandwidth over the channels, as measured with all D
                  devices of a node in the collective; a group with K < D ranks per node gets K / D of it.
                  Each GPU reaches the network through its own NIC (rail-optimised DGX) or its share of
                  the node's, and in 3D parallelism the other ranks of the node run their own groups'
                  collectives at the same time (the D / K data-parallel groups of a tensor-parallel node)

Ring family (all-reduce "ring", reduce-scatter, all-gather, all-to-all): every loop moves one chunk
per rank through s steps and all links work in every step, so loops do not overlap:
  s = 2(N-1) for all-reduce, N-1 otherwise;  eta = ceil(S / (N c_p chunk_p)) loops ("rounds")
  b = S / (N c_p eta);  T = alpha_a + eta * s * step(b) + delta * S on one node. Across nodes a chunk
  crosses s - s_inter NVLink hops and s_inter = 2(M-1) (M-1 for the others) network hops, so the
  latency is eta ((s - s_inter) l_intra + s_inter l_inter) (NCCL's own composition), and NVLink, local
  work and NIC run pipelined slice by slice: the slowest of eta s b / B_intra, delta S and
  eta s b / (share B_inter) paces the rest; gloo's all-to-all (pairwise rounds, one peer per round) is priced
  as this ring, sending K (N-K) / (N-1) times a ring's bytes through a node's NICs (all_to_all_nic_load).
NCCL's all-to-all ("p2p"): a group of sends and receives of S/N to and from every peer, all in flight at once
  over the p2p channels, so it pays one step's latency per kind of hop instead of one per ring step, and the
  network's hop latency once per batch of 8 remote peers (p2p_network_rounds):
  T = alpha + max(l_intra,p, l_inter,Simple + R l_network) + the slowest of (K-1)/N S over the rank's NVLink
  (C B_intra,p), K (N-K)/N S through the node's NICs (share C B_inter,Simple) and delta S; on one node latency,
  NVLink and local work add up as on a ring. p is LL for messages per peer up to NCCL_P2P_LL_THRESHOLD; across nodes
  it is always Simple (the network's p2p connections share Simple buffers only).
Pipeline family (all-reduce "tree", broadcast, reduce, send/recv): chunks stream through a chain:
  eta = ceil(S / (c_p chunk_p));  b = S / (c_p eta)
  T = alpha_a + sum over stages step(b) + (eta - 1) * max over stages step(b) + delta * S (across
  nodes, as for rings, the streaming NVLink part, delta * S and the NIC part overlap: the slowest counts)
  stages: tree all-reduce 2(K-1) intra + 2 ceil(log2 M) inter (NCCL's intra-node chain and
  inter-node tree, up then down); broadcast and reduce N-1 (M-1 of them inter); send/recv 1; NVLS
  all-reduce 2 through the switch at NVLS_EFFICIENCY of the NVLink rate, no local work, and across
  NVLink domains NCCL's NVLSTree: the same inside each domain, the tree's 2 ceil(log2 M) between them.
  LL128 trees shrink their chunk for messages too short to fill the tree, as NCCL does. A chain GPU
  sends the reduction up and the broadcast down through its one NVSwitch port: its NVLink streams 2 S.
  NIC load of the tree: NCCL builds two binary trees over the nodes, each carrying half the data,
  and every node is an inner node (two children) of one of them. A node then receives and sends 2S
  (reduce up, broadcast down): inter-node steps carry 2b (tree_nic_load, 1.5 on 3 nodes), and a large
  tree all-reduce takes 2S / B like a ring's 2(N-1)/N S / B (NCCL's tuner: Tree algBw = busBw / 2).
  On 2 nodes both trees are one edge and each direction carries S, so there the chain's 2 S over
  NVLink can pace it (the OCI log: 127 GB/s at 8 GiB, with 200 GB/s of NICs).
  A send/recv across nodes gets at most its peer's NCCL channels x ~14 GB/s, however fast the NIC
  (p2p_peer_channels: fewer channels per peer as the communicator grows).
delta * S is the rank's local work on its buffer, whatever N is, at memory speed (Echo's delta). Measured
busbw rising with N on one node (vTrain's A100 tables: 197, 222, 229 GB/s at 2, 4, 8 GPUs) is this term seen
through 2(N-1)/N. A reduction reads two operands and writes one (3 accesses per byte); a copy-only collective
(all-gather, all-to-all, broadcast, send/recv) only writes what arrived into its output, the read that feeds
the link being the link's own (1 access; LOCAL_ACCESSES). One node of 8 A100s (Azure, NCCL 2.17) and of 8 H200s
show it: all-gather busbw 254 / 361 GB/s, which 3 accesses would put at 191 / 325 GB/s and 1 at 244 / 384.

The collective's time is that of the (algorithm, protocol) the model finds fastest among those the
hardware config allows (NCCL_ALGO / NCCL_PROTO), or across nodes on networks whose NCCL plugin leaves the
choice to NCCL's cost model (Fabric.tuner 'nccl', comm/network.py) the one that model prefers, given the
channels and per-channel bandwidths its topology search finds (nccl_tuner.TunerTopology).
The "node" is the NVLink domain (hardware.network.nvlink_domain_size); a collective that spans domains
also pays the network's own latency per network hop on its critical path (values 'latency.network', a learned
prior of the transport, comm/network.py): per inter-node step of a ring, per inter-node stage of a tree or chain,
per batch of remote peers for an all-to-all; once per collective, not per loop (the loops stream behind it, as
NCCL's own estimate has its latency independent of size). Across the 6 measured clusters this is what lets a
cluster measured on 2-32 nodes and one measured on 2 predict each other (docs/comm.md).
alpha, l, B and delta are fitted to measurements (comm/fit.py); NCCL's own constants (nccl_constants.yaml)
give chunk sizes, channel thresholds and the priors the fit starts from and falls back to.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainsim.comm.nccl_tuner import nccl_constants, release_constants, release_key, tuner_estimates, tuner_topology
from trainsim.comm.network import NVLINK_EFFICIENCY, domain_bandwidth, domain_size, network_prior, tuner
from trainsim.comm.noise import SystemNoise
from trainsim.config.choices import ALGORITHMS, PROTOCOLS
from trainsim.config.devices import gpu_generation
from trainsim.config.schema import HardwareConfig
from trainsim.what_if import is_identity, scale_comm_values

RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collectives whose "ring" algorithm is the loop-by-loop ring family; the others stream chunks."""
# set: memory accesses per byte by the operation's definition (a reduction reads two, writes one)
LOCAL_ACCESSES = {"all_reduce": 3, "reduce_scatter": 3, "reduce": 3,
                  "all_gather": 1, "all_to_all": 1, "broadcast": 1, "send_recv": 1}
"""Memory accesses per byte of a collective's local work: a reduction's two reads and one write, a copy's write
of what arrived (module doc). The prior delta is this over the memory bandwidth; a collective priced with
another's fit scales the donor's delta by their ratio."""
# cite: data/nccl-tests/h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt, as derived below
NVLS_EFFICIENCY = 0.63
"""Rate of NVLS all-reduce per NVLink byte, relative to the NVLink rate a ring reaches. NVLS moves S per GPU each
way and the switch reduces (no local work); 8x H200, 8 GiB, NVLS is 1.14 / 1.19 / 1.26 / 1.29 x the ring at
5 / 6 / 7 / 8 GPUs (data/nccl-tests/h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt), which with this
model's ring (2(K-1)/K S over NVLink at 0.94 x 450 GB/s plus the local work at 4.8 TB/s) gives 0.61-0.64."""
# cite: NCCL tuning.cc hwLatencies[NVLINK][NVLS][Simple] (2.21 on)
NVLS_LATENCY_S = 25e-6
"""NCCL's hwLatencies[NVLINK][NVLS][Simple] (2.21 on; 23 us in 2.19-2.20): the multicast round trip."""
FIT_FILE = "fit.json"


def chunk_bytes(protocol: str, simple_buffer_bytes: int, ring: bool) -> float:
    """Payload bytes of one chunk (NCCL buffer / NCCL_STEPS * chunk steps * payload fraction)."""
    c = nccl_constants()
    buffer = simple_buffer_bytes if protocol == "Simple" else c["buffer_bytes"][protocol]
    steps = c["chunk_steps" if ring else "pipeline_chunk_steps"][protocol]
    return buffer / c["steps"] * steps * c["payload_fraction"][protocol]


@dataclass(frozen=True)
class Fabric:
    """What the configured cluster's network adds to the fitted per-hop parameters (comm/network.py).

    Always the configured hardware's, whatever a stored fit says (CommModel.params sets it)."""

    devices_per_node: int = 0
    """Devices sharing a node's (NVLink domain's) network bandwidth, the NIC share above; 0: no sharing."""
    nodes_per_leaf: int = 0
    """Nodes under one leaf switch; a group over more crosses the spine (0: never)."""
    oversubscription: float = 1.0
    """Leaf-to-spine oversubscription: groups crossing the spine get 1/this of the node bandwidth."""
    tuner: str = "model"
    """Who picks (algorithm, protocol) across nodes: 'model' (the fastest by this model, as a tuner plugin
    driven by measurements does, e.g. aws-ofi-nccl's) or 'nccl' (NCCL's own cost model, nccl_tuner.py)."""
    nccl_version: str = ""
    node_bandwidth_bytes_per_s: float = 0.0
    """Nominal network bandwidth per node: the bus bandwidth NCCL's own estimate works with."""
    nics_per_node: int = 0
    nic_bandwidth_bytes_per_s: float = 0.0
    nvlink_bandwidth_bytes_per_s: float = 0.0
    gpu_generation: str = ""
    """NICs, NVLink and GPU generation: what NCCL's topology search hands its estimate (nccl_tuner.TunerTopology)."""
    gpu_nics: float = 0.0
    """NICs per GPU (a host's NICs over its GPUs; 0: not stated)."""
    p2p_channel_bytes_per_s: float = 0.0
    """What one NCCL p2p channel drives across nodes (p2p_peer_channels); 0: no such limit (gloo)."""


@dataclass
class CollectiveParams:
    """Fitted (or prior) parameters of one collective on one hardware; `values` in seconds and bytes/s.

    values keys: 'alpha.<algorithm>' (launch and setup, s), 'delta' (local buffer work, s per byte),
    'latency.<hop>.<protocol>' (per step, s), 'bandwidth.<hop>.<protocol>' (per channel, bytes/s).
    """

    collective: str
    algorithms: tuple[str, ...]
    protocols: tuple[str, ...]
    channels: int
    simple_buffer_bytes: int
    values: dict[str, float] = field(default_factory=dict)
    fabric: Fabric = field(default_factory=Fabric)

    def as_dict(self) -> dict:
        return {"collective": self.collective, "algorithms": list(self.algorithms),
                "protocols": list(self.protocols), "channels": self.channels,
                "simple_buffer_bytes": self.simple_buffer_bytes, "values": dict(self.values),
                "fabric": dataclasses.asdict(self.fabric)}

    @classmethod
    def from_dict(cls, data: dict) -> CollectiveParams:
        fabric = Fabric(**data["fabric"]) if "fabric" in data else Fabric(int(data.get("devices_per_node", 0)))
        return cls(data["collective"], tuple(data["algorithms"]), tuple(data["protocols"]), int(data["channels"]),
                   int(data["simple_buffer_bytes"]), {k: float(v) for k, v in data["values"].items()}, fabric)

    def nic_share(self, num_ranks: int, num_nodes: int) -> float:
        """Share of the node's inter-node bandwidth a group with num_ranks / num_nodes ranks per node gets,
        over the spine's oversubscription when the group spans more nodes than one leaf switch holds.
        A send/recv crosses a node boundary from one GPU, through that GPU's NIC, however many ranks the group
        has on the node (nccl-tests' sendrecv_perf: each rank sends to the next, so one pair per boundary
        crosses the network and bounds the step; pipeline stages: each GPU sends to its own peer)."""
        f = self.fabric
        per_node = 1 if self.collective == "send_recv" else num_ranks / num_nodes
        share = min(1.0, per_node / f.devices_per_node) if f.devices_per_node else 1.0
        if f.nodes_per_leaf and num_nodes > f.nodes_per_leaf:
            share /= f.oversubscription
        return share


def _channels_used(size: np.ndarray, protocol: str, channels: int, num_ranks: int, ring: bool) -> np.ndarray:
    c = nccl_constants()
    threshold = c["thread_threshold_bytes"][protocol] * (num_ranks if protocol == "LL" and ring else 1)
    per_channel = c["max_threads"][protocol] * threshold
    return np.clip(np.floor(size / per_channel), 1, channels)


@functools.lru_cache(maxsize=4096)
def _chunking(size_bytes: bytes, shape: tuple[int, ...], protocol: str, channels: int, simple_buffer_bytes: int,
              num_ranks: int, num_nodes: int, ring: bool, tree: bool) -> tuple[np.ndarray, np.ndarray]:
    """(channels used, chunk bytes) per size: NCCL's choices, which no fitted value changes (cached, since a fit
    asks for the same sizes thousands of times)."""
    size = np.frombuffer(size_bytes).reshape(shape)
    used = _channels_used(size, protocol, channels, num_ranks, ring)
    chunk = chunk_bytes(protocol, simple_buffer_bytes, ring)
    chunk = (_tree_ll128_chunk(size, used, chunk, num_ranks, num_nodes) if tree and protocol == "LL128"
             else np.full(size.shape, chunk))
    used.setflags(write=False)
    chunk.setflags(write=False)
    return used, chunk


def _step(values: dict[str, float], hop: str, protocol: str, chunk: np.ndarray, share: float = 1.0) -> np.ndarray:
    return values[f"latency.{hop}.{protocol}"] + chunk / (share * values[f"bandwidth.{hop}.{protocol}"])


def _tree_ll128_chunk(size: np.ndarray, channels: np.ndarray, chunk: float, num_ranks: int, num_nodes: int
                      ) -> np.ndarray:
    """NCCL's smaller LL128 tree chunks for messages too short to fill the tree's pipeline (enqueue.cc:
    halve while size / (channels x chunk) < steps x 64 / ppn down to 128 KiB, then x 16 down to 32 KiB,
    steps = 1 + log2(nodes) + 0.1 ppn)."""
    ppn = num_ranks / num_nodes
    steps = 1 + math.floor(math.log2(num_nodes)) + 0.1 * ppn
    out = np.full(size.shape, float(chunk))
    for factor, floor in ((64, 131072), (16, 32768)):
        for _ in range(8):
            shrink = (np.floor(size / (channels * out)) < steps * factor / ppn) & (out > floor)
            if not shrink.any():
                break
            out[shrink] /= 2
    return out


def all_to_all_nic_load(collective: str, num_ranks: int, num_nodes: int) -> float:
    """Network bytes of an all-to-all relative to a ring's of the same size: a ring crosses each node boundary
    once per step, (N-1)/N S per rank through the node's NICs; in an all-to-all each of a node's K ranks sends
    (N-K)/N S to the other nodes, K (N-K)/N S per node: K (N-K) / (N-1) times the ring's (4.3 on 2 x 8 GPUs,
    where nccl-tests' all-to-all busbw is 37.8 GB/s against the all-gather's 177, data/nccl-tests mscclpp
    summary). 1 for every other collective."""
    if collective != "all_to_all" or num_nodes <= 1:
        return 1.0
    per_node = num_ranks / num_nodes
    return per_node * (num_ranks - per_node) / (num_ranks - 1)


def tree_nic_load(num_nodes: int) -> float:
    """Bytes each node sends (and receives) per byte of an all-reduce on NCCL's double binary tree."""
    return 1.0 if num_nodes <= 2 else 1.5 if num_nodes == 3 else 2.0


def _stages(collective: str, algorithm: str, num_ranks: int, num_nodes: int) -> tuple[int, int]:
    """(intra-node, inter-node) stage count of a pipeline-family collective."""
    if collective == "send_recv":
        return (0, 1) if num_nodes > 1 else (1, 0)
    if algorithm == "nvls":  # reduce through the switch, multicast back; across domains NVLSTree: a tree between
        return 2, 2 * math.ceil(math.log2(num_nodes)) if num_nodes > 1 else 0
    if algorithm == "tree":
        per_node = num_ranks // num_nodes
        return 2 * (per_node - 1), 2 * math.ceil(math.log2(num_nodes)) if num_nodes > 1 else 0
    return num_ranks - num_nodes, num_nodes - 1  # broadcast / reduce chain


def algorithm_protocol_seconds(params: CollectiveParams, algorithm: str, protocol: str, size: np.ndarray,
                               num_ranks: int, num_nodes: int) -> np.ndarray:
    """Execution time (s) of the collective with one algorithm and protocol, for an array of sizes."""
    v, name = params.values, params.collective
    size = np.asarray(size, dtype=float)
    ring = algorithm == "ring" and name in RING_COLLECTIVES
    used, chunk = _chunking(size.tobytes(), size.shape, protocol, params.channels, params.simple_buffer_bytes,
                            num_ranks, num_nodes, ring, algorithm == "tree")
    share = params.nic_share(num_ranks, num_nodes)
    if num_ranks == 1:
        return np.full_like(size, v[f"alpha.{algorithm}"])
    if algorithm == "nvls":  # a GPU's NVLink carries S each way, at NVLS's rate per byte
        v = {**v, "bandwidth.intra.Simple": v["bandwidth.intra.Simple"] * NVLS_EFFICIENCY}
    if algorithm == "p2p":
        transfer = _all_to_all_p2p_seconds(v, params.protocols, params.channels, share, size, num_ranks, num_nodes)
    elif ring:
        steps = 2 * (num_ranks - 1) if name == "all_reduce" else num_ranks - 1
        loops = np.maximum(1.0, np.ceil(size / (num_ranks * used * chunk)))
        per_step = size / (num_ranks * used * loops)
        local = v["delta"] * size
        if num_nodes > 1:  # latency along the ring's hops; NVLink, local work and NIC pipelined: the slowest paces
            inter_steps = (2 if name == "all_reduce" else 1) * (num_nodes - 1)
            latency = ((steps - inter_steps) * v[f"latency.intra.{protocol}"]
                       + inter_steps * v[f"latency.inter.{protocol}"])
            moved = loops * steps * per_step
            nic = moved / (share * v[f"bandwidth.inter.{protocol}"]) * all_to_all_nic_load(name, num_ranks, num_nodes)
            transfer = (loops * latency + inter_steps * v.get("latency.network", 0.0)
                        + np.maximum.reduce([moved / v[f"bandwidth.intra.{protocol}"], local, nic]))
        else:
            transfer = loops * steps * _step(v, "intra", protocol, per_step) + local
    else:
        intra, inter = _stages(name, algorithm, num_ranks, num_nodes)
        loops = np.maximum(1.0, np.ceil(size / (used * chunk)))
        per_step = size / (used * loops)
        if name == "send_recv" and inter and params.fabric.p2p_channel_bytes_per_s:  # the peer's channels bound it
            peer_rate = p2p_peer_channels(params.fabric, num_ranks) * params.fabric.p2p_channel_bytes_per_s
            share = np.minimum(share, peer_rate / (used * v[f"bandwidth.inter.{protocol}"]))
        load = tree_nic_load(num_nodes) if algorithm in ("tree", "nvls") else 1.0
        costs = {hop: (n, _step(v, hop, protocol, per_step * (load if hop == "inter" else 1.0),
                                share if hop == "inter" else 1.0))
                 for n, hop in ((intra, "intra"), (inter, "inter")) if n}
        fill = sum(n * cost for n, cost in costs.values()) + inter * v.get("latency.network", 0.0)
        streaming = {hop: (loops - 1) * cost for hop, (_, cost) in costs.items()}
        if algorithm == "tree" and "intra" in streaming:  # a chain GPU sends up and down through one switch port
            streaming["intra"] = streaming["intra"] * 2
        local = np.zeros_like(size) if algorithm == "nvls" else v["delta"] * size  # NVLS reduces in the switch
        if "inter" in streaming:  # across nodes NVLink steps, local work and the NIC are pipelined slice by slice
            intra_part = streaming.get("intra", np.zeros_like(size))
            transfer = fill + np.maximum.reduce([intra_part, local, streaming["inter"]])
        else:  # inside a node the same SMs move and reduce: their times add (busbw rising with N, module doc)
            transfer = fill + streaming.get("intra", 0.0) + local
    return v[f"alpha.{algorithm}"] + transfer


def _all_to_all_p2p_seconds(v: dict[str, float], protocols: tuple[str, ...], channels: int, share: float,
                            size: np.ndarray, num_ranks: int, num_nodes: int) -> np.ndarray:
    """NCCL's all-to-all after launch (module doc): every peer's send and receive in flight at once."""
    per_node = num_ranks // num_nodes
    per_peer = size / num_ranks
    simple = "Simple" if "Simple" in protocols else protocols[-1]
    ll = per_peer <= nccl_constants()["p2p_ll_threshold_bytes"] if "LL" in protocols else np.zeros(size.shape, bool)

    def intra(kind: str) -> np.ndarray:  # LL's value for small messages, the other's for the rest
        return np.where(ll, v.get(f"{kind}.intra.LL", np.nan), v[f"{kind}.intra.{simple}"])

    latency_intra = intra("latency")
    nvlink = (per_node - 1) * per_peer / (channels * intra("bandwidth"))
    local = v["delta"] * size
    if num_nodes == 1:
        return latency_intra + nvlink + local
    network = v[f"latency.inter.{simple}"] + v.get("latency.network", 0.0) * p2p_network_rounds(num_ranks, per_node)
    latency = np.maximum(latency_intra, network) if per_node > 1 else network
    nic = per_node * (num_ranks - per_node) * per_peer / (share * channels * v[f"bandwidth.inter.{simple}"])
    return latency + np.maximum.reduce([nvlink, local, nic])


def p2p_peer_channels(f: Fabric, num_ranks: int) -> int:
    """Channels NCCL runs a send/recv to one peer on another node on, in a communicator of num_ranks
    (src/graph/paths.cc ncclTopoGetNchannels, ncclTopoComputeP2pChannels). Each channel drives about
    p2p_network.channel_gbps (one CTA copying through the proxy), so a peer gets at most that many times it,
    however fast its NIC: nccl-tests' sendrecv_perf on 8 x B200 nodes with a 400 Gb/s NIC per GPU runs at 43, 26
    and 14.6 GB/s at 2-4, 8 and 16-64 nodes (NCCL 2.29: 4, 2, 1 channels) and at 34 and 17 GB/s at 2-4 and 8-64
    nodes (NCCL 2.28: 2, 1). The communicator's p2p channels are its ring channels, one per NIC duplicated
    (connect.cc, at most MAXCHANNELS; 16, a DGX's 8 NICs, where the NICs are not stated), rounded up to a
    power of two; per peer:
      * before 2.20: NCCL_NCHANNELS_PER_NET_PEER, 2;
      * 2.20-2.28: 2, halved while 2 x nRanks exceeds 4 x the p2p channels, at least the GPU's NICs;
      * 2.29 on: one per GPU NIC or the NICs' GB/s over channel_gbps if more, halved while it times the
        batches of 8 peers (ceil(nRanks / 8)) exceeds the p2p channels."""
    c = nccl_constants()["p2p_network"]
    version = release_key(f.nccl_version) if f.nccl_version else (99,)
    most = [n for release, n in c["max_channels"].items() if release_key(release) <= version][-1]
    per_gpu = f.gpu_nics or 1.0
    nics = max(1, math.floor(per_gpu))
    total = _pow2_up(min(most, 2 * f.nics_per_node)) if f.nics_per_node else 16
    if version < (2, 20):
        return min(c["channels_per_peer"], total)
    if version < (2, 29):
        peer = c["channels_per_peer"]
        while peer * num_ranks > 4 * total and peer > 1:
            peer //= 2
        return min(_pow2_up(max(nics, peer)), total)
    gbps = per_gpu * f.nic_bandwidth_bytes_per_s / 1e9
    peer = _pow2_up(max(nics, math.ceil(gbps / c["channel_gbps"])))
    batches = math.ceil(num_ranks / nccl_constants()["p2p_peers_per_batch"])
    while peer * batches > total and peer > 1:
        peer //= 2
    return peer


def _pow2_up(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def p2p_network_rounds(num_ranks: int, per_node: int) -> int:
    """Batches of remote peers an all-to-all's rank works through: NCCL schedules a group's sends and receives in
    batches of NCCL_MAX_DEV_WORK_P2P_PER_BATCH peers, and each batch across nodes waits for the network's hop
    latency. On AWS p5 the time above the bytes grows by 20 us per 8 remote peers from 2 to 32 nodes; priced
    once per all-to-all, a 2-node fit predicts 32 nodes 26 % too fast (12.6 % with the batches,
    comm_mape_pct_node_scaling)."""
    return math.ceil((num_ranks - per_node) / nccl_constants()["p2p_peers_per_batch"])


def pair_seconds(params: CollectiveParams, pairs: list[tuple[str, str]], size: np.ndarray, num_ranks: int,
                 num_nodes: int) -> np.ndarray:
    """Modelled times of each candidate pair (pairs x sizes)."""
    return np.array([algorithm_protocol_seconds(params, a, p, size, num_ranks, num_nodes) for a, p in pairs])


def pair_parameters(params: CollectiveParams, algorithm: str, protocol: str) -> frozenset[str]:
    """The values algorithm_protocol_seconds reads for one pair: its algorithm's alpha, the network's, delta and
    its protocol's latencies and bandwidths (an all-to-all's LL ones too, for its small messages). A fit moving
    one other value leaves the pair's time as it was (tests/comm/test_comm_model.py checks this on four configs)."""
    protocols = {protocol, "LL"} if algorithm == "p2p" else {protocol}
    return frozenset(k for k in params.values
                     if k in ("delta", "latency.network", f"alpha.{algorithm}")
                     or (k.startswith(("latency.", "bandwidth.")) and k.rsplit(".", 1)[1] in protocols))


def tuner_choice(params: CollectiveParams, pairs: list[tuple[str, str]], size: np.ndarray, num_ranks: int,
                 num_nodes: int) -> np.ndarray | None:
    """Index of the pair NCCL's own estimate runs per size, across nodes with fabric.tuner 'nccl' (it does not
    depend on the fitted values); None where the model's fastest pair runs."""
    f = params.fabric
    if f.tuner != "nccl" or num_nodes <= 1 or f.node_bandwidth_bytes_per_s <= 0 or len(pairs) <= 1:
        return None
    topology = tuner_topology(f.nics_per_node, f.nic_bandwidth_bytes_per_s, f.nvlink_bandwidth_bytes_per_s,
                              f.gpu_generation)
    estimates = tuner_estimates(f.nccl_version, params.collective, pairs, size, num_ranks, num_nodes,
                                f.node_bandwidth_bytes_per_s, topology)
    return np.argmin(estimates, axis=0)


def run_pairs(times: np.ndarray, tuner_index: np.ndarray | None) -> np.ndarray:
    """Index of the pair run per size: NCCL's estimate's choice where it decides (tuner_choice), else the
    fastest by the model."""
    return np.argmin(times, axis=0) if tuner_index is None else tuner_index


def _pair_times(params: CollectiveParams, size, num_ranks: int, num_nodes: int
                ) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Candidate pairs, their modelled times (pairs x sizes) and the index of the pair run per size."""
    pairs = candidate_pairs(params, num_nodes)
    size = np.atleast_1d(np.asarray(size, dtype=float))
    times = pair_seconds(params, pairs, size, num_ranks, num_nodes)
    return pairs, times, run_pairs(times, tuner_choice(params, pairs, size, num_ranks, num_nodes))


def predict_seconds(params: CollectiveParams, size, num_ranks: int, num_nodes: int) -> np.ndarray:
    """Time of the (algorithm, protocol) the tuner runs per size: the fastest allowed one by this model, or
    across nodes with fabric.tuner 'nccl' the one NCCL's own estimate prefers."""
    _, times, chosen = _pair_times(params, size, num_ranks, num_nodes)
    return times[chosen, np.arange(times.shape[1])]


def candidate_pairs(params: CollectiveParams, num_nodes: int) -> list[tuple[str, str]]:
    """Allowed (algorithm, protocol) pairs. Tree only across nodes: within one node NCCL's tree is a
    chain whose per-channel bandwidth cap (perChMaxTreeBw) keeps its tuner on rings. NVLS (NVLSTree across
    NVLink domains) with the Simple protocol only; NCCL's own estimate has no formula for it here. NCCL's
    all-to-all picks its protocol per message and hop, not by a tuner: one pair, labelled Simple."""
    def allowed(a: str) -> bool:
        return a != "tree" or num_nodes > 1

    algorithms = [a for a in params.algorithms if allowed(a)] or ["ring"]
    if "p2p" in algorithms:
        return [("p2p", "Simple")]
    return [(a, p) for a in algorithms for p in params.protocols if a != "nvls" or p == "Simple"]


def choose(params: CollectiveParams, size: int, num_ranks: int, num_nodes: int) -> tuple[str, str]:
    """The (algorithm, protocol) the model predicts for one message."""
    pairs, _, chosen = _pair_times(params, np.array([size]), num_ranks, num_nodes)
    return pairs[int(chosen[0])]


def prior_params(hw: HardwareConfig, collective: str, channels: int | None = None,
                 network_priors: dict | None = None, nvlink_efficiency: float | None = None) -> CollectiveParams:
    """Datasheet and NCCL-constant starting values (also the model of a hardware never calibrated).

    Per-step latencies are NCCL's hwLatencies (ring row; NVLINK intra-node on GPUs, PCI elsewhere, NET
    inter-node), scaled per hop so that Simple's equals the configured hop latency where one is set (a
    slower link slows every protocol's step alike); launch latency is NCCL's baseLatencies; per-channel
    bandwidth is the link's datasheet rate split over the channels times the protocol's payload
    fraction; local buffer work (delta) is LOCAL_ACCESSES at memory bandwidth. The network hop takes
    the learned prior of `network_priors` (network_priors.yaml's levels; default that file), NVLink the
    learned `nvlink_efficiency` (default NVLINK_EFFICIENCY): a held-out figure passes priors learned
    without its held-out data (network_fit.priors_without, nvlink_fit.nvlink_efficiency).
    """
    nccl = hw.nccl
    constants = release_constants(nccl.version)
    allowed = ALGORITHMS[collective]
    algorithms = tuple(a for a in nccl.algorithms if a in allowed and (a != "nvls" or hw.network.nvls)) or allowed[:1]
    if collective == "all_to_all":
        algorithms = ("p2p",) if hw.comm_backend == "nccl" else ("ring",)
    protocols = tuple(p for p in nccl.protocols if p in PROTOCOLS) or ("Simple",)
    channels = channels or nccl.max_channels or 16
    cuda = hw.device_kind == "cuda"
    intra_kind = "NVLINK" if cuda else "PCI"
    prior = network_prior(hw, network_priors)
    nvlink = NVLINK_EFFICIENCY if nvlink_efficiency is None else nvlink_efficiency
    link_bandwidth = {"intra": (hw.intra_node_bandwidth_bytes_per_s or 5e9) * (nvlink if cuda else 1.0)}
    values = {"delta": LOCAL_ACCESSES[collective] / (hw.memory_bandwidth_bytes_per_s or 2e10)}
    for algorithm in algorithms:
        base = constants["base_latency_us"].get(algorithm, constants["base_latency_us"]["ring"])
        nvls = NVLS_LATENCY_S if algorithm == "nvls" else 0.0
        values[f"alpha.{algorithm}"] = max(max(base.values()), 5.0) * 1e-6 + nvls
    link_latency = {"intra": hw.intra_node_latency_s, "inter": hw.inter_node_latency_s}
    for hop, kind in (("intra", intra_kind), ("inter", "NET")):
        table = constants["hw_latency_us"][kind]["ring"]
        scale = link_latency[hop] / (table["Simple"] * 1e-6) if link_latency[hop] else 1.0
        for p in protocols:
            values[f"latency.{hop}.{p}"] = table[p] * 1e-6 * scale
            if hop == "intra":
                payload = nccl_constants()["payload_fraction"][p]
                values[f"bandwidth.intra.{p}"] = link_bandwidth["intra"] / channels * payload
    params = CollectiveParams(collective, algorithms, protocols, channels, nccl.buffer_size_bytes, values, fabric(hw))
    efficiency, hop_latency_s = (prior.bandwidth_efficiency, prior.hop_latency_s) if prior else (1.0, 0.0)
    return with_network_hop(params, hw, efficiency, hop_latency_s)


def with_network_hop(params: CollectiveParams, hw: HardwareConfig, efficiency: float, hop_latency_s: float
                     ) -> CollectiveParams:
    """params with the network hop's bandwidth at `efficiency` x hw's nominal bandwidth per NVLink domain
    (split over the channels, times each protocol's payload fraction) and the network's own latency per hop
    at hop_latency_s (0: none)."""
    nominal = domain_bandwidth(hw) or 5e9
    values = {k: v for k, v in params.values.items() if k != "latency.network"}
    for p in params.protocols:
        payload = nccl_constants()["payload_fraction"][p]
        values[f"bandwidth.inter.{p}"] = efficiency * nominal / params.channels * payload
    if hop_latency_s > 0:
        values["latency.network"] = hop_latency_s
    return dataclasses.replace(params, values=values)


def fabric(hw: HardwareConfig) -> Fabric:
    """The configured network's Fabric (NIC sharing per NVLink domain, spine, tuner)."""
    net = hw.network
    p2p_channel = nccl_constants()["p2p_network"]["channel_gbps"] * 1e9 if hw.comm_backend == "nccl" else 0.0
    gpu_nics = net.nics_per_node / hw.devices_per_node if hw.devices_per_node else 0.0
    return Fabric(domain_size(hw), net.nodes_per_leaf, net.oversubscription, tuner(hw), hw.nccl.version,
                  domain_bandwidth(hw), net.nics_per_node, net.nic_bandwidth_bytes_per_s,
                  hw.intra_node_bandwidth_bytes_per_s, gpu_generation(hw.device_name), gpu_nics, p2p_channel)


class CommModel:
    """Communication time for the composer: one CollectiveParams per calibrated collective.

    A collective without measurements borrows the link parameters (latency, bandwidth, alpha, delta)
    of a calibrated one (the all-reduce; for an all-to-all the all-gather first, which moves the same bytes
    without reducing), since they describe the same links, and keeps its own structure (steps, chunking);
    with nothing calibrated the priors of `prior_params` are used.
    """

    def __init__(self, hardware: HardwareConfig, fits: dict[str, CollectiveParams], source: str,
                 noise: SystemNoise | None = None, network_priors: dict | None = None):
        self.hardware = hardware
        self.fits = fits
        self.noise = noise
        """Measured system noise (noise.py); None: ranks arrive together."""
        self.network_priors = network_priors
        """Network priors of uncalibrated collectives (prior_params); None: network_priors.yaml."""
        self.source = (source + ("" if is_identity(hardware.what_if) else f"; what-if {hardware.what_if}")
                       + (f"; system noise sigma(T) = {noise.scale:.3g} T^{noise.exponent:.2f}" if noise else ""))
        self._scaled: dict[str, CollectiveParams] = {}

    @classmethod
    def from_hardware(cls, hw: HardwareConfig, network_priors: dict | None = None) -> CommModel:
        return cls(hw, {}, source="uncalibrated: datasheet rates and NCCL constants", network_priors=network_priors)

    @classmethod
    def load(cls, calibration_dir: Path, hw: HardwareConfig) -> CommModel:
        path = Path(calibration_dir) / FIT_FILE
        data = json.loads(path.read_text())
        fits = {name: CollectiveParams.from_dict(entry["params"]) for name, entry in data["collectives"].items()}
        noise = SystemNoise.from_dict(data["system_noise"]["model"]) if "system_noise" in data else None
        source = f"calibrated: {path}" if fits else f"uncalibrated ({path} holds no measurements): datasheet rates " \
                                                   "and NCCL constants"
        return cls(hw, fits, source=source, noise=noise)

    def params(self, collective: str) -> CollectiveParams:
        """The parameters used for `collective`, with hardware.what_if applied."""
        if collective not in self._scaled:
            # the NIC share is the configured node's, whatever a stored fit says
            params = dataclasses.replace(self._params(collective), fabric=fabric(self.hardware))
            what_if = self.hardware.what_if
            if not is_identity(what_if):
                params = dataclasses.replace(params, values=scale_comm_values(params.values, what_if))
            self._scaled[collective] = params
        return self._scaled[collective]

    def _params(self, collective: str) -> CollectiveParams:
        if collective in self.fits:
            return self.fits[collective]
        prior = prior_params(self.hardware, collective, network_priors=self.network_priors)
        closest = ("all_gather", "all_reduce") if collective == "all_to_all" else ("all_reduce",)  # same bytes moved
        donor = next((self.fits[c] for c in closest if c in self.fits), next(iter(self.fits.values()), None))
        if donor is not None:
            borrowed = {k: v for k, v in donor.values.items() if not k.startswith("alpha.")}
            borrowed["delta"] *= LOCAL_ACCESSES[collective] / LOCAL_ACCESSES[donor.collective]
            borrowed.update({f"alpha.{a}": donor.values.get(f"alpha.{a}", donor.values[f"alpha.{donor.algorithms[0]}"])
                             for a in prior.algorithms})
            prior = CollectiveParams(collective, prior.algorithms, donor.protocols, donor.channels,
                                     donor.simple_buffer_bytes, {**prior.values, **borrowed}, prior.fabric)
        return prior

    def collective_seconds(self, collective: str, message_bytes: int, num_ranks: int, num_nodes: int) -> float:
        """Execution time of one collective (synchronisation is the composer's job)."""
        if collective == "barrier":
            collective, message_bytes = "all_reduce", 4
        if collective not in ALGORITHMS:
            known = ", ".join([*ALGORITHMS, "barrier"])
            raise ValueError(f"unknown collective {collective!r}; expected one of {known}")
        if num_ranks < 1 or num_nodes < 1 or num_ranks % num_nodes:
            raise ValueError(f"num_ranks={num_ranks} must be a positive multiple of num_nodes={num_nodes}")
        return float(predict_seconds(self.params(collective), np.array([message_bytes]), num_ranks, num_nodes)[0])

    def p2p_seconds(self, message_bytes: int, same_node: bool) -> float:
        """One send/recv pair (pipeline-parallel activations)."""
        return float(predict_seconds(self.params("send_recv"), np.array([message_bytes]), 2, 1 if same_node else 2)[0])

    def sync_wait_s(self, segment_s: float, num_ranks: int) -> float:
        """Expected wait at a blocking collective of identical ranks after `segment_s` of compute each."""
        return self.noise.sync_wait_s(segment_s, num_ranks) if self.noise else 0.0
