"""Compose one training step: trace + kernel times + communication model + slowdown model -> timeline.

`compose_step` is the library entry point (the stage, the CLI, the benchmark and the tests call it):
1. rank classes: the trace's, split by stragglers (classes.py);
2. per class and pass: kernels, edges from the dependency rules, durations, serial runs collapsed
   (program.py);
3. the step graph: passes along the pipeline schedule, stream order, cross-class matching (step.py);
4. replay (engine.py), then overlap slowdown (overlap.py) and NIC contention between concurrent
   inter-node transfers of a rank (contention.py) until the durations reproduce themselves;
5. outputs: breakdown, critical path, memory verdict (outputs.py), Chrome trace (chrome.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainsim.comm.placement import job_placement
from trainsim.config.schema import HardwareConfig, ParallelismConfig
from trainsim.errors import ConfigError
from trainsim.parallel.layout import Layout, layout_of
from trainsim.timeline.classes import TimelineClasses, straggler_factors, timeline_classes
from trainsim.timeline.contention import BOTH, EGRESS, INGRESS, contention_extra
from trainsim.timeline.costs import CommCost, NoSlowdown, SlowdownEstimate, finite_seconds, model_name
from trainsim.timeline.engine import HostIssue, Replay, replay, successors
from trainsim.timeline.overlap import SlowdownCache, is_comm_kind, is_compute_kind, overlapped
from trainsim.timeline.plugins import DEFAULT_RULES, schedule_actions
from trainsim.timeline.program import (
    BLOCK,
    COLLECTIVE,
    COMPUTE,
    KIND_NAMES,
    MEMCPY,
    RECV,
    SEND,
    OpCosts,
    PassNodes,
    PassOps,
    kernel_graph,
    op_costs,
    pass_nodes,
    pass_ops,
)
from trainsim.timeline.step import ClassProgram, StepGraph, build_step
from trainsim.trace.expand import rename_for_rank

ComputeSeconds = Mapping[str, float] | Callable[[pd.DataFrame], np.ndarray]


@dataclass
class TemplateInfo:
    """Per template node (see step.TemplateTable): what it is, for outputs and slowdown features."""

    label: list[str] = field(default_factory=list)
    group_kind: list = field(default_factory=list)
    stream: list[str] = field(default_factory=list)
    comm: list = field(default_factory=list)
    source: list[tuple] = field(default_factory=list)
    """(PassOps, OpCosts, first op, last op) of each template node."""


@dataclass
class StepTimeline:
    """The composed step: per-node times plus what produced them."""

    step_time_s: float
    classes: TimelineClasses
    graph: StepGraph
    replay: Replay
    duration_s: np.ndarray
    """Per step node, after overlap slowdown."""
    solo_compute_s: np.ndarray
    """Per step node, compute part before slowdown (straggler factor included)."""
    fixed_s: np.ndarray
    """Per step node, communication part (collective/P2P time, or tensor-parallel time inside a block)."""
    contention_s: np.ndarray
    """Per step node, time a communication node gains from sharing its rank's NIC (in duration_s)."""
    info: TemplateInfo
    pp_rank: np.ndarray
    """Per class: its pipeline stage."""
    iterations: int
    converged: bool
    models: dict[str, str]
    num_ops: int
    """Kernels the step runs (all classes, all micro-batches), before collapsing."""
    simulate_s: float


def _compute_lookup(compute_seconds: ComputeSeconds) -> Callable[[pd.DataFrame, np.ndarray], np.ndarray]:
    """(ops, mask) -> solo seconds of ops[mask], from the profile mapping or a function of the rows."""
    if callable(compute_seconds):
        return lambda ops, mask: np.asarray(compute_seconds(ops[mask]), dtype=float)
    index = pd.Index(list(compute_seconds.keys()))
    values = np.asarray(list(compute_seconds.values()), dtype=float)

    def lookup(ops: pd.DataFrame, mask: np.ndarray) -> np.ndarray:
        position = index.get_indexer(ops["signature"].to_numpy()[mask])
        if (position < 0).any():
            missing = ops[mask][position < 0]
            raise ConfigError(f"{len(missing)} kernel(s) have no time in the profile, e.g. {missing['op'].iat[0]} "
                              f"signature {missing['signature'].iat[0]}; re-run the profile stage for this trace")
        return values[position]

    return lookup


