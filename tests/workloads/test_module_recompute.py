"""Megatron's selective recomputation of named modules (parallelism.recompute_modules,
workloads/module_recompute.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.report.efficiency import hardware_flops_per_step
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.model import TransformerChunk
from trainsim.workloads.module_recompute import OutputDiscardingCheckpoint
from trainsim.workloads.moe import ExpertParallel
from trainsim.workloads.routing import RouterCounts

SMALL_MLA = ["model=deepseek-v3", "model.num_layers=3", "model.moe_first_dense_layers=1", "model.hidden_size=64",
             "model.num_attention_heads=4", "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.head_dim=16",
             "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.ffn_hidden_size=96", "model.num_experts=4",
             "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_shared_expert_ffn_hidden_size=32",
             "model.seq_length=32", "model.vocab_size=256"]
EVERY_MODULE = "parallelism.recompute_modules=[core_attn,mla_up_proj,mlp,shared_experts]"


def _gradients(modules: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    run = compose_run([*SMALL_MLA, "parallelism.recompute=selective", modules], check="layout")
    torch.manual_seed(0)
    chunk = TransformerChunk(run.model, layers=range(3), first=True, last=True, tp=1, tp_rank=0, tp_group=None,
                             dtype=torch.float32, recompute="selective", loss_scale=1.0,
                             recompute_modules=tuple(run.parallelism.recompute_modules),
                             ep=ExpertParallel(1, 0, None, RouterCounts(run.model.num_experts, None, 0)))
    tokens = torch.randint(run.model.vocab_size, (2, run.model.seq_length))
    loss = chunk(tokens, tokens)
    loss.backward()
    return loss.detach(), [p.grad for p in chunk.parameters()]


@pytest.mark.parametrize("modules", ["parallelism.recompute_modules=[mla_up_proj]", EVERY_MODULE])
def test_recomputed_modules_train_exactly_as_without_recomputation(modules):
    loss, grads = _gradients("parallelism.recompute_modules=[]")
    again, recomputed = _gradients(modules)
    assert torch.equal(loss, again)
    assert all(torch.equal(a, b) for a, b in zip(grads, recomputed))


def test_discarded_outputs_are_freed_after_their_consumer_and_back_for_its_backward():
    x = torch.randn(4, 3, requires_grad=True)
    checkpoint = OutputDiscardingCheckpoint(lambda t: (t * 2, t.exp()))
    doubled, exp = checkpoint(x)
    out = (doubled * exp).sum()  # the product keeps both
    checkpoint.discard_after(out)
    assert doubled.untyped_storage().nbytes() == 0 and exp.untyped_storage().nbytes() == 0
    out.backward()
    torch.testing.assert_close(x.grad, (2 + 2 * x.detach()) * x.detach().exp())
    with pytest.raises(ValueError, match="own its storage"):
        OutputDiscardingCheckpoint(lambda t: (t.view(-1),))(x)


def test_each_module_frees_activations_and_adds_its_forward_to_the_backward():
    """Traced: saved activations fall and recorded FLOPs grow with each module; the recomputed FLOPs are those the
    HFU counts (report/efficiency.py)."""
    results = {}
    for modules in ("[]", "[mla_up_proj]", "[core_attn,mla_up_proj,mlp,shared_experts]"):
        run = compose_run([*SMALL_MLA, "parallelism.recompute=selective", f"parallelism.recompute_modules={modules}",
                           "parallelism.precision=fp32"])
        trace = trace_layout(run.model, run.parallelism)
        graph = trace.graph.to_pandas()
        results[modules] = (int(trace.memory.to_pandas()["activation_bytes_per_microbatch"].iloc[0]),
                            graph.loc[graph["kind"] == "compute", "flops"].sum(),
                            hardware_flops_per_step(run.group("model"), run.group("parallelism")))
    none, up, every = results["[]"], results["[mla_up_proj]"], results["[core_attn,mla_up_proj,mlp,shared_experts]"]
    assert none[0] > up[0] > every[0]
    assert none[1] < up[1] < every[1]
    assert none[2] < up[2] < every[2]


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.recompute_modules=[moe_act]", "parallelism.recompute=selective"], "not built"),
    (["parallelism.recompute_modules=[attention]", "parallelism.recompute=selective"], "accepted"),
    (["parallelism.recompute_modules=[mla_up_proj]"], "applies with parallelism.recompute='selective'"),
])
def test_invalid_recompute_modules_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match="recompute_modules"):
        compose_run([*SMALL_MLA, *overrides], check="layout")
    with pytest.raises(ConfigError, match=message):
        compose_run([*SMALL_MLA, *overrides], check="layout")


def test_mla_up_proj_needs_latent_attention():
    with pytest.raises(ConfigError, match="latent attention"):
        compose_run(["model=gpt-tiny", "parallelism.recompute=selective",
                     "parallelism.recompute_modules=[mla_up_proj]"], check="layout")


@pytest.mark.slow
def test_up_projections_recomputed_under_tensor_parallelism_keep_the_gradients():
    """The recompute runs the up projections' sequence-parallel all-gathers again inside the backward: the step's
    gradients over gloo are those of the run without recomputation."""
    norms = {}
    for modules in ("[]", "[mla_up_proj]"):
        run = compose_run([*SMALL_MLA, "parallelism=tp2", "parallelism.sequence_parallel=true",
                           "parallelism.precision=fp32", "parallelism.clip_grad=1.0", "parallelism.recompute=selective",
                           f"parallelism.recompute_modules={modules}"])
        norms[modules] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms["[mla_up_proj]"] == pytest.approx(norms["[]"], rel=1e-6)
