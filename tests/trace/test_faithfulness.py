"""The ex-situ trace equals what really runs: same ops, same collectives, same order, per rank."""

from __future__ import annotations

from functools import partial

import pandas as pd
import pytest

from trainsim.config import compose_run
from trainsim.parallel.schedules import pipeline_actions
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step, rename_for_rank
from trainsim.trace.recorder import ExecutionRecorder
from trainsim.workloads.launch import run_real_step
from trainsim.workloads.train_step import layout_of

SMALL_LLAMA = ["model=llama3-8b", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=8",
               "model.num_kv_heads=4", "model.ffn_hidden_size=256", "model.seq_length=64", "model.vocab_size=512"]
COMM = ["collective", "group_ranks", "message_bytes", "comm_dtype", "peer"]


def _comm_rows(events: pd.DataFrame) -> list[tuple]:
    comm = events[events["kind"].isin(["collective", "p2p"])]
    return [(c, tuple(g), int(b), d, int(p)) for c, g, b, d, p in comm[COMM].itertuples(index=False)]


def _same_work_as_traced_rank(recorded: pd.DataFrame, expected: pd.DataFrame) -> None:
    """A context-parallel rank other than the traced one attends over other blocks of the sequence: the same
    attention work in blocks of other shapes (ring: a 2c x c block where the traced rank has c x 2c; all-gather:
    the first rank's first chunk has no earlier keys, one block less), so the merges of the blocks' results
    differ in size and number. Everything else is the same kernels in the same order."""
    mine, traced = recorded[~recorded["no_kernel"]], expected[~expected["no_kernel"]]
    attention = [frame["op"].str.contains("scaled_dot_product") for frame in (mine, traced)]
    assert attention[0].any()
    assert mine["flops"][attention[0]].sum() == traced["flops"][attention[1]].sum()
    assert mine["flops"].sum() == pytest.approx(traced["flops"].sum(), rel=0.05)
    outside = [frame[~frame["op"].isin(RING_MERGE_OPS) & ~att] for frame, att in zip((mine, traced), attention)]
    assert list(outside[0]["op"]) == list(outside[1]["op"])