def _comm_lookup(comm: CommCost) -> Callable[..., float]:
    cache: dict[tuple, float] = {}

    def seconds(collective: str, message_bytes: int, num_ranks: int, num_nodes: int) -> float:
        key = (collective, message_bytes, num_ranks, num_nodes)
        if key not in cache:
            if collective == "p2p":
                value = comm.p2p_seconds(message_bytes, num_nodes == 1)
            else:
                value = comm.collective_seconds(collective, message_bytes, num_ranks, num_nodes)
            cache[key] = finite_seconds(value, f"{model_name(comm)} for {key}")
        return cache[key]

    return seconds


def _describe(p: PassOps, costs: OpCosts, nodes: PassNodes) -> list[tuple]:
    """(label, group kind, stream, communication) of each node of a pass."""
    ops = p.ops
    group_kind, coll = ops["group_kind"].to_numpy(), ops["collective"].to_numpy()
    names, streams = ops["op"].to_numpy(), ops["stream"].to_numpy()
    message, members = ops["message_bytes"].to_numpy(), ops["group_ranks"].to_numpy()
    inner_kind: dict[int, str] = {}
    for i in np.flatnonzero(costs.kind == COLLECTIVE):
        inner_kind.setdefault(int(nodes.node_of_op[i]), group_kind[i])
    out = []
    for n, (kind, first, last) in enumerate(zip(nodes.kind.tolist(), nodes.first_op.tolist(), nodes.last_op.tolist())):
        if kind == BLOCK:
            out.append((f"{p.phase} chunk {p.chunk} ({last - first + 1} kernels)", inner_kind.get(n), "compute", None))
        elif kind in (COMPUTE, MEMCPY):
            out.append((str(names[first]), None, str(streams[first]), None))
        else:
            stream = f"{streams[first]}.{KIND_NAMES[kind]}" if kind in (SEND, RECV) else str(streams[first])
            out.append((f"{coll[first]} {group_kind[first]} {int(message[first])} B", group_kind[first], stream,
                        {"collective": coll[first], "message_bytes": int(message[first]),
                         "num_ranks": len(members[first])}))
    return out


VALUE_COLUMNS = ("signature", "flops", "bytes_moved", "message_bytes")
"""What differs between classes that run the same ops on other sizes (expert-parallel ranks of a skewed routing)."""


STRUCTURE_COLUMNS = ["id", "phase", "chunk", "per_microbatch", "kind", "stream", "op", "no_kernel", "collective",
                     "group_kind", "async_op"]


def _row_hashes(graph: pd.DataFrame) -> np.ndarray:
    """Per event, a hash of what makes graphs equal up to renaming of groups and peers (middle stages) and
    the sizes of their ops (VALUE_COLUMNS): STRUCTURE_COLUMNS and the dependencies. Computed once for all
    classes (per class it costs more than the composition of a thousand classes may)."""
    rows = pd.util.hash_pandas_object(graph[STRUCTURE_COLUMNS], index=False).to_numpy()
    deps = np.fromiter((hash(tuple(d)) for d in graph["deps"].to_list()), dtype=np.int64, count=len(graph))
    return rows ^ (deps.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15))


@dataclass
class _Structure:
    """Passes shared by the classes of one structure, as built for the first of them."""

    representative: int
    base: int
    passes: list[PassOps]
    comm_rows: pd.DataFrame
    """The passes' communication rows, concatenated (what renaming rewrites)."""
    comm: list[np.ndarray]
    """Positions of those rows in each pass."""

    @classmethod
    def of(cls, representative: int, base: int, passes: list[PassOps]) -> _Structure:
        comm = [np.flatnonzero(p.ops["kind"].to_numpy() != "compute") for p in passes]
        rows = pd.concat([p.ops.iloc[c] for p, c in zip(passes, comm)], ignore_index=True)
        return cls(representative, base, passes, rows, comm)


