"""Megatron-Core's selective recomputation of named modules (--recompute-granularity selective
--recompute-modules; parallelism.recompute 'selective' with parallelism.recompute_modules).

Two kinds, as Megatron builds them:
* a module checkpointed whole (torch.utils.checkpoint): 'core_attn', 'mlp' (dense MLPs only: Megatron skips MoE
  layers), 'shared_experts'. Its inputs are kept, its inner activations recomputed in backward;
* a module whose outputs feed an op that keeps them ('mla_up_proj': the latents' up projections and rotary
  embedding, whose q, k and v the core attention keeps): `OutputDiscardingCheckpoint`, Megatron's
  CheckpointWithoutOutput. It runs without a graph, and once the consumer has run, the outputs' storage is freed;
  a hook before the consumer's backward runs the module again and copies the values back (storage to storage, as
  Megatron; that copy is not among the traced ops), then its backward runs through the recomputed graph. Only its
  inputs stay in memory, and the consumer itself is not recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainsim.workloads.observe import observer


class OutputDiscardingCheckpoint:
    """One call of `fn` whose outputs are dropped after their consumer ran and recomputed before its backward."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.fn = fn
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.recomputed: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.outputs = _WithoutGraph.apply(self, *inputs)
        return self.outputs

    def discard_after(self, consumer_output: torch.Tensor) -> None:
        """Free the outputs (the consumer that produced `consumer_output` has kept what it needs of them) and
        recompute them when its backward is about to run."""
        for out in self.outputs:
            out.untyped_storage().resize_(0)
            observer().released(out)
        consumer_output.grad_fn.register_prehook(self._recompute)

    def _recompute(self, grad_outputs) -> None:
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.inputs)
        with torch.enable_grad():
            recomputed = self.fn(*inputs)
        for out, again in zip(self.outputs, recomputed):  # storage to storage: the kept tensors' versions stay
            out.untyped_storage().resize_(again.untyped_storage().nbytes())
            out.untyped_storage().copy_(again.untyped_storage())
        self.recomputed = inputs, recomputed


class _WithoutGraph(torch.autograd.Function):
    """The checkpoint's forward (no graph kept, the inputs saved) and backward (through the recomputed graph)."""

    @staticmethod
    def forward(ctx, checkpoint: OutputDiscardingCheckpoint, *inputs):
        ctx.checkpoint = checkpoint
        ctx.save_for_backward(*inputs)
        checkpoint.inputs = inputs
        outputs = tuple(checkpoint.fn(*inputs))
        if any(out._base is not None for out in outputs):  # freeing a view's storage would free its base's
            raise ValueError("OutputDiscardingCheckpoint: every output must own its storage (not a view)")
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.checkpoint.recomputed
        ctx.checkpoint.recomputed = None
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return (None, *(t.grad if t.requires_grad else None for t in inputs))
