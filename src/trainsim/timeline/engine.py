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


def successors(graph: StepGraph) -> tuple[list[int], list[int], list[int], list[int]]:
    """CSR (pointer, successor) lists, predecessor counts and the initially ready nodes, once per graph."""
    n = graph.num_nodes
    order = np.argsort(graph.src, kind="stable")
    succ = graph.dst[order]
    ptr = np.searchsorted(graph.src[order], np.arange(n + 1))
    npred = np.bincount(graph.dst, minlength=n)
    return ptr.tolist(), succ.tolist(), npred.tolist(), np.flatnonzero(npred == 0).tolist()


def replay(graph: StepGraph, duration_s: np.ndarray, csr=None,
           describe: Callable[[int], str] | None = None, host: HostIssue | None = None) -> Replay:
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
