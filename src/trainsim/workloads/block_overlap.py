"""Tensor-parallel comm-GEMM overlap (Megatron-Core --tp-comm-overlap) with the block-scaled precisions: the twins
of fp8.py's overlapped linears for MXFP8, blockwise and NVFP4 (workloads/block_scaling.py).

The ring carries token shards quantised, each with its block scales, as byte rows: for a GEMM's row-wise
operand one row per token (its values and scales), and where the gathered tensor's column-wise copy is needed
too (wgrad) one row per group of `b` tokens (b = the column-wise blocks' length along the tokens), so that blocks
travel whole. TE's quantisation kernel writes into the communication buffer itself: packing and unpacking here
are copies noted fused (no kernel time of their own). NVFP4's per-tensor amaxes are reduced over the tp group
before a gathered tensor is quantised (the shards must share its scales).

torchao's rowwise recipe (async TP in torchtitan) scales the column-wise copy per column over all the tokens,
which no shard can compute alone: there the ring carries the bf16 shards (torchtitan all-gathers rowwise-scaled
layers in bf16), each arriving block is quantised row-wise (a row's scale needs only that row) for its GEMM,
and the gathered tensor is quantised column-wise once the ring is done.
"""

from __future__ import annotations

import torch

from trainsim.workloads import block_scaling
from trainsim.workloads.block_scaling import BlockQuantized
from trainsim.workloads.observe import observer
from trainsim.workloads.rings import (
    ring_all_gather_matmul,
    ring_matmul_reduce_scatter,
    start_reduce_scatter_tokens,
    wait_all,
)


def _rows(t: torch.Tensor, groups: int) -> torch.Tensor:
    """t's bytes as [groups, bytes per group], t's rows (tokens) split into `groups` consecutive groups."""
    return t.contiguous().view(torch.uint8).reshape(groups, -1)


