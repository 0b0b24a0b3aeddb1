"""Rank placement and pipeline schedules: the orders every later stage relies on."""

from __future__ import annotations

import pytest

from trainsim.parallel.layout import Layout
from trainsim.parallel.pipeline_split import pipeline_split
from trainsim.parallel.schedules import pipeline_actions


def test_uneven_pipeline_split_fixes_first_and_last_and_shares_the_rest():
    assert pipeline_split(61, 16, last=1).stage_layer_counts() == [4] * 15 + [1]  # DeepSeek-V3 on 16 stages
    assert pipeline_split(10, 4, first=1, last=3).stage_layer_counts() == [1, 3, 3, 3]
    assert pipeline_split(8, 4).stage_layer_counts() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="middle stages, 8, must be divisible by the 3 middle"):
        pipeline_split(10, 4, first=2)
    split = pipeline_split(61, 16, last=1)
    assert sum((list(split.layers(stage, 0)) for stage in range(16)), []) == list(range(61))
    # interleaved: chunk c of stage s holds virtual stage c * pp + s
    assert list(pipeline_split(8, 2, 2).layers(1, 1)) == [6, 7]


def test_megatron_rank_order_tp_fastest_then_dp_then_pp():
    layout = Layout(dp=2, tp=4, pp=3)
    assert layout.group_ranks(0, "tp") == [0, 1, 2, 3]
    assert layout.group_ranks(5, "dp") == [1, 5]
    assert layout.group_ranks(5, "pp") == [5, 13, 21]
    for rank in range(layout.world_size):
        p = layout.position(rank)
        assert layout.rank_of(p.dp_rank, p.tp_rank, p.pp_rank) == rank
    assert sorted(r for g in layout.all_groups("dp") for r in g) == list(range(24))


def _check_dependencies(actions, m, v):
    done = set()
    for a in actions:
        if a.kind == "B":
            assert ("F", a.microbatch, a.chunk) in done, f"backward before forward: {a}"
        done.add((a.kind, a.microbatch, a.chunk))
    assert len(done) == 2 * m * v == len(actions)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_every_microbatch_runs_forward_then_backward_once(schedule, v):
    for rank in range(4):
        _check_dependencies(pipeline_actions(schedule, 4, rank, 8, v), 8, v)


@pytest.mark.parametrize("schedule, v, pp, m", [("1f1b", 1, 1, 4), ("1f1b", 1, 4, 8), ("1f1b", 1, 4, 3),
                                                 ("interleaved-1f1b", 2, 4, 8), ("interleaved-1f1b", 3, 2, 4)])
def test_overlapped_schedules_pair_independent_passes_and_keep_each_stage_busy(schedule, v, pp, m):
    """Steady-state backwards pair with the forward before them; the warm-up is one forward longer than the
    schedule's own (interleaved: Megatron-Core's combined 1F1B; 1F1B: interleaved's rule with v = 1)."""
    from trainsim.parallel.schedules import passes

    for rank in range(pp):
        actions = pipeline_actions(schedule, pp, rank, m, v, a2a_overlap=True)
        _check_dependencies(actions, m, v)
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
        assert not any(a.kind == "B" for a in actions[:warmup])
        groups = passes(actions)
        pairs = [g for g in groups if len(g) == 2]
        assert len(pairs) == m * v - warmup
        # a forward never pairs with the backward it feeds (its own micro-batch on this chunk, or a later chunk's)
        assert all((f.microbatch, f.chunk) != (b.microbatch, b.chunk) for f, b in pairs)
        assert len(groups[0]) == 1 and len(groups[-1]) == 1  # the first forward and the last backward run alone
    with pytest.raises(ValueError, match="accepted: 1f1b, interleaved-1f1b"):
        pipeline_actions("gpipe", 2, 0, 4, 1, a2a_overlap=True)


@pytest.mark.parametrize("v, pp, m", [(1, 4, 8), (2, 2, 4), (3, 2, 4), (8, 4, 16)])
def test_overlapped_trace_runs_each_pair_of_chunks_the_schedule_combines_once(v, pp, m):
    """The tracer's actions: each chunk's plain forward first (micro-batch 0) and plain backward last, one combined
    pass of every (forward chunk, backward chunk) pair some rank's schedule combines (whole permutations of the
    chunks: with 8 chunks 32 of the 64 pairs), every backward after its own forward."""
    from types import SimpleNamespace

    from trainsim.parallel.schedules import combined_pairs, passes, step_actions, trace_actions

    par = SimpleNamespace(schedule="1f1b" if v == 1 else "interleaved-1f1b", pp=pp, virtual_stages=v,
                          num_microbatches=m, moe_a2a_overlap=True)
    pairs = combined_pairs(par)
    scheduled = {(g[0].chunk, g[1].chunk) for s in range(pp) for g in passes(step_actions(par, s)) if len(g) == 2}
    assert scheduled <= set(pairs) and len(pairs) == len(set(pairs)) <= 4 * v
    actions = trace_actions(v, a2a_overlap=True, pairs=pairs)
    groups = passes(actions)
    assert sorted((f.chunk, b.chunk) for f, b in (g for g in groups if len(g) == 2)) == sorted(pairs)
    plain = [g[0] for g in groups if len(g) == 1]
    assert [(a.kind, a.chunk) for a in plain] == [("F", c) for c in range(v)] + [("B", c) for c in reversed(range(v))]
    assert all(a.microbatch == 0 for a in plain[:v])
    pending = set()
    for a in actions:
        if a.kind == "F":
            assert (a.microbatch, a.chunk) not in pending
            pending.add((a.microbatch, a.chunk))
        else:
            pending.remove((a.microbatch, a.chunk))  # (raises where the forward has not run)
    assert not pending  # every forward's backward ran


def _max_in_flight(actions):
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_bounds_in_flight_microbatches_gpipe_does_not():
    pp, m = 4, 8
    for rank in range(pp):
        assert _max_in_flight(pipeline_actions("1f1b", pp, rank, m)) == pp - rank
        assert _max_in_flight(pipeline_actions("gpipe", pp, rank, m)) == m


def test_interleaved_warmup_matches_megatron():
    # Megatron: warmup = (pp - rank - 1) * 2 + (v - 1) * pp forward chunks before the first backward
    pp, v, m = 4, 2, 8
    for rank in range(pp):
        actions = pipeline_actions("interleaved-1f1b", pp, rank, m, v)
        first_backward = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert first_backward == (pp - rank - 1) * 2 + (v - 1) * pp + 1
        assert actions[first_backward].chunk == v - 1
