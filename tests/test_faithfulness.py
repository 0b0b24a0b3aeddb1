"""The ex-situ trace equals what really runs: same ops, same collectives, same order, per rank."""

from __future__ import annotations

import pandas as pd
import pytest

from trainsim.config import compose_run
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step, rename_for_rank
from trainsim.workloads.launch import run_real_step
from trainsim.workloads.schedules import pipeline_actions
from trainsim.workloads.train_step import layout_of

COMM = ["collective", "group_ranks", "message_bytes", "comm_dtype", "peer"]


def _comm_rows(events: pd.DataFrame) -> list[tuple]:
    comm = events[events["kind"].isin(["collective", "p2p"])]
    return [(c, tuple(g), int(b), d, int(p)) for c, g, b, d, p in comm[COMM].itertuples(index=False)]


def _op_rows(events: pd.DataFrame) -> list[tuple]:
    """What a kernel's time depends on: op, shapes, strides and dtypes (the signature also holds scalar
    arguments, which differ by rank and step: a tensor-parallel rank's vocabulary offset, Adam's step)."""
    return list(zip(events["op"], events["input_shapes"], events["input_strides"], events["input_dtypes"]))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["parallelism=dp2"],
    ["parallelism=dp2", "parallelism.zero_stage=1"],
    ["parallelism=dp2", "parallelism.zero_stage=1", "parallelism.overlap_param_gather=true",
     "parallelism.precision=bf16", "parallelism.dp_bucket_size_bytes=200000"],
    ["parallelism=tp2"],
    ["parallelism=tp2", "parallelism.sequence_parallel=true"],
    ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"],
    ["parallelism=tp2", "model.attention=unfused", "model.attention_dropout=0.1", "model.dropout=0.1"],
    ["parallelism=pp2"],
    ["parallelism=pp2", "parallelism.micro_batch_size=1"],
    ["parallelism=pp2-interleaved"],
    ["parallelism=pp2", "parallelism.pp=4", "parallelism.global_batch_size=8", "hardware.devices_per_node=4"],
    pytest.param(["parallelism=tp2", "parallelism.precision=fp8"], id="tp2-fp8"),
    pytest.param(["parallelism=dp2", "parallelism.tp=2", "parallelism.precision=fp8", "parallelism.global_batch_size=8",
                  "hardware.devices_per_node=4"], id="dp2-tp2-fp8"),
    pytest.param(["parallelism=tp2", "parallelism.precision=fp8", "parallelism.fp8_recipe=current",
                  "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"],
                 id="tp2-sp-overlap-fp8-current"),
    pytest.param(["parallelism=tp2", "parallelism.precision=fp8", "parallelism.sequence_parallel=true",
                  "parallelism.tp_comm_overlap=true", "parallelism.recompute=full"],
                 id="tp2-sp-overlap-full-recompute-fp8"),
])
def test_real_gloo_step_matches_ex_situ_trace(overrides):
    run = compose_run(overrides)
    par = run.parallelism
    layout = layout_of(par)
    graph = trace_layout(run.model, par).graph.to_pandas()
    real = run_real_step(run.model, par, record=True, time_ops=True)
    assert "wall_s" not in graph.columns  # op times are kept in real runs only
    assert len(real) == par.world_size
    for rank_run in real:
        pos = layout.position(rank_run.rank)
        actions = pipeline_actions(par.schedule, par.pp, pos.pp_rank, par.num_microbatches, par.virtual_stages)
        expected = rename_for_rank(expand_step(graph[graph["rank_class"] == pos.pp_rank], actions), layout,
                                   layout.stage_representative(pos.pp_rank), rank_run.rank)
        recorded = pd.DataFrame(rank_run.events)
        assert _comm_rows(recorded) == _comm_rows(expected), f"collectives of rank {rank_run.rank} differ"
        assert _op_rows(recorded) == _op_rows(expected), f"ops of rank {rank_run.rank} differ"
        assert rank_run.step_seconds[0] > 0
        assert (recorded["wall_s"] >= 0).all() and recorded["wall_s"].sum() > 0