def _columns(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A column-wise copy [k, tokens] as [groups, bytes]: group g holds every row's g-th run of tokens."""
    k = t.shape[0]
    return t.contiguous().view(torch.uint8).reshape(k, groups, -1).transpose(0, 1).reshape(groups, -1)


def pack(q: BlockQuantized, groups: int, columnwise: bool) -> torch.Tensor:
    """q (of a [tokens, k] tensor) as byte rows, `groups` groups of tokens: the row-wise values and scales, and
    with `columnwise` the column-wise ones."""
    with observer().kernel_notes(fused=1):
        parts = [_rows(q.data, groups), _rows(q.scale, groups)]
        if columnwise:
            parts += [_columns(q.data_t, groups), _columns(q.scale_t, groups)]
        return torch.cat(parts, 1)


def _widths(q: BlockQuantized, groups: int, columnwise: bool) -> list[int]:
    tensors = (q.data, q.scale, q.data_t, q.scale_t) if columnwise else (q.data, q.scale)
    return [t.numel() * t.element_size() // groups for t in tensors]


def unpack(rows: torch.Tensor, like: BlockQuantized, groups_in_like: int, columnwise: bool) -> BlockQuantized:
    """The BlockQuantized of the byte rows `rows` (some or all of pack's rows, from one rank or gathered from
    all), with the dtypes and per-tensor factors of `like` (packed with `groups_in_like` groups)."""
    with observer().kernel_notes(fused=1):
        groups = rows.shape[0]
        tokens = groups * (like.data.shape[0] // groups_in_like)
        pieces = rows.split(_widths(like, groups_in_like, columnwise), 1)
        data = pieces[0].contiguous().view(like.data.dtype).reshape(tokens, -1)
        scale = pieces[1].contiguous().view(like.scale.dtype).reshape(tokens, -1)
        if not columnwise:
            return BlockQuantized(data, scale, like.global_scale, like.data_t, like.scale_t, like.global_scale_t)
        k = like.data_t.shape[0]

        def column(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return piece.reshape(groups, k, -1).transpose(0, 1).contiguous().view(dtype).reshape(k, -1)

        return BlockQuantized(data, scale, like.global_scale, column(pieces[2], like.data_t.dtype),
                              column(pieces[3], like.scale_t.dtype), like.global_scale_t)


def _gather_matmul(x: torch.Tensor, weight: tuple, group, tp: int, role: str, fp8):
    """(all-gather(x) @ weight^T in bf16, the gathered tensor's column-wise copy) with the ring overlapped."""
    block_tokens = getattr(fp8.region.block, f"{role}_block")[1]  # the column-wise blocks' length along the tokens
    gemm = fp8.region.backward_gemm if role == "gradient" else block_scaling.gemm  # the gradient's: dgrad
    n = weight[0].shape[0]
    if block_tokens == 0:  # a column's scale spans every token: the ring carries bf16
        def mm_whole(rows, out):
            y = gemm(fp8.region.quantize_blocks(rows, role, columnwise=False).rowwise, weight)
            with observer().kernel_notes(fused=1):
                out.copy_(y)

        out, gathered = ring_all_gather_matmul(x, x.new_empty((n, 1)), group, tp, mm=mm_whole,
                                               out_dtype=torch.bfloat16)
        return out, fp8.region.quantize_blocks(gathered, role, rowwise=False).columnwise

    q = fp8.region.quantize_blocks(x, role, tp_group=group)
    groups = q.data.shape[0] // block_tokens
    packed = pack(q, groups, columnwise=True)

    def mm(rows, out):  # out: the ring's [groups, block_tokens * n] slice, i.e. these tokens' [tokens, n]
        y = gemm(unpack(rows, q, groups, columnwise=True).rowwise, weight)
        with observer().kernel_notes(fused=1):  # TE's GEMM writes its block of the output in place
            out.view(-1, n).copy_(y)

    out, gathered = ring_all_gather_matmul(packed, packed.new_empty((block_tokens * n, 1)), group, tp, mm=mm,
                                           out_dtype=torch.bfloat16)
    return out.view(-1, n), unpack(gathered, q, groups, columnwise=True).columnwise


class BlockOverlappedColumnLinear(torch.autograd.Function):
    """fp8._Fp8OverlappedColumnLinear with block scales: the quantised shard (both copies) around the ring, a
    GEMM per arriving block; backward: dgrad whole, reduce-scattered behind wgrad on the gathered column-wise
    copy (without `bulk_backward`, before it)."""

    @staticmethod
    def forward(ctx, x, weight, fp8, group, tp, bulk_backward=True):
        w = fp8.block_weight(weight)
        out, gathered_t = _gather_matmul(x.contiguous(), w.rowwise, group, tp, "activation", fp8)
        ctx.save_for_backward(*gathered_t)
        ctx.fp8, ctx.weight_q, ctx.group, ctx.tp = fp8, fp8.kept_for_backward(weight, w), group, tp
        ctx.bulk_backward = bulk_backward
        return out

    @staticmethod
    def backward(ctx, grad):
        x_t = ctx.saved_tensors
        gq = ctx.fp8.region.quantize_blocks(grad.contiguous(), "gradient")
        grad_input = ctx.fp8.region.backward_gemm(gq.rowwise, ctx.fp8.block_for_backward(ctx.weight_q).columnwise)
        grad_x, scattering = start_reduce_scatter_tokens(grad_input, ctx.group, ctx.tp, ctx.bulk_backward)
        wgrad = ctx.fp8.region.backward_gemm(gq.columnwise, x_t)
        wait_all(scattering)
        return grad_x, wgrad, None, None, None, None


class BlockOverlappedRowLinear(torch.autograd.Function):
    """fp8._Fp8OverlappedRowLinear with block scales: a GEMM per token block (its row-wise values and scales)
    into the ring reduce-scatter; backward gathers the quantised output gradient (both copies) around the ring
    for dgrad, and wgrad runs on the gathered column-wise copy."""

    @staticmethod
    def forward(ctx, x, weight, fp8, group, tp):
        q = fp8.region.quantize_blocks(x.contiguous(), "activation")
        w = fp8.block_weight(weight)
        tokens = q.data.shape[0]
        rows = pack(q, tokens, columnwise=False)  # one byte row per token

        def mm(block):
            return block_scaling.gemm(unpack(block, q, tokens, columnwise=False).rowwise, w.rowwise)

        y = ring_matmul_reduce_scatter(rows, rows.new_empty((w.data.shape[0], 1)), group, tp, mm=mm)
        ctx.save_for_backward(*q.columnwise)
        ctx.fp8, ctx.weight_q, ctx.group, ctx.tp = fp8, fp8.kept_for_backward(weight, w), group, tp
        return y

    @staticmethod
    def backward(ctx, grad):
        x_t = ctx.saved_tensors
        w = ctx.fp8.block_for_backward(ctx.weight_q)
        grad_x, gathered_t = _gather_matmul(grad.contiguous(), w.columnwise, ctx.group, ctx.tp, "gradient", ctx.fp8)
        wgrad = ctx.fp8.region.backward_gemm(gathered_t, x_t)
        return grad_x, wgrad, None, None, None