def _class_passes(structure: _Structure, layout: Layout, rep: int, events: pd.DataFrame | None) -> list[PassOps]:
    """The structure's passes as class `rep` runs them: its own op sizes (VALUE_COLUMNS taken from `events` by
    trace id; None: the structure's own), its own groups and peers (rename_for_rank). Edges and runs depend on
    the structure only."""
    updates: list[dict] = [{} for _ in structure.passes]
    if events is not None:
        ids = events["id"].to_numpy()
        order = np.argsort(ids, kind="stable")
        values = {c: events[c].to_numpy()[order] for c in VALUE_COLUMNS}
        for update, p in zip(updates, structure.passes):
            at = np.searchsorted(ids[order], p.ops["id"].to_numpy())
            update.update({c: v[at] for c, v in values.items()})
    if rep != structure.representative and len(structure.comm_rows):
        renamed = rename_for_rank(structure.comm_rows, layout, structure.representative, rep)
        groups_all, peers_all = renamed["group_ranks"].to_numpy(), renamed["peer"].to_numpy()
        offset = 0
        for update, p, c in zip(updates, structure.passes, structure.comm):
            groups, peers = p.ops["group_ranks"].to_numpy().copy(), p.ops["peer"].to_numpy().copy()
            groups[c], peers[c] = groups_all[offset:offset + len(c)], peers_all[offset:offset + len(c)]
            offset += len(c)
            update.update(group_ranks=groups, peer=peers)
    return [PassOps(p.phase, p.chunk, p.variant, p.ops.assign(**update), p.edges, p.external) if update else p
            for p, update in zip(structure.passes, updates)]


def _class_programs(graph: pd.DataFrame, rank_classes: pd.DataFrame, par: ParallelismConfig, hw: HardwareConfig,
                    classes: TimelineClasses, compute_seconds: ComputeSeconds, comm: CommCost,
                    schedule: str, rules: tuple[str, ...], collapse: bool):
    """Pass templates of every class. Classes with the same graph up to renaming and op sizes share the work
    of splitting, rule evaluation and collapsing (labels, which name sizes, are per trace class)."""
    layout = layout_of(par)
    lookup, comm_s = _compute_lookup(compute_seconds), _comm_lookup(comm)
    base_rep = rank_classes.groupby("rank_class")["rank"].min().to_dict()
    graph = graph.reset_index(drop=True)
    row_hashes = _row_hashes(graph)
    rows_of_base = graph.groupby("rank_class", sort=True).indices
    structures: dict[int, _Structure] = {}  # fingerprint -> the passes of the first class with it
    shape_of_base: dict[int, int] = {}
    runs_cache: dict = {}
    described: dict = {}
    groups: dict = {}  # op_costs' group members -> (their classes, nodes)
    domain_of_rank = job_placement(hw, par.world_size).domain_of_rank
    programs, info, pp_rank = [], TemplateInfo(), []
    for c in range(classes.count):
        base, rep = int(classes.base_class[c]), int(classes.representative[c])
        if base not in rows_of_base:
            raise ConfigError(f"graph.parquet has no events for rank class {base} (rank {rep})")
        if base not in shape_of_base:
            rows = rows_of_base[base]
            shape_of_base[base] = hash(row_hashes[rows].tobytes())
            if shape_of_base[base] not in structures:
                passes = pass_ops(kernel_graph(graph.iloc[rows]), rules)
                structures[shape_of_base[base]] = _Structure.of(base_rep[base], base, passes)
        shape = shape_of_base[base]
        structure = structures[shape]
        passes = _class_passes(structure, layout, rep,
                               None if base == structure.base else graph.iloc[rows_of_base[base]])
        templates = []
        for i, p in enumerate(passes):
            costs = op_costs(p, c, classes.class_of_rank, rep, float(classes.compute_factor[c]), domain_of_rank,
                             lookup, comm_s, comm.sync_wait_s, groups)
            key = (shape, i, costs.kind.tobytes(), costs.internal.tobytes(), collapse)
            nodes = pass_nodes(p, costs, collapse, runs_cache.get(key))
            runs_cache[key] = nodes.node_of_op
            labels = (key, base)  # labels name message sizes: per base class
            if labels not in described:
                described[labels] = _describe(p, costs, nodes)
            for (label, group_kind, stream, comm_info), first, last in zip(described[labels], nodes.first_op.tolist(),
                                                                         nodes.last_op.tolist()):
                info.label.append(label)
                info.group_kind.append(group_kind)
                info.stream.append(stream)
                info.comm.append(comm_info)
                info.source.append((p, costs, first, last))
            templates.append(nodes)
        stage = layout.position(rep).pp_rank
        pp_rank.append(stage)
        actions = schedule_actions(schedule, par.pp, stage, par.num_microbatches, par.virtual_stages,
                                   par.moe_a2a_overlap)
        programs.append(ClassProgram(c, templates, actions))
    return programs, info, np.asarray(pp_rank)


