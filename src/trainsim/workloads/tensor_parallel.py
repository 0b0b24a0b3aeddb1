"""Megatron-LM tensor parallelism: column/row-parallel linears, vocab-parallel embedding and loss.

Follows Shoeybi et al., "Megatron-LM" (arXiv 1909.08053), section 3: the MLP and attention are
split so each block needs one all-reduce in forward (g) and one in backward (f). The collectives
go through torch.distributed, so the same code runs over gloo/NCCL for real and over the
recording fake process group when traced.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from trainsim.workloads.observe import observer


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with observer().communication():
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce of partial sums in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        with observer().communication():
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group) if tp > 1 else x


def reduce_from_tp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group) if tp > 1 else x


def _init_weight(out_features: int, in_features: int, dtype: torch.dtype, std: float) -> nn.Parameter:
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.normal_(weight, std=std)
    return nn.Parameter(weight)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split by output rows; each rank keeps its slice of y (no gather)."""

    def __init__(self, in_features: int, out_features: int, tp: int, group, dtype, bias: bool = True):
        super().__init__()
        self.tp, self.group = tp, group
        self.weight = _init_weight(out_features // tp, in_features, dtype, std=0.02)
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(copy_to_tp(x, self.group, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by input columns; partial products are all-reduced, then bias added."""

    def __init__(self, in_features: int, out_features: int, tp: int, group, dtype, bias: bool = True,
                 num_layers: int = 1):
        super().__init__()
        self.tp, self.group = tp, group
        # GPT-2 / Megatron scaled init of output projections: std 0.02 / sqrt(2 * layers)
        self.weight = _init_weight(out_features, in_features // tp, dtype, std=0.02 / math.sqrt(2 * num_layers))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(nn.functional.linear(x, self.weight), self.group, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-shard tokens read zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: int, tp_rank: int, group, dtype):
        super().__init__()
        self.tp, self.group = tp, group
        self.shard_size = vocab_size // tp
        self.vocab_start = tp_rank * self.shard_size
        self.weight = _init_weight(self.shard_size, hidden_size, dtype, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return nn.functional.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        local = local.masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits with three all-reduces (max, target logit, sum-exp).

    Megatron-LM core/tensor_parallel/cross_entropy.py; the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        with observer().communication():
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        shard = logits.shape[-1]
        local = targets - vocab_start
        outside = (local < 0) | (local >= shard)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        with observer().communication():
            dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        with observer().communication():
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local.unsqueeze(-1), 1.0)
        grad.sub_(onehot * (~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group, tp: int) -> torch.Tensor:
    """Per-token loss; plain cross-entropy when the vocabulary is not sharded."""
    if tp == 1:
        return nn.functional.cross_entropy(
            logits.float().flatten(0, -2), targets.flatten(), reduction="none"
        ).view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)
