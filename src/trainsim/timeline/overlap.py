"""Overlap slowdown: compute that runs while communication runs on the same rank gets slower.

Echo (sec. 3): t = (1 - r) * t0 + r * t0 * (1 + s), with r the fraction of the kernel that overlaps
communication and s the slowdown the learned model predicts for that (kernel, collective) pair.
r is the fraction of the kernel's *work* done while communication runs: a replay shows o seconds of
overlap, during which the kernel advances at 1 / (1 + s) of its solo speed, so r = min(1, o / (t0 (1 + s)))
and t = t0 + r t0 s (= t0 + o s / (1 + s) when partly overlapped, t0 (1 + s) when fully).
Stretching kernels moves everything after them and can change what overlaps, so the composer
replays, recomputes r and s, and replays again until the timeline is stable.
Interval arithmetic here is vectorised (merged unions, cumulative coverage, searchsorted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainsim.timeline.costs import SlowdownEstimate
from trainsim.timeline.program import BLOCK, COLLECTIVE, COMPUTE, RECV, SEND


def merged(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted disjoint (start, end) arrays."""
    keep = end > start
    start, end = start[keep], end[keep]
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    start, end = start[order], np.maximum.accumulate(end[order])
    new = np.concatenate([[True], start[1:] > end[:-1]])
    group = np.cumsum(new) - 1
    last = np.concatenate([np.flatnonzero(new)[1:] - 1, [len(start) - 1]])
    return start[new], end[last][: group[-1] + 1]


def covered(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Length of the union (a, b) inside [-inf, x], for each x."""
    x = np.asarray(x, dtype=float)
    if not len(a):
        return np.zeros_like(x)
    cum = np.concatenate([[0.0], np.cumsum(b - a)])
    k = np.searchsorted(a, x, side="right") - 1
    kk = np.maximum(k, 0)
    inside = cum[kk] + np.clip(x - a[kk], 0.0, b[kk] - a[kk])
    return np.where(k >= 0, inside, 0.0)


def overlap_of(a: np.ndarray, b: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Length of each [start, end] covered by the union (a, b)."""
    return covered(a, b, end) - covered(a, b, start)


def is_compute_kind(kind: np.ndarray) -> np.ndarray:
    return (kind == COMPUTE) | (kind == BLOCK)


def is_comm_kind(kind: np.ndarray) -> np.ndarray:
    return (kind == COLLECTIVE) | (kind == SEND) | (kind == RECV)


def overlapped(cls: np.ndarray, kind: np.ndarray, start: np.ndarray, end: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, partner) per node: how long each compute node overlaps its class's communication, and
    the communication node that overlaps it (of those started before its end, the one ending last)."""
    r = np.zeros(len(cls))
    partner = np.full(len(cls), -1, dtype=np.int64)
    comp, comm = is_compute_kind(kind), is_comm_kind(kind) & (end > start)
    order = np.argsort(cls, kind="stable")
    bounds = np.searchsorted(cls[order], np.arange(int(cls.max()) + 2)) if len(cls) else [0]
    for c in range(len(bounds) - 1):
        idx = order[bounds[c]:bounds[c + 1]]
        q = idx[comm[idx]]
        p = idx[comp[idx] & (end[idx] > start[idx])]
        if not len(q) or not len(p):
            continue
        a, b = merged(start[q], end[q])
        r[p] = overlap_of(a, b, start[p], end[p])
        q = q[np.argsort(start[q], kind="stable")]
        ends = end[q]
        running_max = np.maximum.accumulate(ends)
        longest = np.maximum.accumulate(np.where(ends >= running_max, np.arange(len(q)), 0))
        k = np.searchsorted(start[q], end[p], side="left") - 1
        hit = (k >= 0) & (r[p] > 0)
        partner[p[hit]] = q[longest[np.maximum(k[hit], 0)]]
    return r, partner


@dataclass
class SlowdownCache:
    """s per (compute template node, communication template node), asked of the model once per pair.

    A block's s is the duration-weighted mean of its kernels' slowdowns.
    """

    estimate: SlowdownEstimate
    compute_features: Callable[[int], dict]
    """template node -> columns op, flops, bytes_moved, duration_s of its compute kernels."""
    comm_features: Callable[[int], dict]

    def __post_init__(self) -> None:
        self.known: dict[tuple[int, int], float] = {}

    def lookup(self, compute_tnode: np.ndarray, comm_tnode: np.ndarray) -> np.ndarray:
        pairs = list(zip(compute_tnode.tolist(), comm_tnode.tolist()))
        missing = sorted({p for p in pairs if p not in self.known})
        if missing:
            parts = [self.compute_features(ct) for ct, _ in missing]
            sizes = [len(f["duration_s"]) for f in parts]
            compute = pd.DataFrame({k: np.concatenate([f[k] for f in parts]) for k in parts[0]})
            comm_rows = [self.comm_features(qt) for _, qt in missing]
            comm = pd.DataFrame({k: np.repeat([row[k] for row in comm_rows], sizes) for k in comm_rows[0]})
            s = np.asarray(self.estimate.slowdown(compute, comm), dtype=float)
            owners = [np.full(n, i) for i, n in enumerate(sizes)]
            owner = np.concatenate(owners)
            weight = np.maximum(compute["duration_s"].to_numpy(dtype=float), 1e-12)
            mean = np.bincount(owner, weights=s * weight, minlength=len(missing)) / np.maximum(
                np.bincount(owner, weights=weight, minlength=len(missing)), 1e-300)
            self.known.update(zip(missing, np.clip(mean, 0.0, None).tolist()))
        return np.asarray([self.known[p] for p in pairs], dtype=float)
