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
from trainsim.workloads.optimizer import MixedPrecisionAdamW
from trainsim.workloads.train_step import build_rank_model, create_groups, synthetic_batch, train_step

BASE = ("parallelism=dp2", "parallelism.dp=4", "parallelism.global_batch_size=16", "parallelism.precision=bf16")


def _trace(*overrides):
    run = compose_run([*BASE, *overrides], check="layout")
    result = trace_layout(run.model, run.parallelism)
    return run, result.graph.to_pandas(), result.memory.to_pandas().iloc[0]


def _dp_comm(graph: pd.DataFrame) -> pd.DataFrame:
    comm = graph[graph["kind"] == "collective"]
    return comm[comm["group_kind"] == "dp"]


@pytest.mark.parametrize("zero_stage, in_fp32", [(2, True), (3, True), (3, False)])
def test_each_block_gathers_its_weights_and_scatters_its_gradients_every_micro_batch(zero_stage, in_fp32):
    run, graph, _ = _trace(f"parallelism.zero_stage={zero_stage}", f"parallelism.grad_reduce_in_fp32={in_fp32}")
    comm = _dp_comm(graph)
    units = run.model.num_layers + 1  # every block and the root (embedding, final norm, output layer)
    gathers = comm[comm["collective"] == "all_gather"]
    scatters = comm[comm["collective"] == "reduce_scatter"]
    assert (gathers["phase"] == "forward").sum() == units
    # ZeRO-3 frees the gathered weights after forward: blocks gather again for backward (the root too)
    assert (gathers["phase"] == "backward").sum() == (units if zero_stage == 3 else 0)
    assert len(scatters) == units and (scatters["phase"] == "backward").all()
    assert comm[comm["phase"] != "optimizer"]["per_microbatch"].all() and comm["async_op"].any()
    # gradients reduce in fp32 (torchtitan's mixed_precision_reduce) or in the weights' dtype (FSDP2's default,
    # Megatron-FSDP's bf16 main gradients)
    assert set(gathers["comm_dtype"]) == {"bf16"} and set(scatters["comm_dtype"]) == {"fp32" if in_fp32 else "bf16"}
    block = gathers["message_bytes"].mode().iloc[0]
    assert (scatters["message_bytes"] == (2 if in_fp32 else 1) * block).sum() == run.model.num_layers
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


def _fp8_casts(graph: pd.DataFrame) -> pd.DataFrame:
    casts = graph[(graph["op"] == "aten::mul.out") & graph["input_dtypes"].astype(str).str.contains("float8")]
    assert len(casts)
    return casts


