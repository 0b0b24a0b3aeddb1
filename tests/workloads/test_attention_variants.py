"""Attention of current models: windows, sinks, multi-head latent attention; interleaved MoE layers, the biased
router; what a config approximates reaching the prediction's warnings."""

from __future__ import annotations

import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.schedules import pipeline_actions
from trainsim.trace import trace_layout
from trainsim.workloads.core_attention import CoreAttention, visible_keys
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.train_step import build_rank_model, create_groups, synthetic_batch, train_step

LLAMA = ["model=gpt-tiny", "model.family=llama"]
MLA = [*LLAMA, "model.kv_lora_rank=16", "model.q_lora_rank=24", "model.qk_rope_head_dim=8", "model.v_head_dim=12"]


def _reference(q, k, v, visible, sinks=None):
    """softmax over the visible keys (and each head's sink logit), written out."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def test_windows_let_a_query_see_what_mistral_and_llama4_let_it_see():
    sliding = visible_keys(6, 2, chunked=False)
    assert sliding[3].tolist() == [False, False, True, True, False, False]
    chunked = visible_keys(6, 2, chunked=True)
    assert chunked[3].tolist() == [False, False, True, True, False, False]
    assert chunked[4].tolist() == [False, False, False, False, True, False]
    assert visible_keys(6, 0, chunked=False).equal(torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window,chunked,sinks", [(0, False, True), (3, False, False), (3, True, True),
                                                   (3, False, True)])
def test_windowed_attention_with_sinks_computes_the_written_out_softmax(fused, window, chunked, sinks):
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 4, 2, 8, 6
    core = CoreAttention(heads=heads, kv_heads=kv_heads, seq_length=s, qk_width=d, dtype=torch.float32,
                         fused=fused, dropout_p=0.0, window=window, chunked=chunked, sinks=sinks)
    if sinks:
        with torch.no_grad():
            core.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v = torch.randn(b, heads, s, d), torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    expected = _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), visible_keys(s, window, chunked),
                          core.sinks.detach() if sinks else None)
    torch.testing.assert_close(core(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_values_narrower_than_queries_are_attended_at_their_own_width():
    torch.manual_seed(0)
    core = CoreAttention(heads=2, kv_heads=2, seq_length=5, qk_width=6, dtype=torch.float32, fused=True,
                         dropout_p=0.0)
    q, k, v = torch.randn(1, 2, 5, 6), torch.randn(1, 2, 5, 6), torch.randn(1, 2, 5, 4)
    torch.testing.assert_close(core(q, k, v), _reference(q, k, v, visible_keys(5, 0, False)))


def _attention_rows(*overrides):
    run = compose_run([*LLAMA, *overrides], check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    return run, graph[graph["op"].str.contains("scaled_dot_product") & (graph["phase"] == "forward")]


def test_windowed_layers_are_priced_at_the_keys_they_see():
    from trainsim.profile.analytical import kernel_notes, predict_rows, window_fraction

    overrides = ["model.seq_length=4096", "model.hidden_size=512", "model.window_size=512",
                 "model.global_attention_every=2", "model.attention_sinks=true", "parallelism.precision=bf16"]
    run, rows = _attention_rows(*overrides)
    windows = rows["op_args"].map(lambda a: kernel_notes(a).get("window_keys")).tolist()
    assert windows == [512, 0, 512, 0]  # GPT-OSS's alternation: every 2nd layer full
    hw = compose_run(["hardware=h100-sxm-dgx", *LLAMA, *overrides]).hardware
    seconds = predict_rows(rows, hw)  # a call's fixed time (~20 us on H100) and the window's tiles stay
    assert seconds[0] < 0.7 * seconds[1] and seconds[2] < 0.7 * seconds[3]
    assert window_fraction(1024, 128, chunked=False) == pytest.approx(128 / 1024 - 0.5 * (128 / 1024) ** 2)
    assert window_fraction(1024, 1024, chunked=False) == window_fraction(1024, 1024, chunked=True) == 0.5


def test_latent_attention_has_deepseeks_projections_split_over_tp_as_megatron():
    run = compose_run([*MLA, "parallelism=tp2"], check="layout")
    from trainsim.workloads.latent_attention import LatentAttention

    attn = LatentAttention(run.model, 2, None, torch.float32, selective_recompute=False)
    shapes = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    h, heads = 64, 4
    assert shapes["q_down.weight"] == (24, h) and shapes["kv_down.weight"] == (16 + 8, h)  # whole on every rank
    assert shapes["q_up.weight"] == (heads // 2 * (16 + 8), 24)  # head_dim 16 (64 / 4) + rotary 8, split
    assert shapes["kv_up.weight"] == (heads // 2 * (16 + 12), 16)
    assert shapes["proj.weight"] == (h, heads // 2 * 12)
    assert shapes["q_norm.weight"] == (24,) and shapes["kv_norm.weight"] == (16,)


def parameters_after_a_step(rank, layout, model_cfg, par):
    groups = create_groups(layout, rank, every_group=True)
    torch.manual_seed(1234)
    rm = build_rank_model(model_cfg, par, rank, groups)
    actions = pipeline_actions(par.schedule, par.pp, 0, par.num_microbatches, par.virtual_stages)
    train_step(rm, actions, synthetic_batch(model_cfg, par, seed=0))
    return {name: p.detach().clone() for name, p in rm.chunks[0].named_parameters()}


@pytest.mark.slow
def test_tensor_parallel_latent_attention_trains_the_same_with_and_without_sequence_parallelism():
    """Real gloo steps: the duplicated down projections end equal on both tp ranks, and sequence parallelism (which
    reduces their gradients and the rotary key's by other collectives) changes nothing."""
    base = [*MLA, "parallelism=tp2", "parallelism.precision=fp32", "parallelism.global_batch_size=2",
            "model.window_size=24", "model.attention_sinks=true"]
    plain = compose_run([*base, "parallelism.sequence_parallel=false"], check="layout")
    sp = compose_run([*base, "parallelism.sequence_parallel=true"], check="layout")
    got_plain = spawn_ranks(parameters_after_a_step, plain.parallelism, plain.model, plain.parallelism)
    got_sp = spawn_ranks(parameters_after_a_step, sp.parallelism, sp.model, sp.parallelism)
    for rank in range(2):
        for name, value in got_plain[rank].items():
            torch.testing.assert_close(got_sp[rank][name], value, rtol=1e-4, atol=1e-6, msg=name)
    for name in ("layers.0.attn.q_down.weight", "layers.0.attn.kv_down.weight", "layers.0.attn.kv_norm.weight"):
        torch.testing.assert_close(got_sp[0][name], got_sp[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_interleaved_moe_layers_and_a_biased_router():
    run = compose_run([*LLAMA, "model.num_experts=4", "model.moe_layer_freq=2", "model.moe_router_bias=true"],
                      check="layout")
    from trainsim.workloads.routing import moe_layers

    assert moe_layers(run.model) == [1, 3]
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    forward = graph[graph["phase"] == "forward"]
    assert forward["op"].str.contains("grouped_mm").sum() == 2 * 2  # two projections in each of 2 MoE layers


def test_variants_refused_with_a_reason():
    with pytest.raises(ConfigError, match="q_lora_rank=8 belongs to multi-head latent attention"):
        compose_run([*LLAMA, "model.q_lora_rank=8"], check="layout")
    with pytest.raises(ConfigError, match="window_kind='global' is not supported; accepted: sliding, chunked"):
        compose_run([*LLAMA, "model.window_size=8", "model.window_kind=global"], check="layout")
    with pytest.raises(ConfigError, match="global_attention_every=2 .* needs model.window_size > 0"):
        compose_run([*LLAMA, "model.global_attention_every=2"], check="layout")
    with pytest.raises(ConfigError, match=r"parallelism.cp=2: .*model.window_size.*not built"):
        compose_run([*LLAMA, "parallelism=cp2", "model.window_size=8"], check="layout")
    with pytest.raises(ConfigError, match="moe_layer_freq=8 .* leaves no MoE layer"):
        compose_run([*LLAMA, "model.num_experts=4", "model.moe_layer_freq=8"], check="layout")
    with pytest.raises(ConfigError, match="kv_lora_rank=16 .* needs model.family='llama'"):
        compose_run([*MLA, "model.family=gpt"], check="layout")


def test_a_configs_approximations_are_every_predictions_warnings():
    from trainsim.timeline.provenance import model_warnings

    run = compose_run(["model=deepseek-v3"], check="layout")
    assert any("multi-token prediction" in w for w in model_warnings(run.model))
    assert model_warnings(compose_run(LLAMA, check="layout").model) == []
