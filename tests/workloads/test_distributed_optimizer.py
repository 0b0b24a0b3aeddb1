"""The distributed optimizer (ZeRO-1): what it issues, what it saves, and that it trains like DDP."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.schedules import pipeline_actions
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.train_step import build_rank_model, create_groups, synthetic_batch, train_step


def _trace(*overrides):
    run = compose_run(list(overrides), check="layout")
    result = trace_layout(run.model, run.parallelism)
    return run, result.graph.to_pandas(), result.memory.to_pandas()


def _comm(graph: pd.DataFrame) -> pd.DataFrame:
    return graph[graph["kind"] == "collective"]


def test_buckets_are_reduce_scattered_and_weights_all_gathered():
    base = ("parallelism=dp2", "parallelism.dp=4", "parallelism.global_batch_size=16",
            "parallelism.dp_bucket_size_bytes=300000")
    _, replicated, replicated_memory = _trace(*base)
    _, graph, memory = _trace(*base, "parallelism.zero_stage=1")
    comm = _comm(graph)
    scatter = comm[comm["collective"] == "reduce_scatter"]
    gather = comm[comm["collective"] == "all_gather"]
    buckets = _comm(replicated)
    assert len(scatter) == len(gather) == len(buckets) >= 3  # one of each per gradient bucket
    assert (scatter["phase"] == "backward").all() and not scatter["per_microbatch"].any()
    assert (gather["phase"] == "optimizer").all()
    # buckets padded to a multiple of lcm(dp, 128) elements: never smaller, at most 512 fp32 elements more
    padding = (scatter["message_bytes"].sort_values().to_numpy()
               - buckets["message_bytes"].sort_values().to_numpy())
    assert ((padding >= 0) & (padding < 512 * 4)).all()
    assert sorted(gather["message_bytes"]) == sorted(scatter["message_bytes"])
    norm = comm[comm["collective"] == "all_reduce"]
    assert len(norm) == 1 and norm["message_bytes"].iloc[0] == 4 and len(norm["group_ranks"].iloc[0]) == 4
    # fp32 Adam moments for a quarter of the parameters (plus the padding)
    states = memory["optimizer_state_bytes"].iloc[0]
    assert replicated_memory["optimizer_state_bytes"].iloc[0] / 4 <= states
    assert states < replicated_memory["optimizer_state_bytes"].iloc[0] / 4 * 1.01
    assert memory["gradient_bytes"].iloc[0] >= replicated_memory["gradient_bytes"].iloc[0]  # full grad buffer


def test_bf16_gradients_accumulate_and_reduce_in_fp32_as_megatron_does():
    """Megatron-LM keeps bf16 runs' gradients in fp32 buffers (main_grad), reduce-scatters them in fp32 and
    hands them to the optimizer as its master gradients (grad_reduce_in_fp32); the default keeps them in bf16."""
    base = ("parallelism=dp2", "parallelism.dp=4", "parallelism.global_batch_size=16", "parallelism.zero_stage=1",
            "parallelism.precision=bf16", "parallelism.dp_bucket_size_bytes=300000")
    _, graph, memory = _trace(*base, "parallelism.grad_reduce_in_fp32=true")
    _, low, low_memory = _trace(*base)
    comm, low_comm = _comm(graph), _comm(low)
    scatter, gather = comm[comm["collective"] == "reduce_scatter"], comm[comm["collective"] == "all_gather"]
    assert sorted(scatter["message_bytes"]) == sorted(2 * gather["message_bytes"])  # fp32 gradients, bf16 weights
    low_scatter = low_comm[low_comm["collective"] == "reduce_scatter"]
    assert scatter["message_bytes"].sum() == 2 * low_scatter["message_bytes"].sum()
    assert memory["gradient_bytes"].iloc[0] == 2 * low_memory["gradient_bytes"].iloc[0]
    # the fp32 buffer is the optimizer's master gradient: no fp32 copy of its slice beside it
    assert low_memory["optimizer_state_bytes"].iloc[0] > memory["optimizer_state_bytes"].iloc[0]
    copies = graph[(graph["op"] == "aten::_foreach_copy_") & (graph["phase"] == "optimizer")]
    assert len(copies) == len(low[(low["op"] == "aten::_foreach_copy_") & (low["phase"] == "optimizer")]) - 1
    # each micro-batch's bf16 gradient is added into the fp32 buffer during backward
    adds = graph[(graph["phase"] == "backward") & graph["op"].str.startswith("aten::add_")
                 & graph["input_dtypes"].str.startswith("fp32,bf16")]
    assert len(adds) > 0


def test_gradient_accumulation_fusion_prices_the_linears_gradient_adds_at_zero():
    """Megatron's gradient-accumulation fusion: the weight-gradient GEMM of each tensor-parallel linear accumulates
    into the buffer itself, so the trace notes those adds fused (no time of their own); norms and biases still add."""
    from trainsim.profile.analytical import kernel_notes, predict_ops, rates_for

    base = ("parallelism=dp2", "parallelism.dp=2", "parallelism.global_batch_size=8", "parallelism.precision=bf16")
    graphs = [_trace(*base, f"parallelism.gradient_accumulation_fusion={on}")[1] for on in ("false", "true")]
    adds = [g[(g["rank_class"] == 0) & (g["phase"] == "backward") & g["op"].str.startswith("aten::add_")]
            for g in graphs]
    assert len(adds[0]) == len(adds[1]) > 0  # the same ops run
    fused = [a[a["op_args"].map(kernel_notes).map(lambda n: n.get("fused") == 1)] for a in adds]
    layers, linears = 4, 4  # gpt-tiny; qkv, proj, up, down; and the output layer
    assert len(fused[0]) == 0 and len(fused[1]) == layers * linears + 1
    assert all(len(json.loads(shape)[0]) == 2 for shape in fused[1]["input_shapes"])  # weights, not biases
    rates = rates_for(compose_run(["hardware=h100-sxm-dgx"]).hardware, "bf16")
    assert (predict_ops(rates, fused[1]) == 0).all() and (predict_ops(rates, fused[1].assign(op_args="")) > 0).all()


def test_gradient_norm_is_summed_over_every_rank():
    _, graph, _ = _trace("parallelism=pp2", "parallelism.dp=2", "parallelism.global_batch_size=8",
                         "parallelism.zero_stage=1")
    norm = _comm(graph)
    norm = norm[(norm["collective"] == "all_reduce") & (norm["phase"] == "optimizer")]
    assert set(norm["group_kind"]) == {"world"}  # each rank holds a slice of a different stage


def test_overlapped_weight_gather_runs_in_the_first_forward_only():
    run, graph, _ = _trace("parallelism=pp2-interleaved", "parallelism.dp=2", "parallelism.global_batch_size=16",
                           "parallelism.zero_stage=1", "parallelism.overlap_param_gather=true")
    par = run.parallelism
    gather = _comm(graph)[_comm(graph)["collective"] == "all_gather"]
    assert (gather["phase"] == "forward").all() and not gather["per_microbatch"].any()
    assert set(gather["chunk"]) == set(range(par.virtual_stages))
    # forward ops wait for their weights through the parameter buffer
    first_users = graph[graph["deps"].map(lambda deps: bool(set(deps) & set(gather["id"])))]
    assert (first_users["phase"] == "forward").any()
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    step = expand_step(graph[graph["rank_class"] == 0], actions)
    step_gathers = step[step["collective"] == "all_gather"]
    assert len(step_gathers) == len(gather[gather["rank_class"] == 0])  # once per step, not per micro-batch
    assert set(step_gathers["microbatch"]) == {0}


def test_invalid_settings_name_the_field():
    with pytest.raises(ConfigError, match="zero_stage=4.*accepted: 0, 1, 2, 3"):
        compose_run(["parallelism=dp2", "parallelism.zero_stage=4"], check="layout")
    with pytest.raises(ConfigError, match="overlap_param_gather=true.*zero_stage=1"):
        compose_run(["parallelism=dp2", "parallelism.overlap_param_gather=true"], check="layout")


def _weights_before_and_after_two_steps(rank, layout, model_cfg, par):
    groups = create_groups(layout, rank, every_group=True)
    torch.manual_seed(1234)
    rm = build_rank_model(model_cfg, par, rank, groups)
    before = torch.cat([p.detach().flatten() for p in rm.parameters()])
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    batch = synthetic_batch(model_cfg, par, seed=layout.position(rank).dp_rank)
    for _ in range(2):  # the second step starts from the weights the first step's all-gather delivered
        train_step(rm, actions, batch)
    if par.overlap_param_gather:  # the last update reaches the replicas in the next step's forward
        for buckets in rm.buckets:
            buckets.gather_params(wait=True)
    return before, torch.cat([p.detach().flatten() for p in rm.parameters()])


@pytest.mark.slow
def test_gradient_accumulation_fusion_trains_exactly_like_autograds_accumulation():
    base = ["parallelism=dp2", "parallelism.precision=bf16", "parallelism.global_batch_size=8"]
    runs = [compose_run([*base, f"parallelism.gradient_accumulation_fusion={on}"], check="layout")
            for on in ("false", "true")]
    (before, expected), _ = spawn_ranks(_weights_before_and_after_two_steps, runs[0].parallelism, runs[0].model,
                                        runs[0].parallelism)
    (_, got), _ = spawn_ranks(_weights_before_and_after_two_steps, runs[1].parallelism, runs[1].model,
                              runs[1].parallelism)
    assert torch.equal(got, expected) and not torch.equal(before, expected)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_trains_exactly_like_replicated_adam(overlap):
    base = ["parallelism=dp2", "parallelism.dp_bucket_size_bytes=200000"]
    replicated = compose_run(base, check="layout")
    sharded = compose_run([*base, "parallelism.zero_stage=1", f"parallelism.overlap_param_gather={overlap}"],
                          check="layout")
    (before, expected), _ = spawn_ranks(_weights_before_and_after_two_steps, replicated.parallelism,
                                        replicated.model, replicated.parallelism)
    got = [after for _, after in spawn_ranks(_weights_before_and_after_two_steps, sharded.parallelism,
                                              sharded.model, sharded.parallelism)]
    assert torch.equal(got[0], got[1])  # the replicas agree after the all-gather
    assert torch.allclose(got[0], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, expected)  # the steps did change the weights


def test_layout_search_shards_states_and_update_and_prices_the_gather():
    import dataclasses

    from trainsim.comm.model import CommModel
    from trainsim.search.estimate import estimate_layout
    from trainsim.search.slices import PartCost, SliceCosts

    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-tiny", "parallelism=dp2", "parallelism.dp=8",
                       "parallelism.global_batch_size=16", "parallelism.precision=bf16"], check="layout")
    layer = PartCost(forward_s=1e-3, backward_s=2e-3, optimizer_s=8e-3, parameter_bytes=2 << 20,
                     gradient_bytes=2 << 20, optimizer_state_bytes=12 << 20)
    costs = SliceCosts(layer=layer, first=PartCost(), last=PartCost(), p2p_message_bytes=0,
                       first_transient_bytes=[0, 0], last_transient_bytes=[0, 0])
    hw = run.hardware
    comm = CommModel.from_hardware(hw)

    def estimate(**fields):
        return estimate_layout(costs, run.model, dataclasses.replace(run.parallelism, **fields), hw, comm)

    replicated, sharded = estimate(zero_stage=0), estimate(zero_stage=1)
    overlapped = estimate(zero_stage=1, overlap_param_gather=True)
    layers = run.model.num_layers
    assert replicated.peak_memory_bytes - sharded.peak_memory_bytes == layers * (12 << 20) * 7 // 8
    assert overlapped.optimizer_s == pytest.approx(replicated.optimizer_s / 8)  # a slice of the update
    assert sharded.optimizer_s > overlapped.optimizer_s  # plus the weights' all-gather after it
