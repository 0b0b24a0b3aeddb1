"""FSDP (zero_stage 2 and 3, PyTorch's FSDP2): what it issues, what it saves, and that it trains like DDP."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.schedules import pipeline_actions
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.train_step import build_rank_model, create_groups, synthetic_batch, train_step

BASE = ("parallelism=dp2", "parallelism.dp=4", "parallelism.global_batch_size=16", "parallelism.precision=bf16")


def _trace(*overrides):
    run = compose_run([*BASE, *overrides], check="layout")
    result = trace_layout(run.model, run.parallelism)
    return run, result.graph.to_pandas(), result.memory.to_pandas().iloc[0]


def _dp_comm(graph: pd.DataFrame) -> pd.DataFrame:
    comm = graph[graph["kind"] == "collective"]
    return comm[comm["group_kind"] == "dp"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_each_block_gathers_its_weights_and_scatters_its_gradients_every_micro_batch(zero_stage):
    run, graph, _ = _trace(f"parallelism.zero_stage={zero_stage}")
    comm = _dp_comm(graph)
    units = run.model.num_layers + 1  # every block and the root (embedding, final norm, output layer)
    gathers = comm[comm["collective"] == "all_gather"]
    scatters = comm[comm["collective"] == "reduce_scatter"]
    assert (gathers["phase"] == "forward").sum() == units
    # ZeRO-3 frees the gathered weights after forward: blocks gather again for backward (the root too)
    assert (gathers["phase"] == "backward").sum() == (units if zero_stage == 3 else 0)
    assert len(scatters) == units and (scatters["phase"] == "backward").all()
    assert comm[comm["phase"] != "optimizer"]["per_microbatch"].all() and comm["async_op"].any()
    assert set(gathers["comm_dtype"]) == {"bf16"} and set(scatters["comm_dtype"]) == {"fp32"}
    # a block's gradients (fp32) are twice its gathered weights (bf16)
    block = gathers["message_bytes"].mode().iloc[0]
    assert (scatters["message_bytes"] == 2 * block).sum() == run.model.num_layers
    # prefetch: the next block's gather is issued before this block's first GEMM
    forward = graph[graph["phase"] == "forward"].reset_index(drop=True)
    first_gemm = forward.index[forward["op"].isin(["aten::mm", "aten::addmm"])][0]
    assert (forward.loc[:first_gemm, "collective"] == "all_gather").sum() >= 2


def test_states_are_sharded_sixteen_bytes_per_parameter():
    _, _, replicated = _trace()
    _, _, sharded = _trace("parallelism.zero_stage=3")
    parameters = replicated["parameter_bytes"] // 2  # bf16 weights
    for field, bytes_per_parameter in (("parameter_bytes", 4), ("gradient_bytes", 4), ("optimizer_state_bytes", 8)):
        expected = bytes_per_parameter * parameters / 4
        assert expected <= sharded[field] < expected * 1.02, field  # FSDP pads each shard
    assert sharded["transient_bytes"] > replicated["transient_bytes"]  # gathered weights and gradients


def test_invalid_settings_name_the_field():
    with pytest.raises(ConfigError, match="zero_stage=3.*precision='fp8'"):
        compose_run(["parallelism=dp2", "parallelism.zero_stage=3", "parallelism.precision=fp8"], check="layout")
    with pytest.raises(ConfigError, match="overlap_param_gather=true.*zero_stage=1.*got 3"):
        compose_run(["parallelism=dp2", "parallelism.zero_stage=3", "parallelism.overlap_param_gather=true"],
                    check="layout")


def _weights_after_two_steps(rank, layout, model_cfg, par):
    groups = create_groups(layout, rank, every_group=True)
    torch.manual_seed(1234)
    rm = build_rank_model(model_cfg, par, rank, groups)
    actions = pipeline_actions(par.schedule, par.pp, layout.position(rank).pp_rank, par.num_microbatches,
                               par.virtual_stages)
    batch = synthetic_batch(model_cfg, par, seed=layout.position(rank).dp_rank)
    for _ in range(2):
        train_step(rm, actions, batch)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in rm.parameters()]
    return torch.cat([p.detach().flatten() for p in full])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_trains_like_replicated_adam(zero_stage):
    base = ["parallelism=dp2", "model.dropout=0", "model.attention_dropout=0"]
    replicated = compose_run(base, check="layout")
    sharded = compose_run([*base, f"parallelism.zero_stage={zero_stage}"], check="layout")
    expected = spawn_ranks(_weights_after_two_steps, replicated.parallelism, replicated.model, replicated.parallelism)
    got = spawn_ranks(_weights_after_two_steps, sharded.parallelism, sharded.model, sharded.parallelism)
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)


def test_layout_search_tries_fsdp_and_prices_its_communication():
    from trainsim.comm.model import CommModel
    from trainsim.search.estimate import estimate_layout
    from trainsim.search.layouts import SearchSpace, enumerate_layouts
    from trainsim.search.slices import PartCost, SliceCosts

    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-tiny", "parallelism=dp2", "parallelism.dp=8",
                       "parallelism.global_batch_size=16", "parallelism.precision=bf16"], check="layout")
    names = [p.name for p in enumerate_layouts(run.model, run.parallelism, run.hardware, 8,
                                               SearchSpace(zero_stages=(0, 3), schedules=("1f1b",)))]
    assert any(n.endswith("-zero3") for n in names) and any(n.endswith("-zero0") for n in names)
    with pytest.raises(ConfigError, match="zero_stages=.*accepted"):
        SearchSpace(zero_stages=(5,))

    def estimate(layer_s: float, **fields):
        layer = PartCost(forward_s=layer_s, backward_s=2 * layer_s, optimizer_s=8e-3, parameter_bytes=2 << 20,
                         gradient_bytes=2 << 20, optimizer_state_bytes=16 << 20)
        costs = SliceCosts(layer=layer, first=PartCost(), last=PartCost(), p2p_message_bytes=0,
                           first_transient_bytes=[0, 0], last_transient_bytes=[0, 0])
        return estimate_layout(costs, run.model, dataclasses.replace(run.parallelism, **fields), run.hardware,
                               CommModel.from_hardware(run.hardware))

    replicated, fsdp = estimate(1e-3, zero_stage=0), estimate(1e-3, zero_stage=3)
    layers = run.model.num_layers
    # 2 + 2 + 16 bytes per parameter replicated; 16 / 8 sharded, plus two layers' weights and one's gradients
    states = layers * (20 << 20) - layers * (16 << 20) // 8
    gathered = 2 * (2 << 20) + 3 * (2 << 20)
    assert replicated.peak_memory_bytes - fsdp.peak_memory_bytes == states - gathered
    assert fsdp.optimizer_s < replicated.optimizer_s  # each rank updates its shard
    # with little compute per layer the gathers and scatters are not hidden
    assert estimate(1e-7, zero_stage=3).pipeline_s > estimate(1e-7, zero_stage=0).pipeline_s


def test_fsdp_copy_ops_are_timed_by_replay():
    from trainsim.profile.replay import build_call

    _, graph, _ = _trace("parallelism.zero_stage=3")
    copies = graph[graph["op"].str.startswith("fsdp::")].drop_duplicates("signature")
    assert set(copies["op"]) == {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat"}
    for row in copies.to_dict("records"):
        build_call(row)()
    copy_in = copies[copies["op"] == "fsdp::all_gather_copy_in"].iloc[0]
    gathered = graph[graph["collective"] == "all_gather"]["message_bytes"].max()
    assert copy_in["bytes_moved"] < gathered  # this rank's shards read and written, not the whole buffer