def test_fsdp_with_fp8_casts_the_gathered_weights_at_every_use():
    """FSDP frees a block's weights between uses: the FP8 copies cannot be kept from the first micro-batch, so every
    cast is per micro-batch (without FSDP the weight casts happen once per step) and none is held as a state."""
    _, replicated, replicated_memory = _trace("parallelism.precision=fp8")
    _, sharded, sharded_memory = _trace("parallelism.precision=fp8", "parallelism.zero_stage=3")
    assert not _fp8_casts(replicated)["per_microbatch"].all()
    assert _fp8_casts(sharded)["per_microbatch"].all()
    parameters = replicated_memory["parameter_bytes"] // 2  # bf16 weights, plus FP8 copies held for the step
    assert sharded_memory["parameter_bytes"] < 1.02 * 4 * parameters / 4  # the fp32 shards alone
    # nor between a block's forward and its backward (which casts the gathered weight again)
    _, _, bf16_memory = _trace("parallelism.precision=bf16", "parallelism.zero_stage=3")
    assert sharded_memory["transient_bytes"] <= bf16_memory["transient_bytes"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_fp8_param_gather_halves_the_blocks_gathers(zero_stage):
    run, bf16, bf16_memory = _trace("parallelism.precision=fp8", f"parallelism.zero_stage={zero_stage}")
    _, fp8, fp8_memory = _trace("parallelism.precision=fp8", f"parallelism.zero_stage={zero_stage}",
                                "parallelism.fp8_param_gather=true")
    gathers = [_dp_comm(g)[_dp_comm(g)["collective"] == "all_gather"].reset_index(drop=True) for g in (bf16, fp8)]
    assert len(gathers[0]) == len(gathers[1])
    blocks = gathers[1]["comm_dtype"] == "uint8"
    assert blocks.sum() == len(gathers[1]) - (1 + (zero_stage == 3))  # all but the root's (embedding, output layer)
    assert (gathers[1]["message_bytes"][blocks] * 2 == gathers[0]["message_bytes"][blocks]).all()
    assert (gathers[1]["message_bytes"][~blocks] == gathers[0]["message_bytes"][~blocks]).all()
    # one amax all-reduce per step (for the next step's scales), the shard cast before each block's gather
    optimizer = _dp_comm(fp8)[_dp_comm(fp8)["phase"] == "optimizer"]
    assert (optimizer["collective"] == "all_reduce").sum() == 2  # the amaxes and the gradient norm
    assert len(_fp8_casts(fp8)) > len(_fp8_casts(bf16))
    assert fp8_memory["transient_bytes"] < bf16_memory["transient_bytes"]  # the gathered blocks held in FP8


def test_hsdp_shards_over_part_of_the_replicas_and_all_reduces_across_them():
    """dp 4 as 2 replicas x 2 shards: gathers and reduce-scatters within a shard group of 2 ranks, each scattered
    gradient all-reduced over the 2 replicas; the state is split over 2 ranks, twice a 4-way shard."""
    _, full, full_memory = _trace("parallelism.zero_stage=3")
    _, hsdp, hsdp_memory = _trace("parallelism.zero_stage=3", "parallelism.dp_shard_size=2")
    comm = hsdp[hsdp["kind"] == "collective"]
    shard, replicate = comm[comm["group_kind"] == "dp_shard"], comm[comm["group_kind"] == "dp_replicate"]
    assert set(shard["group_ranks"].map(tuple)) == {(0, 1)} and set(replicate["group_ranks"].map(tuple)) == {(0, 2)}
    scatters = shard[shard["collective"] == "reduce_scatter"]
    assert len(scatters) == len(full[(full["collective"] == "reduce_scatter")])
    assert list(replicate["collective"]) == ["all_reduce"] * len(scatters)
    assert (replicate["message_bytes"].to_numpy() * 2 == scatters["message_bytes"].to_numpy()).all()
    for field in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert hsdp_memory[field] == pytest.approx(2 * full_memory[field], rel=0.02), field


def test_distributed_optimizer_instances_reduce_scatter_then_all_reduce_the_slice():
    _, one, one_memory = _trace("parallelism.zero_stage=1")
    _, two, two_memory = _trace("parallelism.zero_stage=1", "parallelism.dp_shard_size=2")
    comm = two[two["kind"] == "collective"]
    scatters = comm[comm["collective"] == "reduce_scatter"]
    assert set(scatters["group_kind"]) == {"dp_shard"}
    replicate = comm[comm["group_kind"] == "dp_replicate"]
    assert list(replicate["collective"]) == ["all_reduce"] * len(scatters)
    assert (replicate["message_bytes"].to_numpy() * 2 == scatters["message_bytes"].to_numpy()).all()
    assert set(comm[comm["collective"] == "all_gather"]["group_kind"]) == {"dp_shard"}
    assert two_memory["optimizer_state_bytes"] == pytest.approx(2 * one_memory["optimizer_state_bytes"], rel=0.02)


def test_shard_and_replicate_groups_cut_the_data_parallel_group():
    from trainsim.parallel.layout import Layout

    layout = Layout(dp=4, tp=2, pp=1, cp=2, dp_shard=4)  # dp group of rank 0: ranks 0 2 4 ... 14 (cp fastest)
    assert layout.group_ranks(0, "dp") == [0, 2, 4, 6, 8, 10, 12, 14]
    assert layout.group_ranks(6, "dp_shard") == [0, 2, 4, 6]  # consecutive in the dp group: dp_shard x cp
    assert layout.group_ranks(6, "dp_replicate") == [6, 14]
    assert layout.group_ranks(9, "dp_shard") == [9, 11, 13, 15]
    whole = Layout(dp=4, tp=1, pp=1)
    assert whole.group_ranks(1, "dp_shard") == whole.group_ranks(1, "dp")
    assert whole.group_ranks(1, "dp_replicate") == [1]


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.zero_stage=3", "parallelism.dp_shard_size=3"], "dp_shard_size=3 must divide dp \\* cp = 4"),
    (["parallelism.dp_shard_size=2"], "dp_shard_size=2 .*zero_stage=0 shards nothing"),
    (["parallelism.zero_stage=3", "parallelism.fp8_param_gather=true", "parallelism.precision=bf16"],
     "fp8_param_gather=true .*precision='fp8' \\(got 'bf16'\\)"),
    (["parallelism.zero_stage=1", "parallelism.fp8_param_gather=true", "parallelism.precision=fp8"],
     "fp8_param_gather=true with parallelism.zero_stage=1"),
    (["parallelism.zero_stage=3", "parallelism.dp_shard_size=2", "model.num_experts=4", "model.moe_top_k=2"],
     "dp_shard_size=2 < dp \\* cp = 4 .*experts"),
])
def test_invalid_sharding_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_run([*BASE, *overrides], check="layout")


