"""The whole step as one graph of nodes: every class's passes repeated along its pipeline schedule.

Expansion follows `trainsim.trace.expand.expand_step` (one forward and one backward per micro-batch and
chunk in the schedule's order; the DP sync only in each chunk's last backward; the optimizer once), but
over pass templates with numpy instead of over op rows, so 1,536 micro-batches cost what 16 do
(a test checks both give the same op sequence). Edges:
* inside a pass: the dependency rules (data, call point, blocking calls), per occurrence; the call
  point also across passes (a pass's leading recv is issued after the previous pass's compute);
* across passes: waits on communication of another pass (the optimizer on the DP all-reduces), resolved
  to the same micro-batch's pass, or for once-per-step ops to the latest earlier occurrence;
* streams: each stream of a class runs its nodes in program order (P2P transfers take no stream slot:
  a send waits only for its receiver, as with batched isend/irecv).
Cross-class synchronisation: the k-th collective of a class on a group with members in classes S
starts with the k-th one of every class in S; the k-th send from class A to B in a direction (forward or
backward) with the k-th receive of B from A (NCCL matches P2P in issue order). A combined pass (a forward and a
backward interleaved, parallelism.moe_a2a_overlap) is one template, placed at its forward's micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainsim.parallel.phases import COMBINED
from trainsim.parallel.schedules import (
    Action,
    combined_chunk,
    first_forward_microbatch,
    last_backward_microbatch,
    num_chunks,
    passes,
)
from trainsim.timeline.program import BLOCK, COMPUTE, RECV, SEND, PassNodes


class TimelineError(RuntimeError):
    """The step cannot be composed (unmatched collective or P2P, cyclic wait); names class and op."""


@dataclass
class ClassProgram:
    """One timeline class: its pass templates (nodes) and its schedule."""

    class_id: int
    templates: list[PassNodes]
    actions: list[Action]


@dataclass
class TemplateTable:
    """All template nodes of all classes, concatenated (a node of the step points into it)."""

    cls: np.ndarray
    template: np.ndarray
    kind: np.ndarray
    compute_s: np.ndarray
    fixed_s: np.ndarray
    first_op: np.ndarray
    last_op: np.ndarray
    host_ops: np.ndarray
    phase: np.ndarray
    chunk: np.ndarray
    sync_key: list
    nic_s: np.ndarray
    """Bandwidth-bound seconds of inter-node communication per template node (contention.py)."""


@dataclass
class StepGraph:
    table: TemplateTable
    tnode: np.ndarray
    """step node -> template node."""
    cls: np.ndarray
    microbatch: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sync_group: np.ndarray
    """step node -> cross-class synchronisation group (-1: none)."""
    group_size: np.ndarray
    stream: np.ndarray
    """step node -> stream id (index into `streams`)."""
    streams: list[str]

    @property
    def num_nodes(self) -> int:
        return len(self.tnode)


def occurrences(program: ClassProgram) -> tuple[np.ndarray, np.ndarray]:
    """(template index, micro-batch) of every pass the class runs in a step, in program order."""
    index = {(t.phase, t.chunk, t.variant): i for i, t in enumerate(program.templates)}
    last_mb = last_backward_microbatch(program.actions)
    first_mb = first_forward_microbatch(program.actions)
    occ_t, occ_mb = [], []
    v = num_chunks(program.actions)
    for group in passes(program.actions):
        if len(group) == 2:  # a combined pass, by its forward's micro-batch (its backward's forward ran earlier)
            occ_t.append(index[(COMBINED, combined_chunk(*group, v), "all")])
            occ_mb.append(group[0].microbatch)
            continue
        (a,) = group
        phase = "forward" if a.kind == "F" else "backward"
        once = (first_mb if a.kind == "F" else last_mb)[a.chunk]
        variant = "all" if a.microbatch == once else "per_microbatch"
        t = index.get((phase, a.chunk, variant), index.get((phase, a.chunk, "all")))
        if t is not None:
            occ_t.append(t)
            occ_mb.append(a.microbatch)
    if ("optimizer", 0, "all") in index:
        occ_t.append(index[("optimizer", 0, "all")])
        occ_mb.append(0)
    return np.asarray(occ_t, dtype=np.int64), np.asarray(occ_mb, dtype=np.int64)


def _external_edges(templates: list[PassNodes], occ_t: np.ndarray, occ_mb: np.ndarray,
                    occ_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges to communication of other passes, per occurrence (vectorised over occurrences)."""
    wanted = np.asarray(sorted({target for t in templates for _, target in t.external}), dtype=np.int64)
    where: dict[int, dict[int, int]] = {}  # trace op id -> {template: node}
    for i, t in enumerate(templates):
        hit = np.flatnonzero(np.isin(t.op_ids, wanted))
        for op_id, node in zip(t.op_ids[hit].tolist(), t.node_of_op[hit].tolist()):
            where.setdefault(op_id, {})[i] = node
    pass_ids = {}
    pass_of_template = np.asarray([pass_ids.setdefault((t.phase, t.chunk), len(pass_ids)) for t in templates])
    occ_pass = pass_of_template[occ_t]
    src, dst = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    by_mb = np.full(int(occ_mb.max()) + 1 if len(occ_mb) else 1, -1, dtype=np.int64)
    for ti, t in enumerate(templates):
        mine = np.flatnonzero(occ_t == ti)
        chosen_for: dict[tuple[int, bool], np.ndarray] = {}
        for node, target in t.external:
            targets = where.get(target)
            if not targets or not len(mine):
                continue
            target_pass = int(pass_of_template[next(iter(targets))])
            per_mb = bool(t.per_microbatch_op[t.node_of_op == node].all())
            if (target_pass, per_mb) not in chosen_for:
                cand = np.flatnonzero(occ_pass == target_pass)
                if per_mb:  # this micro-batch's pass
                    by_mb[:] = -1
                    by_mb[occ_mb[cand]] = cand
                    chosen = by_mb[occ_mb[mine]]
                    chosen = np.where(chosen < mine, chosen, -1)
                else:  # once per step: the latest earlier occurrence
                    pos = np.searchsorted(cand, mine) - 1
                    chosen = np.where(pos >= 0, cand[np.maximum(pos, 0)], -1) if len(cand) else np.full(len(mine), -1)
                chosen_for[(target_pass, per_mb)] = chosen
            chosen = chosen_for[(target_pass, per_mb)]
            node_in = np.full(len(templates), -1, dtype=np.int64)
            node_in[list(targets)] = list(targets.values())
            target_node = np.where(chosen >= 0, node_in[occ_t[np.maximum(chosen, 0)]], -1)
            ok = target_node >= 0
            src.append(occ_start[chosen[ok]] + target_node[ok])
            dst.append(occ_start[mine[ok]] + node)
    return np.concatenate(src), np.concatenate(dst)