def _features(info: TemplateInfo) -> tuple[Callable[[int], dict], Callable[[int], dict]]:
    columns: dict[int, tuple] = {}

    def compute(tnode: int) -> dict:
        p, costs, first, last = info.source[tnode]
        if id(p) not in columns:
            columns[id(p)] = (p.ops["op"].to_numpy(), p.ops["flops"].to_numpy(), p.ops["bytes_moved"].to_numpy())
        op, flops, moved = columns[id(p)]
        keep = np.flatnonzero(costs.kind[first:last + 1] == COMPUTE) + first
        return {"op": op[keep], "flops": flops[keep], "bytes_moved": moved[keep], "duration_s": costs.compute_s[keep]}

    return compute, lambda tnode: info.comm[tnode]


GRAPH_COLUMNS = ("rank_class", "id", "phase", "chunk", "per_microbatch", "kind", "stream", "op", "signature",
                 "no_kernel", "flops", "bytes_moved", "collective", "group_kind", "group_ranks", "message_bytes",
                 "peer", "deps")


def _plain(graph: pd.DataFrame) -> pd.DataFrame:
    """The columns the composer reads, strings as plain Python objects (fast row-wise access)."""
    missing = [c for c in GRAPH_COLUMNS if c not in graph.columns]
    if missing:
        raise ConfigError(f"the execution graph lacks column(s) {missing}; expected the trace stage's "
                          "graph.parquet (trainsim.trace.schema.GRAPH_SCHEMA)")
    out = graph[list(GRAPH_COLUMNS)].copy()
    out["async_op"] = graph["async_op"].to_numpy(dtype=bool) if "async_op" in graph else False
    for c in ("phase", "kind", "stream", "op", "signature", "collective", "group_kind"):
        out[c] = pd.Series(out[c].to_numpy(dtype=object, na_value=None), index=out.index, dtype=object)
    return out


def _class_ends(graph: StepGraph, result: Replay) -> np.ndarray:
    ends = np.zeros(int(graph.cls.max()) + 1 if len(graph.cls) else 0)
    np.maximum.at(ends, graph.cls, result.end_s)
    return ends


def host_issue(graph: StepGraph, dispatch_s: float) -> HostIssue | None:
    """When each node's first and last op leave the host: every class's host thread dispatches its ops
    back to back in program order from the start of the step (nodes of a class are contiguous and in
    program order, see step.build_step), running ahead of the device as CUDA's launch queue lets it.
    The host is not modelled as waiting for the device inside a step."""
    if dispatch_s <= 0 or not graph.num_nodes:
        return None
    ops = graph.table.host_ops[graph.tnode]
    issued = np.empty(len(ops))
    for c in np.unique(graph.cls):
        mine = graph.cls == c
        issued[mine] = np.cumsum(ops[mine]) * dispatch_s
    kernels = (graph.table.last_op - graph.table.first_op + 1)[graph.tnode]
    return HostIssue(first_s=issued - (ops - 1) * dispatch_s, last_s=issued, kernels=kernels)


def nic_nodes(graph: StepGraph) -> np.ndarray:
    """Step nodes that use their rank's NIC: standalone collectives and P2P transfers whose group spans
    nodes and whose time grows with the message (communication inside collapsed runs is left out)."""
    kind = graph.table.kind[graph.tnode]
    return np.flatnonzero(is_comm_kind(kind) & (graph.table.nic_s[graph.tnode] > 0))


