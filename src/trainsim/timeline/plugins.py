"""Plug-in points of the composer: pipeline schedules and intra-rank dependency rules.

Register a schedule or a rule under a name, then name it when composing
(`compose_step(..., schedule="my-schedule", rules=("data", "call_point", "blocking_comm", "mine"))`);
the core is never edited. Built-in schedules (config.choices.SCHEDULES) come from `trainsim.parallel.schedules`
(the same lists the real training step runs).

A schedule is `fn(pp, pp_rank, num_microbatches, virtual_stages) -> list[Action]`.
A dependency rule is `fn(ops) -> int array of shape (k, 2)`: edges (earlier op, later op) between
positions of `ops`, the kernels of one pass (a forward or backward of one micro-batch and chunk, or the
optimizer) in program order, with the graph.parquet columns (kind, stream, collective, group_kind, ...)
plus `local_deps` (data dependencies as positions) and `blocking_hint` (see `blocking_hint`).
An edge means the later op cannot start before the earlier one ends.
Streams are FIFO in program order on their own; rules add what crosses streams.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from trainsim.config.choices import SCHEDULES
from trainsim.parallel.schedules import Action, pipeline_actions

ScheduleFn = Callable[[int, int, int, int], list[Action]]
DependencyRule = Callable[[pd.DataFrame], np.ndarray]

_SCHEDULES: dict[str, ScheduleFn] = {}
_RULES: dict[str, DependencyRule] = {}
DEFAULT_RULES = ("data", "call_point", "blocking_comm")


def register_schedule(name: str, fn: ScheduleFn) -> None:
    """Make `name` usable as a pipeline schedule (overrides a built-in of the same name)."""
    _SCHEDULES[name] = fn


def schedule_actions(name: str, pp: int, pp_rank: int, num_microbatches: int, virtual_stages: int,
                     a2a_overlap: bool = False) -> list[Action]:
    if name in _SCHEDULES:
        if a2a_overlap:
            raise ValueError(f"schedule {name!r} is a registered one: overlapped all-to-alls pair the built-in "
                             "1f1b and interleaved-1f1b passes only (parallelism.moe_a2a_overlap=false)")
        return _SCHEDULES[name](pp, pp_rank, num_microbatches, virtual_stages)
    if name in SCHEDULES:
        return pipeline_actions(name, pp, pp_rank, num_microbatches, virtual_stages, a2a_overlap)
    known = sorted({*SCHEDULES, *_SCHEDULES})
    raise ValueError(f"schedule {name!r} is not registered; accepted: {', '.join(known)} "
                     "(add one with trainsim.timeline.register_schedule)")


def register_dependency_rule(name: str, fn: DependencyRule) -> None:
    """Make `name` usable in `rules=`; it adds edges between the ops of each pass."""
    _RULES[name] = fn


def dependency_rule(name: str) -> DependencyRule:
    if name not in _RULES:
        raise ValueError(f"dependency rule {name!r} is not registered; accepted: {', '.join(sorted(_RULES))}")
    return _RULES[name]


def _edges(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    keep = (src >= 0) & (dst >= 0)
    return np.stack([src[keep], dst[keep]], axis=1).astype(np.int64)


def previous_compute(is_compute: np.ndarray) -> np.ndarray:
    """Position of the nearest compute op before each op (-1 if none)."""
    pos = np.where(is_compute, np.arange(len(is_compute)), -1)
    before = np.maximum.accumulate(np.concatenate([[-1], pos[:-1]]))
    return before


def next_compute(is_compute: np.ndarray) -> np.ndarray:
    """Position of the nearest compute op after each op (-1 if none)."""
    n = len(is_compute)
    pos = np.where(is_compute, np.arange(n), n)
    after = np.minimum.accumulate(np.concatenate([pos[1:], [n]])[::-1])[::-1]
    return np.where(after < n, after, -1)


def call_point_rule(ops: pd.DataFrame) -> np.ndarray:
    """A communication or copy op is enqueued after the compute issued before it in program order
    (ProcessGroupNCCL makes its stream wait for the current stream before each collective)."""
    is_compute = (ops["kind"] == "compute").to_numpy()
    prev = previous_compute(is_compute)
    idx = np.arange(len(ops))
    mask = ~is_compute
    return _edges(prev[mask], idx[mask])


def blocking_comm_rule(ops: pd.DataFrame) -> np.ndarray:
    """Compute issued after a synchronous call waits for it: `work.wait()` of a blocking recv or of a
    collective called without async_op makes the compute stream wait (default: every recv and every
    collective outside the DP group; DP gradient buckets are async and waited for through data deps)."""
    blocking = ops["blocking_hint"].to_numpy(dtype=bool)
    nxt = next_compute((ops["kind"] == "compute").to_numpy())
    idx = np.arange(len(ops))
    return _edges(idx[blocking], nxt[blocking])


def data_rule(ops: pd.DataFrame) -> np.ndarray:
    """The trace's data dependencies inside the pass (`local_deps`: positions of the last writers of
    every storage an op reads, views and allocations already looked through)."""
    deps = ops["local_deps"].to_list()
    counts = np.fromiter((len(d) for d in deps), dtype=np.int64, count=len(deps))
    if not counts.sum():
        return np.zeros((0, 2), dtype=np.int64)
    src = np.concatenate([np.asarray(d, dtype=np.int64) for d in deps])
    return _edges(src, np.repeat(np.arange(len(deps)), counts))


def blocking_hint(ops: pd.DataFrame) -> np.ndarray:
    """Default sync semantics: recvs and non-DP collectives are blocking calls; sends and DP buckets async,
    and so is whatever the trace marks async_op (ring-exchange isend/irecv, waited for through data deps)."""
    recv = ops["collective"].to_numpy() == "recv"
    coll = (ops["kind"] == "collective").to_numpy() & (ops["group_kind"].to_numpy() != "dp")
    asynchronous = ops["async_op"].to_numpy(dtype=bool) if "async_op" in ops else np.zeros(len(ops), dtype=bool)
    return (recv | coll) & ~asynchronous


register_dependency_rule("data", data_rule)
register_dependency_rule("call_point", call_point_rule)
register_dependency_rule("blocking_comm", blocking_comm_rule)

BUILTIN_RULES = {"data": data_rule, "call_point": call_point_rule, "blocking_comm": blocking_comm_rule}


def replaced_builtins() -> bool:
    """True once a registered schedule or rule stands in for a built-in one: a timeline composed before, with
    the built-ins, then no longer shows what composing would (pipeline.timeline_is_current composes again)."""
    return any(name in _SCHEDULES for name in SCHEDULES) or \
        any(_RULES.get(name) is not fn for name, fn in BUILTIN_RULES.items())
