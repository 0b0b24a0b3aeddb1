"""Per-class programs: the kernels of each pass, their edges, and their durations as timeline nodes.

A pass is what `trainsim.trace.expand.expand_step` repeats: the forward or backward of one chunk
for one micro-batch (backward in two variants, with and without the once-per-step DP sync), and the
optimizer. Each pass becomes a template of nodes, built once per rank class and reused for every
micro-batch (DistSim's "identical operators are one event").

Runs of consecutive kernels that must execute one after the other anyway (compute, and collectives
among ranks of the same class that compute waits for, e.g. tensor-parallel all-reduces) are collapsed
into one node whose duration is their sum. The collapse is exact: a run never swallows an op that
something outside it waits for, nor one that waits for anything but its predecessor in the run
(checked from the edges, so custom rules are respected); `collapse=False` keeps one node per kernel.
With host dispatch modelled the collapse is exact up to the spread of kernel lengths in a run (a run's
last kernel counts as of average length, engine.HostIssue): 1e-5 of the step on gpt-tiny.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainsim.parallel.phases import direction_of, pass_of
from trainsim.timeline.contention import bandwidth_part
from trainsim.timeline.plugins import blocking_hint, dependency_rule

# set: codes
COMPUTE, BLOCK, COLLECTIVE, SEND, RECV, MEMCPY = range(6)
KIND_NAMES = ("compute", "block", "collective", "send", "recv", "memcpy")
PASS_VARIANTS = ("all", "per_microbatch")


def kernel_graph(events: pd.DataFrame) -> pd.DataFrame:
    """Kernels of one class in program order; dependencies through views and allocations are followed
    to the kernels that wrote the storage (no-kernel ops take no device time and are dropped; the host
    still dispatches them, so each kernel's `host_ops` counts itself and the no-kernel ops before it)."""
    events = events.sort_values("id")
    no_kernel_seen = np.cumsum(events["no_kernel"].to_numpy(dtype=bool))
    through: dict[int, set[int]] = {}
    new_deps = []
    for op_id, no_kernel, deps in zip(events["id"].to_numpy(), events["no_kernel"].to_numpy(),
                                      events["deps"].to_numpy()):
        resolved: set[int] = set()
        for d in (() if deps is None else deps):
            d = int(d)
            resolved.update(through.get(d, (d,)))
        if no_kernel:
            through[int(op_id)] = resolved
        new_deps.append(sorted(resolved))
    out = events.assign(deps=new_deps)
    kernels = ~out["no_kernel"].to_numpy()
    before = no_kernel_seen[kernels]
    host_ops = 1 + np.diff(np.concatenate([[0], before]))
    return out[kernels].assign(host_ops=host_ops).reset_index(drop=True)


@dataclass
class PassOps:
    """The kernels of one pass variant, with the edges the dependency rules give them."""

    phase: str
    chunk: int
    variant: str
    ops: pd.DataFrame
    edges: np.ndarray
    """(k, 2) positions (earlier, later) inside `ops`."""
    external: list[tuple[int, int]] = field(default_factory=list)
    """(position, trace id) of dependencies on non-compute kernels of other passes."""


def pass_ops(kernels: pd.DataFrame, rules: tuple[str, ...]) -> list[PassOps]:
    """Split a class's kernels into pass variants (forward and backward per chunk, with and without
    once-per-step ops; optimizer), as expand_step repeats them, and apply the rules."""
    kind_of = dict(zip(kernels["id"].to_numpy().tolist(), kernels["kind"].to_list()))
    out = []
    for (phase, chunk), ops in kernels.groupby([kernels["phase"].map(pass_of), "chunk"], sort=False):
        variants = [("all", ops)]
        if phase != "optimizer" and not ops["per_microbatch"].all():
            variants.append(("per_microbatch", ops[ops["per_microbatch"].to_numpy()]))
        for variant, sub in variants:
            out.append(_with_edges(str(phase), int(chunk), variant, sub.reset_index(drop=True), kind_of, rules))
    return out


def _with_edges(phase: str, chunk: int, variant: str, ops: pd.DataFrame, kind_of: dict[int, str],
                rules: tuple[str, ...]) -> PassOps:
    position = {int(i): p for p, i in enumerate(ops["id"].to_numpy())}
    local, external = [], []
    for p, deps in enumerate(ops["deps"].to_list()):
        local.append([position[d] for d in deps if d in position])
        external += [(p, d) for d in deps if d not in position and kind_of.get(d, "compute") != "compute"]
    ops = ops.assign(local_deps=local, direction=ops["phase"].map(direction_of))  # (a combined pass has both)
    ops["blocking_hint"] = blocking_hint(ops)
    edges = [np.asarray(dependency_rule(name)(ops), dtype=np.int64).reshape(-1, 2) for name in rules]
    edges = np.unique(np.concatenate(edges), axis=0) if edges else np.zeros((0, 2), dtype=np.int64)
    if len(edges) and np.any(edges[:, 0] >= edges[:, 1]):
        raise ValueError(f"a dependency rule gave an edge that goes backwards in program order in the {phase} "
                         f"pass of chunk {chunk}; edges must be (earlier op, later op)")
    return PassOps(phase, chunk, variant, ops, edges, external)


@dataclass
class OpCosts:
    """Per kernel of a pass, for one rank class: what it costs and how it synchronises."""

    kind: np.ndarray          # COMPUTE / COLLECTIVE / SEND / RECV / MEMCPY
    compute_s: np.ndarray     # solo compute time (straggler factor applied); 0 for communication
    fixed_s: np.ndarray       # communication time once every member has arrived (internal: + noise wait)
    internal: np.ndarray      # collective whose members are all in this class (symmetric: only noise waits)
    sync_key: list            # cross-class matching key, None when internal / compute
    nic_s: np.ndarray         # bandwidth-bound part of communication that leaves the node (contention.py); else 0


def _runs(kind: np.ndarray, internal: np.ndarray, edges: np.ndarray, external: set[int]) -> np.ndarray:
    """Node id per op: maximal runs of serial ops share one id (see the module docstring)."""
    n = len(kind)
    is_compute = kind == COMPUTE
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges.tolist():
        preds[v].append(u)
        succs[u].append(v)
    # a collective among this class's ranks joins a run only if the op after it waits for it (a blocking call)
    hands_over = np.asarray([i + 1 in succs[i] for i in range(n)], dtype=bool)
    joinable = is_compute | ((kind == COLLECTIVE) & internal & hands_over)
    end_after = np.zeros(n, dtype=bool)
    while True:
        node = np.empty(n, dtype=np.int64)
        current, run_start = -1, True
        for i in range(n):
            start_new = run_start or not joinable[i] or i in external
            if not start_new:
                start_new = any(node[u] != current and not is_compute[u] for u in preds[i])
                if not is_compute[i]:  # a collective joins only if the run's last op hands over to it
                    start_new = start_new or (i - 1) not in preds[i]
                elif not is_compute[i - 1]:  # compute after a collective: it must wait for it
                    start_new = start_new or (i - 1) not in preds[i]
            if start_new:
                current += 1
            node[i] = current
            run_start = not joinable[i] or end_after[i]
        last_of_node = np.zeros(current + 1, dtype=np.int64)
        last_of_node[node] = np.arange(n)
        bad = [u for u in range(n) if last_of_node[node[u]] != u and joinable[u]
               and any(node[v] != node[u] and not is_compute[v] for v in succs[u])]
        if not bad:
            return node
        end_after[bad] = True


@dataclass
class PassNodes:
    """Nodes of one pass variant for one rank class (arrays of equal length, plus edges)."""

    phase: str
    chunk: int
    variant: str
    kind: np.ndarray
    compute_s: np.ndarray
    fixed_s: np.ndarray
    first_op: np.ndarray
    last_op: np.ndarray
    sync_key: list
    edges: np.ndarray
    node_of_op: np.ndarray
    op_ids: np.ndarray
    host_ops: np.ndarray
    """Ops the host dispatches for each node (its kernels and the no-kernel ops among them)."""
    external: list[tuple[int, int]]
    """(node, trace id of a non-compute kernel of another pass it waits for)."""
    per_microbatch_op: np.ndarray
    nic_s: np.ndarray
    """Bandwidth-bound seconds of the node's inter-node communication (sum over its ops; contention.py)."""
    direction: np.ndarray
    """'forward' or 'backward' (or 'optimizer') per node: which half of a combined pass it belongs to."""


def pass_nodes(p: PassOps, costs: OpCosts, collapse: bool, node: np.ndarray | None = None) -> PassNodes:
    """Nodes of a pass; `node` (op -> node) may come from an identical pass of another class."""
    n = len(p.ops)
    if node is not None:
        pass
    elif collapse:
        node = _runs(costs.kind, costs.internal, p.edges, {q for q, _ in p.external})
    else:
        node = np.arange(n)
    count = int(node.max()) + 1 if n else 0
    first = np.full(count, n, dtype=np.int64)
    np.minimum.at(first, node, np.arange(n))
    last = np.zeros(count, dtype=np.int64)
    np.maximum.at(last, node, np.arange(n))
    size = last - first + 1
    kind = np.where(size > 1, BLOCK, costs.kind[first])
    compute_s = np.bincount(node, weights=costs.compute_s, minlength=count)
    fixed_s = np.bincount(node, weights=costs.fixed_s, minlength=count)
    nic_s = np.bincount(node, weights=costs.nic_s, minlength=count)
    e = node[p.edges] if len(p.edges) else np.zeros((0, 2), dtype=np.int64)
    comp = (kind == COMPUTE) | (kind == BLOCK)
    keep = (e[:, 0] != e[:, 1]) & ~(comp[e[:, 0]] & comp[e[:, 1]]) if len(e) else np.zeros(0, dtype=bool)
    edges = np.unique(e[keep], axis=0) if keep.any() else np.zeros((0, 2), dtype=np.int64)
    host_ops = np.bincount(node, weights=p.ops["host_ops"].to_numpy(dtype=float), minlength=count)
    return PassNodes(p.phase, p.chunk, p.variant, kind, compute_s, fixed_s, first, last,
                     [costs.sync_key[i] for i in first], edges, node, p.ops["id"].to_numpy(), host_ops,
                     [(int(node[q]), d) for q, d in p.external], p.ops["per_microbatch"].to_numpy(), nic_s,
                     p.ops["direction"].to_numpy()[first])


def op_costs(p: PassOps, class_id: int, class_of_rank: np.ndarray, representative: int, factor: float,
             domain_of_rank: np.ndarray, compute_seconds: Callable[[pd.DataFrame, np.ndarray], np.ndarray],
             comm_seconds: Callable[..., float], sync_wait: Callable[[float, int], float],
             groups: dict[tuple, tuple] | None = None) -> OpCosts:
    """Durations and synchronisation of a pass's kernels as run by `class_id` (groups already renamed).

    Members of an internal collective run the same program, so the replay has them arrive together;
    really the last one is late by the system noise of the compute since their previous
    synchronisation (`sync_wait`), which is added to the collective's time.
    Communication whose group spans nodes also gets its bandwidth-bound part (`nic_s`: its time minus
    that of a 1-byte message on the same ranks), which NIC contention stretches (contention.py).
    domain_of_rank: the NVLink domain (the collective model's node) of each global rank (comm/placement.py).
    groups: a cache of (member classes, nodes spanned) by group members, shared by the calls of one step."""
    ops = p.ops
    kind_col = ops["kind"].to_numpy()
    collective = ops["collective"].to_numpy()
    kind = np.select([kind_col == "collective", collective == "send", collective == "recv", kind_col == "memcpy"],
                     [COLLECTIVE, SEND, RECV, MEMCPY], COMPUTE)
    compute_s = np.zeros(len(ops))
    priced = (kind == COMPUTE) | (kind == MEMCPY)
    if priced.any():
        compute_s[priced] = compute_seconds(ops, priced) * factor
    fixed_s = np.zeros(len(ops))
    nic_s = np.zeros(len(ops))
    internal = np.zeros(len(ops), dtype=bool)
    sync_key: list = [None] * len(ops)
    node_of = domain_of_rank[representative]
    group_ranks, message = ops["group_ranks"].to_numpy(), ops["message_bytes"].to_numpy()
    group_kind, peers = ops["group_kind"].to_numpy(), ops["peer"].to_numpy()
    groups = {} if groups is None else groups
    for i in np.flatnonzero(kind == COLLECTIVE):
        members_key = tuple(group_ranks[i])
        if members_key not in groups:
            members = np.asarray(members_key, dtype=np.int64)
            groups[members_key] = (tuple(np.unique(class_of_rank[members]).tolist()),
                                   len(np.unique(domain_of_rank[members])))
        member_classes, nodes = groups[members_key]
        fixed_s[i] = comm_seconds(collective[i], int(message[i]), len(members_key), nodes)
        if nodes > 1:
            nic_s[i] = bandwidth_part(fixed_s[i], comm_seconds(collective[i], 1, len(members_key), nodes))
        internal[i] = member_classes == (class_id,)
        if not internal[i]:
            sync_key[i] = ("collective", group_kind[i], member_classes)
    direction = ops["direction"].to_numpy()  # (a combined pass sends both ways)
    for i in np.flatnonzero((kind == SEND) | (kind == RECV)):
        peer = int(peers[i])
        peer_class = int(class_of_rank[peer])
        same_node = domain_of_rank[peer] == node_of
        fixed_s[i] = comm_seconds("p2p", int(message[i]), 2, 1 if same_node else 2)
        if not same_node:
            nic_s[i] = bandwidth_part(fixed_s[i], comm_seconds("p2p", 1, 2, 2))
        src, dst = (class_id, peer_class) if kind[i] == SEND else (peer_class, class_id)
        sync_key[i] = ("p2p", src, dst, direction[i])
    communication = np.flatnonzero((kind == COLLECTIVE) | (kind == SEND) | (kind == RECV))
    compute_before = np.concatenate([[0.0], np.cumsum(compute_s)])
    previous = 0
    for i in communication.tolist():
        if internal[i]:
            fixed_s[i] += sync_wait(float(compute_before[i] - compute_before[previous]), len(group_ranks[i]))
        previous = i
    return OpCosts(kind, compute_s, fixed_s, internal, sync_key, nic_s)