def test_invalid_settings_name_the_field():
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
    norms, squared_norm = [], MixedPrecisionAdamW._squared_norm
    MixedPrecisionAdamW._squared_norm = staticmethod(lambda *args: norms.append(squared_norm(*args)) or norms[-1])
    for _ in range(2):
        train_step(rm, actions, batch)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in rm.parameters()]
    return torch.cat([p.detach().flatten() for p in full]), sum(float(n) for n in norms)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [["parallelism.zero_stage=2"], ["parallelism.zero_stage=3"],
                                      ["parallelism.zero_stage=3", "parallelism.dp_shard_size=2"],
                                      ["parallelism.zero_stage=1", "parallelism.dp_shard_size=2"]],
                         ids=["zero2", "zero3", "hsdp", "zero1-two-instances"])
def test_trains_like_replicated_adam(sharding):
    base = ["parallelism=dp2", "model.dropout=0", "model.attention_dropout=0"]
    if "parallelism.dp_shard_size=2" in sharding:
        base += ["parallelism.dp=4", "parallelism.global_batch_size=8", "hardware.devices_per_node=4"]
    replicated = compose_run(base, check="layout")
    sharded = compose_run([*base, *sharding], check="layout")
    expected = spawn_ranks(_weights_after_two_steps, replicated.parallelism, replicated.model, replicated.parallelism)
    got = spawn_ranks(_weights_after_two_steps, sharded.parallelism, sharded.model, sharded.parallelism)
    for weights, _ in got[1:]:
        assert torch.equal(got[0][0], weights)
    # the gradients' scale (Adam's update hardly shows it): averaged over every replica
    assert got[0][1] == pytest.approx(expected[0][1], rel=1e-5)
    # (reduced over 4 ranks in another order: fp32 rounding, which Adam's update of near-zero gradients magnifies)
    torch.testing.assert_close(got[0][0], expected[0][0], rtol=1e-4, atol=1e-5 if "dp=4" not in str(base) else 5e-5)


@pytest.mark.slow
def test_fp8_gathered_weights_train_like_bf16_gathered_ones():
    """FP8 all-gathers change only how the weights travel: every rank ends with the same weights, close to those of
    FP8 training with bf16 gathers (the FP8 GEMMs already round the weights to FP8; the scale per unit differs)."""
    base = ["parallelism=dp2", "model.dropout=0", "model.attention_dropout=0", "parallelism.zero_stage=3",
            "parallelism.precision=fp8", "parallelism.fp8_recipe=current"]
    runs = [compose_run([*base, f"parallelism.fp8_param_gather={on}"], check="layout") for on in ("false", "true")]
    bf16, fp8 = (spawn_ranks(_weights_after_two_steps, r.parallelism, r.model, r.parallelism) for r in runs)
    assert torch.equal(fp8[0][0], fp8[1][0])
    assert not torch.equal(fp8[0][0], bf16[0][0])
    # the gradients (Adam moves every weight by about its learning rate whatever they are): the same up to FP8's
    # rounding of the weights with another scale
    assert fp8[0][1] == pytest.approx(bf16[0][1], rel=0.02)


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
    # HSDP: the state over 4 of the 8 replicas (more memory), the gradients also all-reduced across the 2 replicas
    hsdp = estimate(1e-7, zero_stage=3, dp_shard_size=4)
    assert hsdp.peak_memory_bytes - fsdp.peak_memory_bytes == layers * (16 << 20) // 8
    assert hsdp.pipeline_s > estimate(1e-7, zero_stage=3).pipeline_s
    # FP8 all-gathers: the blocks' weights gathered and held in 1 byte each
    fp8 = estimate(1e-7, zero_stage=3, precision="fp8")
    fp8_gathered = estimate(1e-7, zero_stage=3, precision="fp8", fp8_param_gather=True)
    assert fp8_gathered.pipeline_s < fp8.pipeline_s and fp8_gathered.peak_memory_bytes < fp8.peak_memory_bytes


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
