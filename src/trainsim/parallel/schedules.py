"""Pipeline schedules: the order in which one pipeline rank runs forward and backward passes.

An action is (pass, microbatch, chunk): pass 'F' or 'B', chunk the virtual stage on this rank.
* GPipe (Huang et al. 2019): all forwards, then all backwards.
* 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Megatron-LM at scale", sec. 2.2.1): pp - rank - 1
  warm-up forwards, then alternate one forward / one backward, then drain the backwards.
* Interleaved 1F1B (same paper, sec. 2.2.2; Megatron-LM schedules.py
  forward_backward_pipelining_with_interleaving): each rank holds v chunks; micro-batches move
  through chunks in groups of pp; warm-up is (pp - rank - 1) * 2 + (v - 1) * pp.
* With the expert all-to-alls overlapped (parallelism.moe_a2a_overlap; Megatron-Core's combined 1F1B) each
  steady-state backward is `paired` with the forward before it: the two run as one combined pass, interleaved
  layer by layer (workloads/combined_passes.py). Warm-up is one forward more than interleaved 1F1B's; the 1
  makes the pair independent (the last stage would otherwise pair a micro-batch's forward with its own
  backward; with pp = 1 this is Megatron-Core's combined schedule without pipelining). Plain 1F1B gets
  interleaved 1F1B's warm-up with v = 1, 2 (pp - rank - 1) + 1: a combined pass sends its forward's output
  only at its end, so with 1F1B's one micro-batch per stage the next stage would wait for each of this stage's
  passes and this stage for each of the next one's (lockstep, half the rate); two per stage let a stage run a
  pass while its neighbour runs the one before. Megatron-Core combines pipelined passes only interleaved; 1F1B
  is trainsim's extension, held to the same rule.
The real training step and the timeline composer both run these lists, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Action:
    kind: str  # 'F' or 'B'
    microbatch: int
    chunk: int
    paired: bool = False
    """A backward that runs combined with the forward before it (moe_a2a_overlap)."""


def _interleaved_chunk(k: int, pp: int, v: int, forward: bool) -> int:
    chunk = (k // pp) % v
    return chunk if forward else v - 1 - chunk


def _interleaved_microbatch(k: int, pp: int, v: int) -> int:
    return (k // (pp * v)) * pp + k % pp


def pipeline_actions(schedule: str, pp: int, pp_rank: int, num_microbatches: int,
                     virtual_stages: int = 1, a2a_overlap: bool = False) -> list[Action]:
    m, v = num_microbatches, virtual_stages
    if a2a_overlap and schedule == "gpipe":
        raise ValueError(f"schedule {schedule!r} with overlapped all-to-alls; accepted: 1f1b, interleaved-1f1b")
    if schedule == "gpipe":
        return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(2 * (pp - pp_rank - 1) + 1 if a2a_overlap else pp - pp_rank - 1, m)
        actions = [Action("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i, 0), Action("B", i, 0, paired=a2a_overlap)]
        actions += [Action("B", i, 0) for i in range(m - warmup, m)]
        return actions
    if schedule == "interleaved-1f1b":
        total = m * v
        warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp + int(a2a_overlap), total)

        def fwd(k: int) -> Action:
            return Action("F", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, True))

        def bwd(k: int) -> Action:
            return Action("B", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, False))

        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(warmup + k), replace(bwd(k), paired=a2a_overlap)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        return actions
    raise ValueError(f"schedule {schedule!r}; accepted: gpipe, 1f1b, interleaved-1f1b")


def step_actions(par, pp_rank: int) -> list[Action]:
    """The actions of pipeline rank `pp_rank` under a ParallelismConfig's schedule."""
    return pipeline_actions(par.schedule, par.pp, pp_rank, par.num_microbatches, par.virtual_stages,
                            par.moe_a2a_overlap)


def trace_actions(virtual_stages: int, a2a_overlap: bool = False,
                  pairs: list[tuple[int, int]] | None = None) -> list[Action]:
    """What the tracer runs: one micro-batch through every chunk, then back (it is also the last one). With
    overlapped all-to-alls also one combined pass of each (forward chunk, backward chunk) pair of `pairs` (default
    all; combined_pairs gives a schedule's), each on a micro-batch whose forward of that chunk has not run (its
    own) and one whose backward is pending; the plain forward of every chunk is micro-batch 0's (the first) and its
    plain backward the last. `pairs` must take every chunk as often as forward as as backward (whole permutations):
    then a pending backward is always there for the next pair."""
    v = virtual_stages
    if not a2a_overlap:
        return [Action("F", 0, c) for c in range(v)] + [Action("B", 0, c) for c in reversed(range(v))]
    actions = [Action("F", 0, c) for c in range(v)]
    pending = {c: [0] for c in range(v)}  # chunk -> micro-batches whose forward ran and backward has not
    ran = {c: 1 for c in range(v)}  # chunk -> forwards run (micro-batches 0, 1, ... in order)
    todo = list(pairs) if pairs is not None else [(f, b) for f in range(v) for b in range(v)]
    while todo:  # each pair moves one pending micro-batch from its backward's chunk to its forward's
        f, b = next(pair for pair in todo if pending[pair[1]])
        todo.remove((f, b))
        actions += [Action("F", ran[f], f), Action("B", pending[b].pop(0), b, paired=True)]
        pending[f].append(ran[f])
        ran[f] += 1
    return actions + [Action("B", pending[c].pop(0), c) for c in reversed(range(v))]


def combined_pairs(par) -> list[tuple[int, int]]:
    """The (forward chunk, backward chunk) pairs that run combined on any pipeline rank of a ParallelismConfig,
    as whole permutations: in interleaved 1F1B a pair's chunks always add up to one of a few values mod v (the
    warm-up's length in rounds of pp), so each value seen stands for its v pairs (at most 4 v of the v x v)."""
    v = par.virtual_stages
    sums = {(g[0].chunk + g[1].chunk) % v for s in range(par.pp) for g in passes(step_actions(par, s)) if len(g) == 2}
    return [(f, b) for f in range(v) for b in range(v) if (f + b) % v in sums]


def combined_chunk(forward: Action, backward: Action, virtual_stages: int) -> int:
    """The chunk a combined pass is recorded under: its forward's and its backward's in one number (0 with one
    chunk per rank)."""
    return forward.chunk * virtual_stages + backward.chunk


def num_chunks(actions: list[Action]) -> int:
    """The chunks (virtual stages) a rank's actions run through."""
    return 1 + max((a.chunk for a in actions), default=0)


def passes(actions: list[Action]) -> list[tuple[Action, ...]]:
    """The actions grouped as the step runs them: a forward with the paired backward after it is one pass."""
    out: list[tuple[Action, ...]] = []
    for a in actions:
        if a.paired:
            assert out and len(out[-1]) == 1 and out[-1][0].kind == "F", "a paired backward follows a forward"
            out[-1] = (out[-1][0], a)
        else:
            out.append((a,))
    return out


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