def _pass_links(templates: list[PassNodes], occ_t: np.ndarray, occ_start: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Call points across passes: communication issued before a pass's first compute (a pipeline recv)
    is enqueued after the compute of the passes before it, as the host issues them in program order."""
    on_compute = [(t.kind == COMPUTE) | (t.kind == BLOCK) for t in templates]
    first = [int(np.argmax(c)) if c.any() else len(c) for c in on_compute]
    heads = [np.flatnonzero(~c[:f]) for c, f in zip(on_compute, first)]
    tail = np.asarray([int(np.flatnonzero(c)[-1]) if c.any() else -1 for c in on_compute])[occ_t]
    last_compute = np.maximum.accumulate(np.where(tail >= 0, occ_start + tail, -1))
    previous = np.concatenate([[-1], last_compute[:-1]])
    src, dst = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for ti, head in enumerate(heads):
        mine = np.flatnonzero((occ_t == ti) & (previous >= 0))
        if len(head) and len(mine):
            src.append(np.repeat(previous[mine], len(head)))
            dst.append((occ_start[mine][:, None] + head[None, :]).ravel())
    return np.concatenate(src), np.concatenate(dst)


def _expand_class(program: ClassProgram, template_start: np.ndarray, base: int, link_passes: bool):
    templates = program.templates
    occ_t, occ_mb = occurrences(program)
    counts = np.asarray([len(t.kind) for t in templates], dtype=np.int64)[occ_t]
    occ_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(occ_start, counts)
    tnode = np.repeat(template_start[occ_t], counts) + within
    microbatch = np.repeat(occ_mb, counts)
    src, dst = [], []
    for ti, t in enumerate(templates):
        if len(t.edges):
            offsets = occ_start[occ_t == ti]
            src.append((t.edges[None, :, 0] + offsets[:, None]).ravel())
            dst.append((t.edges[None, :, 1] + offsets[:, None]).ravel())
    for edges in (_external_edges(templates, occ_t, occ_mb, occ_start),
                  _pass_links(templates, occ_t, occ_start) if link_passes else None):
        if edges is not None:
            src.append(edges[0])
            dst.append(edges[1])
    src = np.concatenate(src) + base if src else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst) + base if dst else np.zeros(0, dtype=np.int64)
    return tnode, microbatch, src, dst


def template_table(programs: list[ClassProgram]) -> tuple[TemplateTable, list[np.ndarray]]:
    cols: dict[str, list] = {k: [] for k in ("cls", "template", "kind", "compute_s", "fixed_s", "first_op",
                                             "last_op", "host_ops", "phase", "chunk", "nic_s")}
    sync_key: list = []
    starts, position = [], 0
    for p in programs:
        class_starts = []
        for ti, t in enumerate(p.templates):
            n = len(t.kind)
            class_starts.append(position)
            position += n
            cols["cls"].append(np.full(n, p.class_id))
            cols["template"].append(np.full(n, ti))
            cols["phase"].append(t.direction)
            cols["chunk"].append(np.full(n, t.chunk))
            for name in ("kind", "compute_s", "fixed_s", "first_op", "last_op", "host_ops", "nic_s"):
                cols[name].append(getattr(t, name))
            sync_key += t.sync_key
        starts.append(np.asarray(class_starts, dtype=np.int64))
    table = TemplateTable(**{k: np.concatenate(v) for k, v in cols.items()}, sync_key=sync_key)
    return table, starts


def _stream_edges(stream: np.ndarray, lane_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive nodes of the same stream (program order), P2P excluded."""
    idx = np.flatnonzero(~lane_free)
    order = idx[np.argsort(stream[idx], kind="stable")]
    same = stream[order[1:]] == stream[order[:-1]]
    return order[:-1][same], order[1:][same]


def _sync_groups(table: TemplateTable, tnode: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys: dict = {}
    key_id = np.asarray([-1 if k is None else keys.setdefault(k, len(keys)) for k in table.sync_key],
                        dtype=np.int64)
    node_key = key_id[tnode]
    nodes = np.flatnonzero(node_key >= 0)
    group = np.full(len(tnode), -1, dtype=np.int64)
    if not len(nodes):
        return group, np.zeros(0, dtype=np.int64)
    kind = table.kind[tnode[nodes]]
    counter_key = (cls[nodes] * (len(keys) + 1) + node_key[nodes]) * 2 + (kind == RECV)
    order = np.argsort(counter_key, kind="stable")
    sorted_key = counter_key[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    k = np.empty(len(nodes), dtype=np.int64)
    k[order] = np.arange(len(nodes)) - first
    width = int(k.max()) + 1
    pair = node_key[nodes] * width + k
    uniq, gid = np.unique(pair, return_inverse=True)
    group[nodes] = gid
    members = np.bincount(gid, minlength=len(uniq))
    sides = np.asarray([2 if key[0] == "p2p" else len(key[2]) for key in keys], dtype=np.int64)
    expected = sides[uniq // width]
    bad = np.flatnonzero(members != expected)
    if len(bad):
        g = bad[0]
        key = list(keys)[uniq[g] // width]
        who = sorted(set(cls[nodes][gid == g].tolist()))
        raise TimelineError(f"unmatched communication: occurrence {uniq[g] % width} of {key} is issued "
                            f"by class(es) {who} only ({members[g]} of {expected[g]} sides); the classes' "
                            "schedules or groups disagree")
    return group, expected


def build_step(programs: list[ClassProgram], stream_of_tnode: np.ndarray, streams: list[str],
               link_passes: bool = True) -> StepGraph:
    """The step graph; link_passes adds the call-point rule across pass boundaries."""
    table, starts = template_table(programs)
    tnodes, mbs, srcs, dsts, clss = [], [], [], [], []
    base = 0
    for p, class_start in zip(programs, starts):
        tnode, mb, s, d = _expand_class(p, class_start, base, link_passes)
        tnodes.append(tnode)
        mbs.append(mb)
        srcs.append(s)
        dsts.append(d)
        clss.append(np.full(len(tnode), p.class_id))
        base += len(tnode)
    tnode, cls = np.concatenate(tnodes), np.concatenate(clss)
    stream = stream_of_tnode[tnode]
    kind = table.kind[tnode]
    # one FIFO per (class, stream)
    fs, fd = _stream_edges(cls * len(streams) + stream, (kind == SEND) | (kind == RECV))
    group, expected = _sync_groups(table, tnode, cls)
    return StepGraph(table, tnode, cls, np.concatenate(mbs), np.concatenate([*srcs, fs]),
                     np.concatenate([*dsts, fd]), group, expected, stream, streams)
