"""Megatron-Core's cross-entropy loss fusion (model.fused_cross_entropy): the same loss and gradients as the fp32
max / exp / sum path, one fp32 buffer instead of its temporaries."""

from __future__ import annotations

import pytest
import torch
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.tensor_parallel import vocab_parallel_cross_entropy


def test_the_fused_loss_and_its_gradient_are_the_unfused_ones():
    torch.manual_seed(0)
    logits = torch.randn(2, 16, 50, dtype=torch.bfloat16)
    targets = torch.randint(0, 50, (2, 16))
    results = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, targets, 0, None, 1, fused=fused)
        loss.mean().backward()
        results.append((loss.detach(), x.grad.float()))
    expected = torch.nn.functional.cross_entropy(logits.float().view(-1, 50), targets.view(-1), reduction="none")
    assert torch.allclose(results[1][0].view(-1), expected, atol=1e-5)
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6) and torch.allclose(results[0][1], results[1][1])


def test_it_holds_one_fp32_buffer_of_the_logits_not_the_temporaries():
    base = ["model=llama3-8b", "model.num_layers=1", "model.seq_length=1024", "parallelism=single",
            "parallelism.micro_batch_size=1", "parallelism.global_batch_size=1", "parallelism.precision=bf16"]
    transient = {}
    for fused in (False, True):
        run = compose_run([*base, f"model.fused_cross_entropy={fused}"], check="layout")
        transient[fused] = trace_layout(run.model, run.parallelism).memory.to_pandas()["transient_bytes"].iloc[0]
    logits_fp32 = 1024 * run.model.vocab_size * 4
    assert transient[False] - transient[True] >= 0.9 * logits_fp32


def test_megatron_bridge_fuses_it_and_it_trains_like_the_unfused_path_over_gloo():
    assert compose_run(["framework=megatron-bridge"], check="layout").model.fused_cross_entropy
    norms = {}
    for fused in (False, True):
        run = compose_run(["model=llama3-8b", "model.num_layers=2", "model.hidden_size=128",
                           "model.num_attention_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=256",
                           "model.seq_length=64", "model.vocab_size=512", "parallelism=tp2",
                           "parallelism.precision=fp32", "parallelism.clip_grad=1.0",
                           f"model.fused_cross_entropy={fused}"])
        norms[fused] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)
