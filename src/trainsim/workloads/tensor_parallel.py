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

from trainsim.workloads import fp8
from trainsim.workloads.collectives import (
    all_gather_flat,
    all_gather_uneven,
    reduce_scatter_flat,
    reduce_scatter_uneven,
)
from trainsim.workloads.observe import observer
from trainsim.workloads.rings import (
    ring_all_gather_matmul,
    ring_matmul_reduce_scatter,
    start_all_gather_tokens,
    start_reduce_scatter_tokens,
    wait_all,
)


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


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron's sequence-parallel g-bar: all-gather the token shards in forward, reduce-scatter the
    gradient in backward (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.2.2)."""

    @staticmethod
    def forward(ctx, x, group, tp, group_kind):
        ctx.group, ctx.tp, ctx.kind = group, tp, group_kind
        return all_gather_tokens(x, group, tp, group_kind)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_tokens(grad, ctx.group, ctx.tp, ctx.kind), None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Megatron's sequence-parallel g: reduce-scatter partial sums over tokens in forward, all-gather the
    gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, tp, group_kind):
        ctx.group, ctx.tp, ctx.shape, ctx.kind = group, tp, x.shape, group_kind
        return reduce_scatter_tokens(x, group, tp, group_kind)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_tokens(grad, ctx.group, ctx.tp, ctx.kind).view(ctx.shape), None, None, None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's token shard (no communication); all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, tp):
        ctx.group, ctx.tp, ctx.shape = group, tp, x.shape
        tokens = x.reshape(-1, x.shape[-1])
        shard = tokens.shape[0] // tp
        rank = dist.get_rank(group)
        return tokens[rank * shard:(rank + 1) * shard].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_tokens(grad, ctx.group, ctx.tp).view(ctx.shape), None, None


def all_gather_tokens(x: torch.Tensor, group, tp: int, group_kind: str | None = None) -> torch.Tensor:
    """[t, h] shards -> [tp * t, h] (rank order)."""
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with observer().communication(group_kind=group_kind):
        all_gather_flat(out, x, group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group, tp: int, group_kind: str | None = None) -> torch.Tensor:
    """Partial sums over all tokens ([..., h], tokens flattened) -> this rank's [tokens / tp, h] of the sum.

    The sum is returned through an alias (no kernel): torchtitan's op-level checkpointing keeps a reduce-scatter's
    result instead of running it again, and where it does (workloads/op_checkpoint.py) the recompute gets the kept
    result from the alias, the in-place collective's new buffer staying unfilled."""
    x = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((x.shape[0] // tp, x.shape[1]), dtype=x.dtype, device=x.device)
    with observer().communication(group_kind=group_kind):
        reduce_scatter_flat(out, x, group=group)
    return torch.ops.aten.alias(out)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Sequence-parallel column-parallel linear as Megatron-LM's LinearWithGradAccumulationAndAsync-
    Communication runs it: forward all-gathers the token shards and multiplies, keeping only the shard for
    backward (Korthikanti et al. 2022, sec. 4.2.3: the gathered input is not stored); backward all-gathers
    it again behind the input-gradient GEMM, then reduce-scatters the input gradient behind the weight-
    gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, tp):
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tp, ctx.has_bias = group, tp, bias is not None
        return nn.functional.linear(all_gather_tokens(x, group, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x, grad_weight, scattering = column_linear_backward(x, weight, grad, ctx.group, ctx.tp)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        wait_all(scattering)
        return grad_x, grad_weight, grad_bias, None, None


def column_linear_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, group, tp: int
                           ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A sequence-parallel column-parallel linear's backward with its communication in bulk: the token shard
    all-gathered behind the whole input-gradient GEMM, the input gradient reduce-scattered behind the weight-
    gradient GEMM (Megatron-LM's async path; Transformer Engine's "bulk" overlap of qkv_dgrad / fc1_dgrad).
    Returns (grad_x, grad_weight, the reduce-scatter's works: the caller waits)."""
    gathered, gathering = start_all_gather_tokens(x, group, tp)
    grad_input = grad.mm(weight)
    wait_all(gathering)
    grad_x, scattering = start_reduce_scatter_tokens(grad_input, group, tp)
    return grad_x, grad.t().mm(gathered), scattering


class _OverlappedColumnLinear(torch.autograd.Function):
    """Sequence-parallel column-parallel linear with its communication overlapped as Transformer Engine's
    defaults do (Megatron-Core --tp-comm-overlap): forward all-gather + GEMM by ring exchange (qkv_fprop,
    fc1_fprop: "ring_exchange", tp blocks); backward in bulk (qkv_dgrad, fc1_dgrad: "bulk", whole GEMMs,
    `column_linear_backward`). Only the token shard is kept for backward.

    Without `bulk_backward` (torch's micro-pipelined async TP, model.tp_overlap_backward 'none') the gathered input
    is kept from the ring instead, and the input gradient is reduce-scattered with nothing to hide it."""

    @staticmethod
    def forward(ctx, x, weight, group, tp, bulk_backward=True):
        x = x.contiguous()
        out, gathered = ring_all_gather_matmul(x, weight, group, tp)
        ctx.save_for_backward(x if bulk_backward else gathered, weight)
        ctx.group, ctx.tp, ctx.bulk_backward = group, tp, bulk_backward
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.bulk_backward:
            grad_x, grad_weight, scattering = column_linear_backward(x, weight, grad, ctx.group, ctx.tp)
        else:
            grad_x, scattering = start_reduce_scatter_tokens(grad.mm(weight), ctx.group, ctx.tp,
                                                             behind_next_gemm=False)
            grad_weight = grad.t().mm(x)
        wait_all(scattering)
        return grad_x, grad_weight, None, None, None


class _OverlappedRowLinear(torch.autograd.Function):
    """Sequence-parallel row-parallel linear with its communication overlapped by ring exchange:
    forward GEMM + reduce-scatter, backward all-gather of the output gradient + GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, tp):
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tp = group, tp
        return ring_matmul_reduce_scatter(x, weight, group, tp)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, gathered = ring_all_gather_matmul(grad.contiguous(), weight.t(), ctx.group, ctx.tp)
        return grad_x, gathered.t().mm(x), None, None


def gather_from_sp(x: torch.Tensor, group, tp: int, group_kind: str | None = None) -> torch.Tensor:
    """All-gather token shards (gradient: reduce-scatter); group_kind names the group where another kind's has
    the same ranks (MoE's all-gather dispatcher uses it over the expert-parallel group)."""
    return _GatherFromSequenceParallel.apply(x, group, tp, group_kind)


def reduce_scatter_to_sp(x: torch.Tensor, group, tp: int, group_kind: str | None = None) -> torch.Tensor:
    """Reduce-scatter partial sums over tokens (gradient: all-gather)."""
    return _ReduceScatterToSequenceParallel.apply(x, group, tp, group_kind)


class _GatherUneven(torch.autograd.Function):
    """All-gather rows of uneven counts (sizes[i] from group rank i) in forward, reduce-scatter them in backward
    (Megatron-Core's gather_from_sequence_parallel_region with output_split_sizes)."""

    @staticmethod
    def forward(ctx, x, sizes, group, group_kind):
        ctx.sizes, ctx.group, ctx.kind = sizes, group, group_kind
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        all_gather_uneven(list(out.split(sizes)), x.contiguous(), group, group_kind)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatterUneven.apply(grad, ctx.sizes, ctx.group, ctx.kind), None, None, None


class _ReduceScatterUneven(torch.autograd.Function):
    """Sum partial rows over the group and keep this rank's sizes[rank] of them in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, sizes, group, group_kind):
        ctx.sizes, ctx.group, ctx.kind = sizes, group, group_kind
        out = x.new_empty((sizes[dist.get_rank(group)], *x.shape[1:]))
        reduce_scatter_uneven(out, list(x.contiguous().split(sizes)), group, group_kind)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _GatherUneven.apply(grad, ctx.sizes, ctx.group, ctx.kind), None, None, None


def gather_uneven(x: torch.Tensor, sizes: list[int], group, group_kind: str) -> torch.Tensor:
    """[sizes[me], h] -> [sum(sizes), h], group rank order (gradient: reduce-scatter)."""
    return _GatherUneven.apply(x, sizes, group, group_kind)


def reduce_scatter_uneven_rows(x: torch.Tensor, sizes: list[int], group, group_kind: str) -> torch.Tensor:
    """[sum(sizes), h] partial sums -> this rank's [sizes[me], h] of the sum (gradient: all-gather)."""
    return _ReduceScatterUneven.apply(x, sizes, group, group_kind)


def scatter_to_sp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _ScatterToSequenceParallel.apply(x, group, tp)


def copy_to_tp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group) if tp > 1 else x


def reduce_from_tp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group) if tp > 1 else x


def _init_weight(out_features: int, in_features: int, dtype: torch.dtype, std: float) -> nn.Parameter:
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.normal_(weight, std=std)
    return nn.Parameter(weight)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split by output rows; each rank keeps its slice of y (no gather). With sequence
    parallelism the input arrives as this rank's token shard [t / tp, h] and is all-gathered first (the
    output is then [t, out / tp], tokens flattened)."""

    def __init__(self, in_features: int, out_features: int, tp: int, group, dtype, bias: bool = True,
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8_region=None,
                 input_ready: bool = False, bulk_backward: bool = True):
        super().__init__()
        self.tp, self.group, self.sequence_parallel = tp, group, sequence_parallel and tp > 1
        self.comm_overlap = comm_overlap and self.sequence_parallel
        self.bulk_backward = bulk_backward
        """With comm_overlap: the backward's communication in bulk behind its GEMMs (model.tp_overlap_backward)."""
        self.input_ready = input_ready
        """The input arrives gathered (or copied into the tensor-parallel region) by the caller, once for several
        linears (SeparateColumnLinears): only the GEMM runs here (built without sequence_parallel or comm_overlap)."""
        self.weight = _init_weight(out_features // tp, in_features, dtype, std=0.02)
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype)) if bias else None
        self.fp8 = fp8.Fp8Linear(fp8_region, group) if fp8_region is not None else None  # FP8 GEMMs (fp8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_overlap:
            x = x.reshape(-1, x.shape[-1])
            if self.fp8:
                y = fp8.fp8_overlapped_column_linear(x, self.weight, self.fp8, self.group, self.tp, self.bulk_backward)
            else:
                y = _OverlappedColumnLinear.apply(x, self.weight, self.group, self.tp, self.bulk_backward)
            return y + self.bias if self.bias is not None else y
        if self.sequence_parallel and not self.fp8:
            return _SequenceParallelColumnLinear.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias,
                                                       self.group, self.tp)
        if self.sequence_parallel and fp8.gathers_fp8(self.fp8):
            y = fp8.fp8_gathered_column_linears(x.reshape(-1, x.shape[-1]), [self.weight], [self.fp8], self.group,
                                                self.tp, self.bulk_backward)
            return y + self.bias if self.bias is not None else y
        if not self.input_ready:
            x = gather_from_sp(x, self.group, self.tp) if self.sequence_parallel else copy_to_tp(x, self.group, self.tp)
        if self.fp8:
            return fp8.fp8_linear(x, self.weight, self.bias, self.fp8)
        return nn.functional.linear(x, self.weight, self.bias)