RING_MERGE_OPS = ("aten::logaddexp", "aten::sub.Tensor", "aten::exp", "aten::mul_.Tensor", "aten::mul.Tensor",
                  "aten::add_.Tensor", "aten::copy_", "aten::zeros", "aten::zero_", "aten::fill_")


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
    pytest.param(["parallelism=dp2", "parallelism.precision=bf16", "parallelism.grad_reduce_in_fp32=true"],
                 id="dp2-bf16-fp32-gradients"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=1", "parallelism.precision=bf16",
                  "parallelism.grad_reduce_in_fp32=true", "parallelism.dp_bucket_size_bytes=200000"],
                 id="zero1-bf16-fp32-gradients"),
    ["parallelism=tp2"],
    ["parallelism=tp2", "parallelism.sequence_parallel=true"],
    ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"],
    ["parallelism=tp2", "model.attention=unfused", "model.attention_dropout=0.1", "model.dropout=0.1"],
    ["parallelism=pp2"],
    ["parallelism=pp2", "parallelism.micro_batch_size=1"],
    ["parallelism=pp2", "model.num_layers=3", "parallelism.last_stage_layers=1"],
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
    pytest.param(["parallelism=tp2", "parallelism.precision=fp8", "parallelism.fp8_recipe=mxfp8",
                  "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"],
                 id="tp2-sp-overlap-mxfp8"),
    pytest.param(["parallelism=tp2", "parallelism.precision=fp4", "parallelism.sequence_parallel=true",
                  "parallelism.tp_comm_overlap=true"], id="tp2-sp-overlap-nvfp4"),
    pytest.param(["parallelism=tp2", "parallelism.precision=fp8", "parallelism.fp8_recipe=blockwise",
                  "model.hidden_size=256", "model.seq_length=128"], id="tp2-blockwise"),
    pytest.param(["parallelism=cp2"], id="cp2-ring"),
    pytest.param(["parallelism=cp2", "parallelism.cp_comm_type=all_gather", "parallelism.recompute=selective"],
                 id="cp2-all-gather-selective"),
    pytest.param(["parallelism=cp2", "parallelism.tp=2", "parallelism.sequence_parallel=true",
                  "parallelism.zero_stage=1", "hardware.devices_per_node=4", "model=llama3-8b", "model.num_layers=2",
                  "model.hidden_size=128", "model.num_attention_heads=8", "model.num_kv_heads=4",
                  "model.ffn_hidden_size=256", "model.seq_length=64", "model.vocab_size=512"],
                 id="cp2-tp2-sp-zero1-llama"),
    pytest.param(["framework=torchtitan", "parallelism=tp2", "parallelism.sequence_parallel=true",
                  "parallelism.recompute=op", *SMALL_LLAMA], id="torchtitan-tp2-sp-op-checkpoint"),
    pytest.param(["framework=torchtitan", "parallelism=dp2", "parallelism.zero_stage=3", "parallelism.precision=fp8",
                  "parallelism.fp8_recipe=current", "parallelism.recompute=op", *SMALL_LLAMA],
                 id="torchtitan-fsdp2-fp8-op-checkpoint"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=3", "parallelism.precision=bf16"], id="fsdp2-zero3"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=2", "parallelism.recompute=full"],
                 id="fsdp2-zero2-full-recompute"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=3", "parallelism.precision=bf16", "parallelism.pp=2",
                  "parallelism.tp=2", "parallelism.sequence_parallel=true", "parallelism.global_batch_size=8",
                  "hardware.devices_per_node=8"], id="fsdp2-tp2-sp-pp2"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=3", "parallelism.precision=fp8"], id="fsdp2-zero3-fp8"),
    pytest.param(["parallelism=dp2", "parallelism.zero_stage=2", "parallelism.precision=fp8",
                  "parallelism.fp8_recipe=current", "parallelism.fp8_param_gather=true"], id="fsdp2-zero2-fp8-gather"),
    pytest.param(["parallelism=dp2", "parallelism.dp=2", "parallelism.tp=2", "parallelism.sequence_parallel=true",
                  "parallelism.zero_stage=3", "parallelism.precision=fp8", "parallelism.fp8_param_gather=true",
                  "parallelism.global_batch_size=4", "hardware.devices_per_node=4"], id="fsdp2-tp2-sp-fp8-gather"),
    pytest.param(["parallelism=dp2", "parallelism.dp=4", "parallelism.dp_shard_size=2", "parallelism.zero_stage=3",
                  "parallelism.precision=bf16", "parallelism.global_batch_size=8", "hardware.devices_per_node=4"],
                 id="hsdp2x2-zero3"),
    pytest.param(["parallelism=dp2", "parallelism.dp=4", "parallelism.dp_shard_size=2", "parallelism.zero_stage=1",
                  "parallelism.precision=bf16", "parallelism.global_batch_size=8", "hardware.devices_per_node=4"],
                 id="zero1-two-instances"),
    pytest.param(["parallelism=cp2", "parallelism.zero_stage=3", "parallelism.precision=bf16"], id="fsdp2-cp2"),
])
def test_real_gloo_step_matches_ex_situ_trace(overrides):
    run = compose_run(overrides)
    par = run.parallelism
    layout = layout_of(par)
    graph = trace_layout(run.model, par).graph.to_pandas()
    real = run_real_step(run.model, par, recorder=partial(ExecutionRecorder, time_ops=True))
    assert "wall_s" not in graph.columns  # op times are kept in real runs only
    assert len(real) == par.world_size
    for rank_run in real:
        pos = layout.position(rank_run.rank)
        actions = pipeline_actions(par.schedule, par.pp, pos.pp_rank, par.num_microbatches, par.virtual_stages)
        expected = rename_for_rank(expand_step(graph[graph["rank_class"] == pos.pp_rank], actions), layout,
                                   layout.stage_representative(pos.pp_rank), rank_run.rank)
        recorded = pd.DataFrame(rank_run.events)
        assert _comm_rows(recorded) == _comm_rows(expected), f"collectives of rank {rank_run.rank} differ"
        if pos.cp_rank == 0:
            assert _op_rows(recorded) == _op_rows(expected), f"ops of rank {rank_run.rank} differ"
        else:
            _same_work_as_traced_rank(recorded, expected)
        assert rank_run.step_seconds[0] > 0
        assert (recorded["wall_s"] >= 0).all() and recorded["wall_s"].sum() > 0
