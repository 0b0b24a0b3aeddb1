"""The experts of an MoE layer as grouped GEMMs: one kernel for all local experts, as Megatron-Core's
GroupedMLP (`--moe-grouped-gemm`, Transformer Engine's GroupedLinear / CUTLASS grouped GEMM) runs them.

Tokens arrive sorted by expert; expert e owns rows [offset_e, offset_e + counts[e]) of x and weight w[e]. The
token counts are a list of ints, not a tensor, as TE's `m_splits`: they are known on the host (the dispatcher
all-gathered them) and, being an argument of the op, they are recorded in the trace, so replaying a traced call
runs the very group sizes of the step. The real computation is torch._grouped_mm (one kernel on a Hopper GPU;
elsewhere torch's own fallback); where it cannot run (a torch build without it, a dtype it refuses) each group is
multiplied in turn: the same numbers, then as many kernels as experts.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import register_flop_formula

from trainsim.workloads.block_scaling import dequantize

_REFUSED: set[tuple[str, torch.dtype]] = set()
"""(device type, dtype) pairs torch._grouped_mm refused in this process: not tried again."""


@functools.lru_cache(maxsize=64)
def _offsets(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The groups' end rows on the device. Kept for calls with the same counts: the copy from the host waits for
    the device, which a CUDA graph cannot capture, so a replayed call (warmed up first) runs the kernel alone, as
    Megatron-Core's does (it computes the offsets on the device)."""
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def _grouped(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """torch._grouped_mm(a, b) over the groups, or None where this torch cannot."""
    key = (a.device.type, a.dtype)
    if not hasattr(torch, "_grouped_mm") or key in _REFUSED:
        return None
    try:
        return torch._grouped_mm(a, b, offs=_offsets(tuple(counts), a.device))
    except (RuntimeError, NotImplementedError):
        if a.is_cuda and torch.cuda.is_current_stream_capturing():
            raise  # the capture failed, not the op
        _REFUSED.add(key)
        return None


@torch.library.custom_op("trainsim::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[T, k] x [E, k, n] -> [T, n]: each expert's rows of x times its weight (sum(counts) == T)."""
    out = _grouped(x, w, counts)
    if out is None:
        parts = [part @ w[e] for e, part in enumerate(x.split(counts))]
        out = torch.cat(parts) if parts else x.new_empty((0, w.shape[-1]))
    return out


@grouped_mm.register_fake
def _(x, w, counts):
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("trainsim::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[T, k], [T, n] -> [E, k, n]: each expert's x^T grad over its rows (zeros for an expert without tokens)."""
    out = _grouped(x.t(), grad, counts)
    if out is None:
        out = torch.stack([xe.t() @ ge for xe, ge in zip(x.split(counts), grad.split(counts))])
    return out


@grouped_mm_weight_grad.register_fake
def _(x, grad, counts):
    return x.new_empty((len(counts), x.shape[1], grad.shape[1]))


def _setup(ctx, inputs, output):
    x, w, counts = inputs
    ctx.save_for_backward(x, w)
    ctx.counts = counts


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(x, grad, ctx.counts) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


@register_flop_formula([torch.ops.trainsim.grouped_mm, torch.ops.trainsim.grouped_mm_weight_grad])
def _grouped_flops(a_shape, b_shape, counts, *args, out_shape=None, **kwargs) -> int:
    """2 T k n for both: every row of the first operand meets one group's [k, n] (or [T, k] x [T, n])."""
    rows = a_shape[0]
    return 2 * rows * a_shape[1] * b_shape[-1]


# -- FP8 (Transformer Engine's GroupedLinear under fp8_autocast; workloads/fp8.py quantizes) ----------------------


def _groups(counts: list[int]) -> list[slice]:
    """Each expert's slice of the tokens."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()
    return [slice(end - c, end) for c, end in zip(counts, ends)]


def _block_scaled(scale_a: torch.Tensor, scale_b: torch.Tensor) -> bool:
    """Block scales (MXFP8, blockwise: workloads/block_scaling.py) rather than one fp32 scale per tensor."""
    return scale_a.dim() > 0 or scale_b.dim() > 0


def _dequantized(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(t, scale, torch.ones((), device=t.device))


def _fp8_gemm(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """a @ b_t.t() in FP8, bf16 out: cuBLASLt's FP8 GEMM wants `a` row-major and the second operand K-major.
    Block-scaled operands are dequantised and multiplied in fp32 (torch has no block-scaled GEMM off Blackwell)."""
    if _block_scaled(scale_a, scale_b):
        return (_dequantized(a, scale_a) @ _dequantized(b_t, scale_b).t()).to(torch.bfloat16)
    return torch._scaled_mm(a.contiguous(), b_t.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=torch.bfloat16)


@torch.library.custom_op("trainsim::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   counts: list[int]) -> torch.Tensor:
    """FP8 [T, k] times, per expert e, b_t[e].t() (b_t [E, n, k], K-major) -> bf16 [T, n]: the forward GEMM
    (b_t = the experts' transposed FP8 weights) and the input gradient (b_t = the FP8 weights [E, k, n])."""
    row_scales = scale_a.dim() > 0  # a block scale per token row (1 x 32, 1 x 128 blocks)
    parts = [_fp8_gemm(a[rows], b_t[e], scale_a[rows] if row_scales else scale_a, scale_b[e] if scale_b.dim() else
                       scale_b) for e, rows in enumerate(_groups(counts))]
    return torch.cat(parts) if parts else a.new_empty((0, b_t.shape[1]), dtype=torch.bfloat16)


@fp8_grouped_mm.register_fake
def _(a, b_t, scale_a, scale_b, counts):
    return a.new_empty((a.shape[0], b_t.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("trainsim::fp8_grouped_mm_weight_grad", mutates_args=())
def fp8_grouped_mm_weight_grad(x_t: torch.Tensor, grad_t: torch.Tensor, scale_x: torch.Tensor,
                               scale_grad: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """FP8 x^T [k, T] and grad^T [n, T] (both K-major over the tokens, as TE keeps them for wgrad) -> bf16
    [E, k, n]: each expert's x_e^T grad_e over its tokens. Block scales run along the tokens, across the experts'
    boundaries, so block-scaled operands are dequantised whole first."""
    if _block_scaled(scale_x, scale_grad):
        x_t, grad_t = _dequantized(x_t, scale_x), _dequantized(grad_t, scale_grad)
        return torch.stack([(x_t[:, cols] @ grad_t[:, cols].t()).to(torch.bfloat16) for cols in _groups(counts)])
    return torch.stack([_fp8_gemm(x_t[:, cols], grad_t[:, cols], scale_x, scale_grad)
                        for cols in _groups(counts)])


@fp8_grouped_mm_weight_grad.register_fake
def _(x_t, grad_t, scale_x, scale_grad, counts):
    return x_t.new_empty((len(counts), x_t.shape[0], grad_t.shape[0]), dtype=torch.bfloat16)


@register_flop_formula([torch.ops.trainsim.fp8_grouped_mm])
def _fp8_grouped_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@register_flop_formula([torch.ops.trainsim.fp8_grouped_mm_weight_grad])
def _fp8_weight_grad_flops(x_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[0]
