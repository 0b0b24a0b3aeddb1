"""Pipeline schedules: the order in which one pipeline rank runs forward and backward passes.

An action is (pass, microbatch, chunk): pass 'F' or 'B', chunk the virtual stage on this rank.
* GPipe (Huang et al. 2019): all forwards, then all backwards.
* 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Megatron-LM at scale", sec. 2.2.1): pp - rank - 1
  warm-up forwards, then alternate one forward / one backward, then drain the backwards.
* Interleaved 1F1B (same paper, sec. 2.2.2; Megatron-LM schedules.py
  forward_backward_pipelining_with_interleaving): each rank holds v chunks; micro-batches move
  through chunks in groups of pp; warm-up is (pp - rank - 1) * 2 + (v - 1) * pp.
The real training step and the timeline composer both run these lists, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # 'F' or 'B'
    microbatch: int
    chunk: int


def _interleaved_chunk(k: int, pp: int, v: int, forward: bool) -> int:
    chunk = (k // pp) % v
    return chunk if forward else v - 1 - chunk


def _interleaved_microbatch(k: int, pp: int, v: int) -> int:
    return (k // (pp * v)) * pp + k % pp


def pipeline_actions(schedule: str, pp: int, pp_rank: int, num_microbatches: int,
                     virtual_stages: int = 1) -> list[Action]:
    m, v = num_microbatches, virtual_stages
    if schedule == "gpipe":
        return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(pp - pp_rank - 1, m)
        actions = [Action("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i, 0), Action("B", i, 0)]
        actions += [Action("B", i, 0) for i in range(m - warmup, m)]
        return actions
    if schedule == "interleaved-1f1b":
        total = m * v
        warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp, total)

        def fwd(k: int) -> Action:
            return Action("F", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, True))

        def bwd(k: int) -> Action:
            return Action("B", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, False))

        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(warmup + k), bwd(k)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        return actions
    raise ValueError(f"schedule {schedule!r}; accepted: gpipe, 1f1b, interleaved-1f1b")


def trace_actions(virtual_stages: int) -> list[Action]:
    """What the tracer runs: one micro-batch through every chunk, then back (it is also the last one)."""
    return [Action("F", 0, c) for c in range(virtual_stages)] + [
        Action("B", 0, c) for c in reversed(range(virtual_stages))
    ]


def first_forward_microbatch(actions: list[Action]) -> dict[int, int]:
    """Per chunk, the micro-batch whose forward runs first (the overlapped parameter all-gather is issued in it)."""
    first: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            first.setdefault(a.chunk, a.microbatch)
    return first


def last_backward_microbatch(actions: list[Action]) -> dict[int, int]:
    """Per chunk, the micro-batch whose backward runs last (gradient sync is issued during it)."""
    last: dict[int, int] = {}
    for a in actions:
        if a.kind == "B":
            last[a.chunk] = a.microbatch
    return last
