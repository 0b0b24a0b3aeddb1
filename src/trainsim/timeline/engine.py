"""The event-driven replay: a heap of ready nodes, released in time order.

A node becomes ready when every predecessor (stream order, data and rule edges) has ended; it starts at
the latest of their ends. A node in a cross-class synchronisation group (a collective whose members
span classes, a send/recv pair) waits until every member is ready, then all start together at the
latest arrival: a collective starts when the last member of its group arrives (Echo sec. 3; NCCL
kernels spin until every peer joins), a P2P transfer when both sides are posted. Streams are FIFO in
program order, so the replay needs no resource arbitration; each node records the node that decided
its start (its latest predecessor, or the last member of its group), which is the critical path.

Host dispatch (optional): a kernel cannot start before the host thread has issued it, nor a run of
kernels end before its last kernel was issued and ran. `HostIssue` gives each node the time its first
and last op leave the host; a node whose start the host decided has cause HOST.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trainsim.timeline.step import StepGraph, TimelineError

# set: a code
HOST = -2
"""`Replay.cause` of a node that waited for the host to issue it."""


@dataclass
class HostIssue:
    """Per node: when the host issues its first and its last op, and its kernel count (see module doc)."""

    first_s: np.ndarray
    last_s: np.ndarray
    kernels: np.ndarray

    def earliest_end(self, duration_s: np.ndarray) -> np.ndarray:
        """The last kernel starts once issued and takes its share of the node's duration."""
        return self.last_s + duration_s / np.maximum(self.kernels, 1)


@dataclass
class Replay:
    start_s: np.ndarray
    end_s: np.ndarray
    cause: np.ndarray
    """Node that decided each node's start: latest predecessor or last-arriving group member (-1: t=0,
    HOST: its issue by the host)."""

    @property
    def step_time_s(self) -> float:
        return float(self.end_s.max()) if len(self.end_s) else 0.0


def _csr(graph: StepGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pointer, successor) arrays of the edges by source node, and each node's predecessor count."""
    order = np.argsort(graph.src, kind="stable")
    ptr = np.searchsorted(graph.src[order], np.arange(graph.num_nodes + 1))
    return ptr, graph.dst[order], np.bincount(graph.dst, minlength=graph.num_nodes)


def successors(graph: StepGraph) -> tuple[list[int], list[int], list[int], list[int]]:
    """CSR (pointer, successor) lists, predecessor counts and the initially ready nodes, once per graph."""
    ptr, succ, npred = _csr(graph)
    return ptr.tolist(), succ.tolist(), npred.tolist(), np.flatnonzero(npred == 0).tolist()


# set: when replay switches to batches (the same result, faster)
BATCHED_MIN_CLASSES = 64
"""From this many classes on, `replay` releases nodes in batches (`replay_batched`): wide graphs, where every
round of ready nodes is large, run faster in numpy than node by node through the heap."""


def replay(graph: StepGraph, duration_s: np.ndarray, csr=None,
           describe: Callable[[int], str] | None = None, host: HostIssue | None = None) -> Replay:
    """Start and end of every node (module docstring); node by node in time order, or in batches for graphs
    of many classes (same times: both compute the latest-arrival recursion)."""
    if len(graph.cls) and int(graph.cls.max()) + 1 >= BATCHED_MIN_CLASSES:
        return replay_batched(graph, duration_s, describe, host)
    n = graph.num_nodes
    ptr, succ, remaining, initial = csr or successors(graph)
    remaining = list(remaining)
    dur = duration_s.tolist()
    group = graph.sync_group.tolist()
    size = graph.group_size.tolist()
    arrived: list[list[int]] = [[] for _ in size]
    group_time = [0.0] * len(size)
    group_last = [-1] * len(size)
    ready = [0.0] * n
    latest_pred = [-1] * n
    start = [0.0] * n
    end = [0.0] * n
    cause = [-1] * n
    issued = host.first_s.tolist() if host is not None else [0.0] * n
    min_end = host.earliest_end(duration_s).tolist() if host is not None else [0.0] * n
    heap = [(0.0, i) for i in initial]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    done = 0
    while heap:
        t, i = pop(heap)
        if issued[i] > t:  # ready before the host issued it: wait for the issue
            push(heap, (issued[i], i))
            latest_pred[i] = HOST
            continue
        g = group[i]
        if g < 0:  # the common case: no other class to wait for
            cause[i] = latest_pred[i]
            start[i] = t
            e = t + dur[i]
            if e < min_end[i]:
                e = min_end[i]
            end[i] = e
            done += 1
            for k in succ[ptr[i]:ptr[i + 1]]:
                if e >= ready[k]:
                    ready[k] = e
                    latest_pred[k] = i
                left = remaining[k] - 1
                remaining[k] = left
                if not left:
                    push(heap, (ready[k], k))
            continue
        members = arrived[g]
        members.append(i)
        if t >= group_time[g]:
            group_time[g], group_last[g] = t, i
        if len(members) < size[g]:
            continue
        last, t = group_last[g], group_time[g]
        for j in members:  # the last member has arrived: all start together
            cause[j] = latest_pred[j] if j == last else last
            start[j] = t
            e = t + dur[j]
            if e < min_end[j]:
                e = min_end[j]
            end[j] = e
            done += 1
            for k in succ[ptr[j]:ptr[j + 1]]:
                if e >= ready[k]:
                    ready[k] = e
                    latest_pred[k] = j
                left = remaining[k] - 1
                remaining[k] = left
                if not left:
                    push(heap, (ready[k], k))
    if done < n:
        raise TimelineError(_deadlock_message(graph, remaining, arrived, size, describe))
    return Replay(np.asarray(start), np.asarray(end), np.asarray(cause, dtype=np.int64))


