"""Mamba-2 and hybrid models: the SSD scan against the recurrence it computes, the fused ops' gradients, the layer
kinds a pattern builds, Megatron-Core's rules, and a real tensor- and sequence-parallel step against its trace."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.schedules import step_actions
from trainsim.trace import trace_layout
from trainsim.trace.expand import expand_step, rename_for_rank
from trainsim.trace.recorder import ExecutionRecorder
from trainsim.workloads.launch import run_real_step
from trainsim.workloads.mamba import causal_conv1d_silu, gated_rms_norm, ssd_scan
from trainsim.workloads.train_step import layout_of

MAMBA = ["model=gpt-tiny", "model.mamba_head_dim=16", "model.mamba_num_groups=2", "model.mamba_state_dim=8"]


def hybrid(pattern: str) -> list[str]:
    return [*MAMBA, f"model.num_layers={len(pattern)}", f"model.hybrid_layer_pattern='{pattern}'"]


def test_chunked_scan_equals_the_state_space_recurrence():
    """y_t = C_t h_t with h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t, token by token, over 3 chunks."""
    torch.manual_seed(0)
    bsz, s, heads, p, groups, n = 2, 12, 4, 3, 2, 5
    x = torch.randn(bsz, s, heads, p, dtype=torch.float64)
    dt = torch.rand(bsz, s, heads, dtype=torch.float64)
    a = -torch.rand(heads, dtype=torch.float64)
    b, c = torch.randn(2, bsz, s, groups, n, dtype=torch.float64)
    b_heads, c_heads = (t.repeat_interleave(heads // groups, dim=2) for t in (b, c))
    state = torch.zeros(bsz, heads, p, n, dtype=torch.float64)
    expected = []
    for t in range(s):
        state = (torch.exp(dt[:, t] * a)[..., None, None] * state
                 + (dt[:, t, :, None] * x[:, t])[..., None] * b_heads[:, t, :, None, :])
        expected.append(torch.einsum("bhpn,bhn->bhp", state, c_heads[:, t]))
    torch.testing.assert_close(ssd_scan(x, dt, a, b, c, chunk=4), torch.stack(expected, 1))


def test_fused_conv_and_gated_norm_gradients_match_their_forward():
    torch.manual_seed(0)
    x, y, z = torch.randn(3, 1, 6, 4, dtype=torch.float64).unbind(0)
    x, y, z = (t.requires_grad_() for t in (x, y, z))
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(causal_conv1d_silu, (x, weight, bias), fast_mode=True)
    out = causal_conv1d_silu(x, weight, bias)
    # causal: changing the last token changes no earlier output
    later = x.detach().clone()
    later[:, -1] += 1
    torch.testing.assert_close(causal_conv1d_silu(later, weight, bias)[:, :-1], out[:, :-1])
    norm_weight = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: gated_rms_norm(*t, 2, 1e-5), (y, z, norm_weight), fast_mode=True)


def test_pattern_builds_megatron_hybrid_layers_and_stages_of_other_kinds_trace_apart():
    """'M' a Mamba mixer alone, '*' attention without an MLP, '-' an MLP alone; with pp 4 the two middle stages hold
    different kinds of layers, so each is traced (a transformer's middle stages share one trace)."""
    run = compose_run([*hybrid("M*-M"), "parallelism.pp=4", "parallelism.global_batch_size=4"], check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    forward = graph[graph["phase"] == "forward"]
    ops = {cls: set(rows["op"]) for cls, rows in forward.groupby("rank_class")}
    conv, attention = "trainsim::causal_conv1d_silu", "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert conv in ops[0] and attention not in ops[0]
    assert attention in ops[1] and conv not in ops[1]
    assert conv not in ops[2] and attention not in ops[2] and "aten::gelu" in ops[2]
    assert conv in ops[3]


@pytest.mark.parametrize("overrides, message", [
    (["model.hybrid_layer_pattern='M*-'"], "has 3 layers but model.num_layers=4"),
    (["model.hybrid_layer_pattern='M*|-'"], "'|'"),
    (["model.hybrid_layer_pattern='M*-E'"], "num_experts=0"),
    (["model.hybrid_layer_pattern='M*-E'", "model.num_experts=4", "model.moe_first_dense_layers=1"],
     "pattern says which layers are MoE"),
    (["model.hybrid_layer_pattern='M*-M'", "model.mamba_num_groups=3"], "must divide the 8 Mamba heads"),
    (["model.hybrid_layer_pattern='M*-M'", "parallelism.tp=4"], "does not divide the model.mamba_num_groups = 2"),
    (["model.hybrid_layer_pattern='M*-M'", "parallelism.cp=2"], "cp=2 with Mamba layers"),
])
def test_megatron_hybrid_rules_are_enforced(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|").replace("*", r"\*")):
        compose_run([*MAMBA, *overrides], check="layout")


def test_real_tensor_and_sequence_parallel_hybrid_step_matches_its_trace():
    """Two ranks: in_proj all-gathers the token shards and out_proj reduce-scatters them (Megatron-Core MambaMixer
    with sequence parallelism); the real step runs the same ops on the same shapes, and the same collectives, as
    the trace says."""
    run = compose_run([*hybrid("M*-M"), "parallelism.dp=1", "parallelism.tp=2",
                       "parallelism.sequence_parallel=true"])
    par = run.parallelism
    real = run_real_step(run.model, par, recorder=ExecutionRecorder)
    graph = trace_layout(run.model, par).graph.to_pandas()
    layout = layout_of(par)
    assert "trainsim::causal_conv1d_silu" in set(graph["op"])
    for rank_run in real:
        expected = rename_for_rank(expand_step(graph, step_actions(par, 0)), layout, 0, rank_run.rank)
        recorded = pd.DataFrame(rank_run.events)
        comm = ["collective", "group_ranks", "message_bytes"]
        assert (list(recorded[recorded["kind"] == "collective"][comm].astype(str).itertuples(index=False))
                == list(expected[expected["kind"] == "collective"][comm].astype(str).itertuples(index=False)))
        ops = ["op", "input_shapes"]
        assert list(recorded[ops].itertuples(index=False)) == list(expected[ops].itertuples(index=False))


@pytest.mark.parametrize("overrides", [
    ["model=nemotron-h-8b", "parallelism.dp=1", "parallelism.tp=8", "parallelism.sequence_parallel=true"],
    # Megatron-Bridge 26.04's Nemotron_3_Nano row on 16 H100s: TP1 PP1 CP1 EP8, MBS 1, GBS 1024
    ["model=nemotron-3-nano", "parallelism.dp=16", "parallelism.ep=8", "parallelism.micro_batch_size=1",
     "parallelism.global_batch_size=1024"],
])
def test_published_hybrid_models_compose_with_their_layouts(overrides):
    model = compose_run(overrides, check="layout").model
    assert len(model.hybrid_layer_pattern) == model.num_layers == 52
    assert set(model.hybrid_layer_pattern) <= set("M*-E")