def _iterate(graph: StepGraph, solo: np.ndarray, fixed: np.ndarray, cache: SlowdownCache,
             max_iterations: int, tolerance: float, host: HostIssue | None = None, nic: np.ndarray | None = None
             ) -> tuple[Replay, np.ndarray, np.ndarray, int, bool]:
    """Replay, stretch overlapped compute and contended transfers, replay again until stable (overlap.py,
    contention.py): the stretch the last replay implies differs from the one it used by at most
    `tolerance` x step time in total (then no node can move by more), or no class's end moved by more
    than that between the last two replays. `nic`: the step nodes that share their rank's NIC (none: no
    contention). Returns the replay, the durations it used, their contention part, iterations, converged."""
    csr = successors(graph)
    kind = graph.table.kind[graph.tnode]
    compute = is_compute_kind(kind) & (solo > 0)
    nic = np.zeros(0, dtype=np.int64) if nic is None else nic
    nic_cls, nic_fixed, nic_group = graph.cls[nic], fixed[nic], graph.sync_group[nic]
    nic_bandwidth = graph.table.nic_s[graph.tnode[nic]]
    nic_way = np.select([kind[nic] == SEND, kind[nic] == RECV], [EGRESS, INGRESS], BOTH)
    extra = np.zeros(len(solo))
    duration, previous_ends = fixed + solo, None
    for iteration in range(1, max_iterations + 1):
        result = replay(graph, duration, csr, host=host)
        ends = _class_ends(graph, result)
        limit = tolerance * result.step_time_s
        if previous_ends is not None and np.abs(ends - previous_ends).max() <= limit:
            return result, duration, extra, iteration, True
        previous_ends = ends
        overlap_s, partner = overlapped(graph.cls, kind, result.start_s, result.end_s)
        s = np.zeros(len(solo))
        hit = np.flatnonzero((overlap_s > 0) & compute & (partner >= 0))
        if len(hit):
            s[hit] = cache.lookup(graph.tnode[hit], graph.tnode[partner[hit]])
        r = np.minimum(1.0, overlap_s / np.maximum(solo * (1.0 + s), 1e-300))
        new_extra = np.zeros(len(solo))
        if len(nic) > 1:
            new_extra[nic] = contention_extra(nic_cls, result.start_s[nic], duration[nic], nic_fixed,
                                              nic_bandwidth, nic_group, nic_way)
        stretched = fixed + new_extra + solo * (1.0 + r * s)  # Echo: t = (1 - r) t0 + r t0 (1 + s)
        if np.abs(stretched - duration).sum() <= limit:
            return result, duration, extra, iteration, True
        duration, extra = stretched, new_extra
    return replay(graph, duration, csr, host=host), duration, extra, max_iterations, False


def compose_step(graph: pd.DataFrame, rank_classes: pd.DataFrame, par: ParallelismConfig, hw: HardwareConfig,
                 compute_seconds: ComputeSeconds, comm: CommCost, slowdown: SlowdownEstimate | None = None, *,
                 schedule: str | None = None, rules: tuple[str, ...] = DEFAULT_RULES, collapse: bool = True,
                 max_iterations: int = 10, tolerance: float = 1e-4, nic_contention: bool = True) -> StepTimeline:
    """The timeline of one training step.

    graph / rank_classes: the trace stage's tables; compute_seconds: signature -> solo seconds (the
    profile) or a function of the op rows; comm: a CommCost; slowdown: a SlowdownEstimate (none: no
    overlap slowdown); schedule: a registered pipeline schedule (default parallelism.schedule); rules:
    registered dependency rules; collapse=False keeps one node per kernel (same result, slower);
    nic_contention=False prices every inter-node transfer alone, as if it had its rank's NIC to itself
    (contention.py).
    """
    started = time.perf_counter()
    slowdown = slowdown or NoSlowdown()
    layout = layout_of(par)
    classes = timeline_classes(rank_classes, layout, straggler_factors(hw, layout.world_size))
    programs, info, pp_rank = _class_programs(_plain(graph), rank_classes, par, hw, classes, compute_seconds, comm,
                                              schedule or par.schedule, tuple(rules), collapse)
    streams = sorted(set(info.stream), key=lambda s: (s != "compute", s))
    stream_id = {s: i for i, s in enumerate(streams)}
    step = build_step(programs, np.asarray([stream_id[s] for s in info.stream], dtype=np.int64), streams,
                      link_passes="call_point" in rules)
    solo = step.table.compute_s[step.tnode]
    fixed = step.table.fixed_s[step.tnode]
    cache = SlowdownCache(slowdown, *_features(info))
    host = host_issue(step, hw.host_dispatch_s)
    nic = nic_nodes(step) if nic_contention else None
    result, duration, contention, iterations, converged = _iterate(step, solo, fixed, cache, max_iterations,
                                                                   tolerance, host, nic)
    ops_per_node = step.table.last_op - step.table.first_op + 1
    return StepTimeline(
        step_time_s=result.step_time_s, classes=classes, graph=step, replay=result, duration_s=duration,
        solo_compute_s=solo, fixed_s=fixed, contention_s=contention, info=info, pp_rank=pp_rank,
        iterations=iterations,
        converged=converged, models={"comm": model_name(comm), "slowdown": model_name(slowdown),
                                     "schedule": schedule or par.schedule, "rules": ",".join(rules),
                                     "nic_contention": "fair share per rank" if nic_contention else "off"},
        num_ops=int(ops_per_node[step.tnode].sum()), simulate_s=time.perf_counter() - started)
