"""Context parallelism: layout, validation, the traced ring and all-gather attention, and the real thing."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.layout import Layout
from trainsim.parallel.schedules import pipeline_actions
from trainsim.trace import trace_layout
from trainsim.workloads.context_parallel import ContextParallel, chunk_order, local_positions
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.train_step import build_rank_model, create_groups, synthetic_batch, train_step


def _trace(*overrides):
    run = compose_run(list(overrides), check="layout")
    return run, trace_layout(run.model, run.parallelism)


def test_ranks_follow_megatron_order_and_gradients_reduce_over_dp_and_cp():
    layout = Layout(dp=2, tp=2, pp=2, cp=2)  # tp fastest, then cp, dp, pp
    assert layout.world_size == 16
    assert layout.rank_of(dp_rank=1, tp_rank=1, pp_rank=1, cp_rank=1) == 15
    assert layout.group_ranks(0, "tp") == [0, 1]
    assert layout.group_ranks(0, "cp") == [0, 2]
    assert layout.group_ranks(0, "dp") == [0, 2, 4, 6]  # every rank with the same weights
    assert layout.group_ranks(0, "pp") == [0, 8]
    assert layout.group_ranks(5, "amax") == list(range(8))  # a pipeline stage's dp, cp and tp ranks
    assert sorted(r for g in layout.all_groups("cp") for r in g) == list(range(16))


def test_each_rank_holds_two_chunks_that_balance_the_causal_work():
    assert chunk_order(2) == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # keys before each query, summed over a rank's queries: the same on every rank
    work = [sum(p + 1 for p in local_positions(64, 4, r).tolist()) for r in range(4)]
    assert len(set(work)) == 1


def test_invalid_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"parallelism.cp=3 .*seq_length=64 is not divisible by 6"):
        compose_run(["parallelism=cp2", "parallelism.cp=3"], check="layout")
    with pytest.raises(ConfigError, match="model.attention='fused'"):
        compose_run(["parallelism=cp2", "model.attention=unfused"], check="layout")
    with pytest.raises(ConfigError, match="cp_comm_type='ring'.*accepted: p2p, all_gather"):
        compose_run(["parallelism=cp2", "parallelism.cp_comm_type=ring"], check="layout")
    with pytest.raises(ConfigError, match=r"dp\*cp\*tp\*pp = 1\*2\*1\*1 = 2 devices"):
        compose_run(["parallelism=cp2", "hardware.num_nodes=1", "hardware.devices_per_node=1"])


def _comm(graph: pd.DataFrame) -> pd.DataFrame:
    return graph[graph["kind"].isin(["collective", "p2p"])]


def test_ring_attention_exchanges_keys_and_values_with_its_ring_neighbours():
    run, result = _trace("parallelism=cp2")
    model, par = run.model, run.parallelism
    graph = result.graph.to_pandas()
    ring = _comm(graph)[_comm(graph)["group_kind"] == "cp"]
    b, s_local, h = par.micro_batch_size, model.seq_length // 2, model.hidden_size
    kv_bytes = 2 * b * s_local * h * 4  # K and V of this rank's tokens, fp32
    forward, backward = (ring[ring["phase"] == phase] for phase in ("forward", "backward"))
    # forward: cp - 1 exchanges per layer; backward: the same for K/V plus cp for their gradients
    assert len(forward) == 2 * (par.cp - 1) * model.num_layers
    assert len(backward) == 2 * (2 * par.cp - 1) * model.num_layers
    assert set(ring["message_bytes"]) == {kv_bytes}
    assert set(ring["peer"]) == {1} and ring["async_op"].all()
    # the gradients are averaged over the ranks with the same weights: the two context-parallel ranks
    grads = _comm(graph)[(_comm(graph)["collective"] == "all_reduce") & (_comm(graph)["group_kind"] == "dp")]
    assert len(grads) > 0 and all(list(g) == [0, 1] for g in grads["group_ranks"])


def test_all_gather_attention_gathers_keys_and_values_again_in_backward():
    run, result = _trace("parallelism=cp2", "parallelism.cp_comm_type=all_gather")
    graph = result.graph.to_pandas()
    cp = _comm(graph)[_comm(graph)["group_kind"] == "cp"]
    layers = run.model.num_layers
    assert (cp[cp["phase"] == "forward"]["collective"] == "all_gather").sum() == layers
    assert (cp[cp["phase"] == "backward"]["collective"] == "all_gather").sum() == layers
    assert (cp[cp["phase"] == "backward"]["collective"] == "reduce_scatter").sum() == layers
    assert not (graph["kind"] == "p2p").any()


def test_activation_memory_splits_with_the_sequence():
    one = _trace("parallelism=single", "parallelism.micro_batch_size=2")[1].memory.to_pandas()
    two = _trace("parallelism=cp2", "parallelism.micro_batch_size=2")[1].memory.to_pandas()
    per_microbatch = [m["activation_bytes_per_microbatch"].iloc[0] for m in (one, two)]
    assert two["parameter_bytes"].iloc[0] == one["parameter_bytes"].iloc[0]  # weights are replicated
    assert 0.45 < per_microbatch[1] / per_microbatch[0] < 0.6


def _attention_vs_full(rank, layout, cp, comm_type, kv_heads):
    """This rank's output and gradients of context-parallel attention, and the same slices of full attention."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 32, 8
    q, dout = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True).backward(dout)
    ctx = ContextParallel(cp, rank, dist.group.WORLD, comm_type)
    mine = [ctx.split(t, dim=2).requires_grad_() for t in (q, k, v)]
    out = ctx.attention(*mine)
    out.backward(ctx.split(dout, dim=2))
    ref = torch.nn.functional.scaled_dot_product_attention(*[t.detach() for t in full], is_causal=True,
                                                           enable_gqa=True)
    return ([out.detach(), *(t.grad for t in mine)], [ctx.split(ref, dim=2), *(ctx.split(t.grad, dim=2) for t in full)])


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_context_parallel_attention_equals_full_causal_attention(cp, comm_type):
    par = compose_run(["parallelism=cp2", f"parallelism.cp={cp}"], check="layout").parallelism
    for got, expected in spawn_ranks(_attention_vs_full, par, cp, comm_type, 2):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _loss_and_grads(rank, layout, model_cfg, par):
    groups = create_groups(layout, rank, every_group=True)
    torch.manual_seed(1234)
    rm = build_rank_model(model_cfg, par, rank, groups)
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    train_step(rm, actions, synthetic_batch(model_cfg, par, seed=layout.position(rank).dp_rank))
    return torch.cat([p.detach().flatten() for p in rm.parameters()])


