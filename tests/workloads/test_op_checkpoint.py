"""torchtitan's op-level selective checkpointing (parallelism.recompute 'op', workloads/op_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.workloads.launch import spawn_ranks
from trainsim.workloads.model import TransformerChunk
from trainsim.workloads.tensor_parallel import SeparateColumnLinears

SMALL_LLAMA = ["framework=torchtitan", "model=llama3-8b", "model.num_layers=2", "model.hidden_size=128",
               "model.num_attention_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=256",
               "model.seq_length=64", "model.vocab_size=512"]


def _gradients(recompute: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    run = compose_run(SMALL_LLAMA, check="layout")
    torch.manual_seed(0)
    chunk = TransformerChunk(run.model, layers=range(2), first=True, last=True, tp=1, tp_rank=0, tp_group=None,
                             dtype=torch.float32, recompute=recompute, loss_scale=1.0)
    tokens = torch.randint(run.model.vocab_size, (2, run.model.seq_length))
    loss = chunk(tokens, tokens)
    loss.backward()
    return loss.detach(), [p.grad for p in chunk.parameters()]


def test_op_checkpointing_trains_exactly_as_without_recomputation():
    loss, grads = _gradients("none")
    op_loss, op_grads = _gradients("op")
    assert torch.equal(loss, op_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, op_grads))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallelism=tp2", "parallelism.sequence_parallel=true"],
                                    ["parallelism=dp2", "parallelism.zero_stage=3"]], ids=["tp2-sp", "fsdp2"])
def test_op_checkpointing_keeps_the_gradients_over_gloo(layout):
    """Kept reduce-scatter results (handed back through their alias) and FSDP2's gathers inside the checkpoint: the
    step's gradients are those of the run without recomputation."""
    norms = {}
    for recompute in ("none", "op"):
        run = compose_run([*SMALL_LLAMA, *layout, "parallelism.precision=fp32", "parallelism.clip_grad=1.0",
                           f"parallelism.recompute={recompute}"])
        norms[recompute] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms["op"] == norms["none"]


def test_torchtitan_keeps_its_projections_separate():
    run = compose_run(SMALL_LLAMA, check="layout")
    assert run.model.separate_projections
    chunk = TransformerChunk(run.model, layers=range(1), first=True, last=True, tp=1, tp_rank=0, tp_group=None,
                             dtype=torch.float32, recompute="op", loss_scale=1.0)
    separate = [m for m in chunk.modules() if isinstance(m, SeparateColumnLinears)]
    assert [len(m.linears) for m in separate] == [3, 2]  # wq, wk, wv; w1, w3
    assert not compose_run(["model=llama3-8b"], check="layout").model.separate_projections  # Megatron fuses them


def test_op_checkpointing_is_refused_with_the_overlap_rings():
    with pytest.raises(ConfigError, match="recompute='op' with parallelism.tp_comm_overlap"):
        compose_run([*SMALL_LLAMA, "parallelism=tp2", "parallelism.sequence_parallel=true",
                     "parallelism.tp_comm_overlap=true", "parallelism.recompute=op"], check="layout")