def _deadlock_message(graph: StepGraph, remaining: list[int], arrived: list[list[int]], size: list[int],
                      describe: Callable[[int], str] | None) -> str:
    name = describe or (lambda i: f"node {i}")
    stuck = [g for g, members in enumerate(arrived) if 0 < len(members) < size[g]]
    if stuck:
        g = stuck[0]
        waiting = ", ".join(name(i) for i in arrived[g])
        return (f"cyclic wait: {len(stuck)} synchronisations never complete; first: {waiting} waits for "
                f"{size[g] - len(arrived[g])} more member(s) that are blocked themselves (the classes issue "
                "matching communication in a different order)")
    blocked = next(i for i, r in enumerate(remaining) if r > 0)
    return f"cyclic wait: {name(blocked)} never becomes ready (a dependency rule created a cycle)"


def replay_batched(graph: StepGraph, duration_s: np.ndarray, describe: Callable[[int], str] | None = None,
                   host: HostIssue | None = None) -> Replay:
    """The replay in rounds: every node whose predecessors have all ended is released at once (Kahn's
    algorithm, vectorised). Without resources to arbitrate, a node's start is the latest end among its
    predecessors (or its issue by the host), and a synchronisation group's members all start at the
    latest arrival among them, whatever order nodes are released in: the times equal the heap's. Ties
    in `cause` (two predecessors ending at once) may name the other one."""
    n = graph.num_nodes
    ptr, succ, remaining = _csr(graph)
    group, size = graph.sync_group, graph.group_size
    member_order = np.argsort(group, kind="stable")
    member_order = member_order[group[member_order] >= 0]
    member_ptr = np.searchsorted(group[member_order], np.arange(len(size) + 1))
    arrived = np.zeros(len(size), dtype=np.int64)
    arrival = np.zeros(n)
    has_arrived = np.zeros(n, dtype=bool)
    ready = np.zeros(n)
    latest_pred = np.full(n, -1, dtype=np.int64)
    start, end = np.zeros(n), np.zeros(n)
    cause = np.full(n, -1, dtype=np.int64)
    issued = host.first_s if host is not None else np.zeros(n)
    min_end = host.earliest_end(duration_s) if host is not None else np.zeros(n)
    frontier = np.flatnonzero(remaining == 0)
    done = 0
    while len(frontier):
        t = np.maximum(ready[frontier], issued[frontier])
        latest_pred[frontier[issued[frontier] > ready[frontier]]] = HOST
        g = group[frontier]
        grouped = g >= 0
        solo = frontier[~grouped]
        start[solo] = t[~grouped]
        cause[solo] = latest_pred[solo]
        waiting = frontier[grouped]
        arrival[waiting] = t[grouped]
        has_arrived[waiting] = True
        np.add.at(arrived, g[grouped], 1)
        complete = np.unique(g[grouped])
        complete = complete[arrived[complete] == size[complete]]
        if len(complete):  # every member starts at the latest arrival; the last to arrive (highest node on a tie,
            # as the heap pops) is what the others waited for
            members = member_order[_ranges(member_ptr[complete], size[complete])]
            offsets = np.cumsum(size[complete]) - size[complete]
            times = arrival[members]
            latest_time = np.repeat(np.maximum.reduceat(times, offsets), size[complete])
            position = np.where(times == latest_time, np.arange(len(members)), -1)
            last = members[np.maximum.reduceat(position, offsets)]
            start[members] = latest_time
            cause[members] = np.repeat(last, size[complete])
            cause[last] = latest_pred[last]
            released = np.concatenate([solo, members])
        else:
            released = solo
        end[released] = np.maximum(start[released] + duration_s[released], min_end[released])
        done += len(released)
        counts = ptr[released + 1] - ptr[released]
        src = np.repeat(released, counts)
        dst = succ[_ranges(ptr[released], counts)]
        np.maximum.at(ready, dst, end[src])
        latest = end[src] >= ready[dst]
        latest_pred[dst[latest]] = src[latest]
        np.subtract.at(remaining, dst, 1)
        frontier = np.unique(dst[remaining[dst] == 0])
    if done < n:
        members_of = np.split(member_order, member_ptr[1:-1])
        arrived_lists = [m[has_arrived[m]].tolist() for m in members_of]
        raise TimelineError(_deadlock_message(graph, remaining.tolist(), arrived_lists, size.tolist(), describe))
    return Replay(start, end, cause)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [start, start + length) (vectorised)."""
    return np.arange(lengths.sum()) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