@pytest.mark.slow
def test_context_parallel_step_trains_like_one_rank():
    base = ["model.dropout=0", "model.attention_dropout=0", "parallelism.global_batch_size=4",
            "parallelism.micro_batch_size=2"]
    single = compose_run(["parallelism=single", *base], check="layout")
    cp = compose_run(["parallelism=cp2", *base], check="layout")
    (expected,) = spawn_ranks(_loss_and_grads, single.parallelism, single.model, single.parallelism)
    got = spawn_ranks(_loss_and_grads, cp.parallelism, cp.model, cp.parallelism)
    assert torch.equal(got[0], got[1])  # both context-parallel ranks hold the same weights after the step
    torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-5)


def test_layout_search_tries_context_parallel_degrees_and_prices_the_ring():
    import dataclasses

    from trainsim.comm.model import CommModel
    from trainsim.search.estimate import estimate_layout
    from trainsim.search.layouts import SearchSpace, enumerate_layouts
    from trainsim.search.slices import PartCost, SliceCosts

    run = compose_run(["hardware=h100-sxm-dgx", "model=gpt-tiny", "parallelism=cp2", "parallelism.precision=bf16",
                       "parallelism.global_batch_size=16"], check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), recompute=("none",), cp_sizes=(1, 2, 4))
    layouts = enumerate_layouts(run.model, run.parallelism, run.hardware, 8, space)
    assert {p.cp for p in layouts} == {1, 2, 4} and all(p.world_size == p.dp * p.cp * p.tp * p.pp for p in layouts)
    assert any("-cp4-" in p.name for p in layouts)

    hw, comm = run.hardware, CommModel.from_hardware(run.hardware)
    message = 64 << 20
    ring_s = comm.p2p_seconds(message, same_node=True)

    def step(attention_s: float) -> float:
        layer = PartCost(forward_s=1e-3, backward_s=2e-3, forward_cp={f"send:{message}": 1},
                         forward_attention_s=attention_s, parameter_bytes=1 << 20, gradient_bytes=1 << 20)
        costs = SliceCosts(layer=layer, first=PartCost(), last=PartCost(), p2p_message_bytes=0,
                           first_transient_bytes=[0, 0], last_transient_bytes=[0, 0])
        return estimate_layout(costs, run.model, dataclasses.replace(run.parallelism, dp=1), hw, comm).step_time_s

    layers, microbatches = run.model.num_layers, run.parallelism.num_microbatches
    # the ring's sends are hidden behind attention blocks that take longer, exposed beyond them
    assert step(attention_s=2 * ring_s) == pytest.approx(step(attention_s=10 * ring_s))
    assert step(attention_s=0.0) - step(attention_s=2 * ring_s) == pytest.approx(layers * microbatches * ring_s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash-attention path needs a GPU")
@pytest.mark.parametrize("q_len, kv_len, causal", [(256, 256, True), (128, 256, False), (256, 128, False)])
def test_cuda_attention_blocks_match_scaled_dot_product_attention(q_len, kv_len, causal):
    """The blocks ring attention runs on a GPU (grouped-query keys, a slice of the log-sum-exp in backward)."""
    from trainsim.workloads.context_parallel import flash_backward, flash_forward

    torch.manual_seed(0)
    b, h, kv_heads, d = 2, 8, 2, 64
    q, dout = (torch.randn(b, h, q_len, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    out, lse, extra = flash_forward(q, k, v, causal)
    wide = torch.cat([lse, lse], dim=-1)[..., :q_len]  # a strided view, as ring attention passes it
    grads = flash_backward(dout, q, k, v, out, wide, causal, extra)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, atol=5e-2, rtol=5e-2)