class SeparateColumnLinears(nn.Module):
    """Column-parallel projections a framework keeps as separate linears over one input (torchtitan's wq, wk, wv and
    w1, w3): the input is gathered from the sequence-parallel shards (or copied into the tensor-parallel region)
    once, as torchtitan's PrepareModuleInput does, then each projection runs its own GEMM. The outputs are returned
    side by side, as one fused linear's output would be; the concatenation is noted fused (the framework reads each
    projection's output where its GEMM wrote it)."""

    def __init__(self, in_features: int, widths: list[int], tp: int, group, dtype, bias: bool = True,
                 sequence_parallel: bool = False, fp8_region=None):
        super().__init__()
        self.tp, self.group, self.sequence_parallel = tp, group, sequence_parallel and tp > 1
        self.linears = nn.ModuleList(ColumnParallelLinear(in_features, width, tp, group, dtype, bias,
                                                          fp8_region=fp8_region, input_ready=True)
                                     for width in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and fp8.gathers_fp8(self.linears[0].fp8):
            # the input cast to FP8 once and gathered in FP8 (torchtitan's PrepareFloat8ModuleInput)
            y = fp8.fp8_gathered_column_linears(x.reshape(-1, x.shape[-1]), [lin.weight for lin in self.linears],
                                                [lin.fp8 for lin in self.linears], self.group, self.tp,
                                                bulk_backward=False)
            if self.linears[0].bias is None:
                return y
            with observer().kernel_notes(fused=1):  # each GEMM adds its own bias
                return y + torch.cat([lin.bias for lin in self.linears])
        x = gather_from_sp(x, self.group, self.tp) if self.sequence_parallel else copy_to_tp(x, self.group, self.tp)
        outputs = [linear(x) for linear in self.linears]
        with observer().kernel_notes(fused=1):
            return torch.cat(outputs, -1)


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by input columns; partial products are all-reduced, then bias added. With
    sequence parallelism they are reduce-scattered over tokens instead: y is this rank's [t / tp, out]."""

    def __init__(self, in_features: int, out_features: int, tp: int, group, dtype, bias: bool = True,
                 num_layers: int = 1, sequence_parallel: bool = False, comm_overlap: bool = False, fp8_region=None):
        super().__init__()
        self.tp, self.group, self.sequence_parallel = tp, group, sequence_parallel and tp > 1
        self.comm_overlap = comm_overlap and self.sequence_parallel
        # GPT-2 / Megatron scaled init of output projections: std 0.02 / sqrt(2 * layers)
        self.weight = _init_weight(out_features, in_features // tp, dtype, std=0.02 / math.sqrt(2 * num_layers))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True  # added to a token shard: its gradient is partial
        self.fp8 = fp8.Fp8Linear(fp8_region, group) if fp8_region is not None else None  # FP8 GEMMs (fp8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_overlap:
            x = x.reshape(-1, x.shape[-1])
            y = (fp8.fp8_overlapped_row_linear(x, self.weight, self.fp8, self.group, self.tp) if self.fp8
                 else _OverlappedRowLinear.apply(x, self.weight, self.group, self.tp))
            return y + self.bias if self.bias is not None else y
        if self.sequence_parallel and fp8.gathers_fp8(self.fp8) and self.fp8.region.settings.gathers_gradients:
            y = fp8.fp8_gradient_gathered_row_linear(x.reshape(-1, x.shape[-1]), self.weight, self.fp8, self.group,
                                                     self.tp)
            return y + self.bias if self.bias is not None else y
        y = fp8.fp8_linear(x, self.weight, None, self.fp8) if self.fp8 else nn.functional.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.group, self.tp)
        else:
            y = reduce_from_tp(y, self.group, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-shard tokens read zeros, then all-reduce (or, with
    `scatter_tokens`, reduce-scatter into this rank's sequence-parallel token shard: Megatron-Core's
    reduce_scatter_embeddings where no position embedding is added after the lookup, torchtitan's RowwiseParallel
    embedding with Shard(1) output)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: int, tp_rank: int, group, dtype):
        super().__init__()
        self.tp, self.group = tp, group
        self.shard_size = vocab_size // tp
        self.vocab_start = tp_rank * self.shard_size
        self.weight = _init_weight(self.shard_size, hidden_size, dtype, std=0.02)

    def forward(self, tokens: torch.Tensor, scatter_tokens: bool = False) -> torch.Tensor:
        if self.tp == 1:
            return nn.functional.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        local = local.masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if scatter_tokens:
            return reduce_scatter_to_sp(out, self.group, self.tp)
        return reduce_from_tp(out, self.group, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits with three all-reduces (max, target logit, sum-exp).

    Megatron-LM core/tensor_parallel/cross_entropy.py; the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        target_logit, local, outside = _target_logits(shifted, targets, vocab_start, group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron: the softmax is not needed after this
        _subtract_targets(grad, local, outside)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-Core's cross-entropy loss fusion as Megatron-Bridge runs it (cross_entropy_fusion_impl 'te',
    Transformer Engine's Triton kernel): one kernel reads the logits and writes the loss and the fp32 gradient
    (softmax minus the target's one-hot), which backward scales in place. Here the same math runs in place on that
    one fp32 buffer: the cast that fills it stands for the kernel's pass over the logits and the in-place steps are
    noted fused, so the step holds the logits and that buffer, not the unfused path's fp32 temporaries."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        grad = logits.to(torch.float32, copy=True)  # its own buffer also for fp32 logits (the kernel's output)
        with observer().kernel_notes(fused=1):
            logits_max = grad.max(dim=-1).values
            _all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
            grad.sub_(logits_max.unsqueeze(-1))
            target_logit, local, outside = _target_logits(grad, targets, vocab_start, group)
            grad.exp_()
            sum_exp = grad.sum(dim=-1)
            _all_reduce(sum_exp, group)
            loss = sum_exp.log() - target_logit
            grad.div_(sum_exp.unsqueeze(-1))
            _subtract_targets(grad, local, outside)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def _target_logits(shifted, targets, vocab_start: int, group):
    """(each token's target logit, summed over the vocabulary shards; its index in this shard; whether it lies
    outside this shard)."""
    local = targets - vocab_start
    outside = (local < 0) | (local >= shifted.shape[-1])
    local = local.masked_fill(outside, 0)
    target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    _all_reduce(target_logit, group)
    return target_logit, local, outside


def _subtract_targets(softmax, local, outside) -> None:
    """softmax minus the targets' one-hot, in place: the loss's gradient before its scale."""
    rows = softmax.view(-1, softmax.shape[-1])
    rows[torch.arange(rows.shape[0], device=rows.device), local.flatten()] -= (~outside).flatten().to(softmax.dtype)


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is None:  # tp = 1: nothing to combine
        return
    with observer().communication():
        dist.all_reduce(tensor, op=op, group=group)


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group, tp: int,
                                 fused: bool = False) -> torch.Tensor:
    """Per-token loss with Megatron's kernels, also when the vocabulary is not sharded (Megatron runs the
    same fp32 max / exp / sum path at tp = 1, without the all-reduces); `fused`: its cross-entropy loss fusion."""
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(logits, targets, vocab_start, group if tp > 1 else None)
