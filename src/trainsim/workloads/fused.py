"""Llama's RMSNorm, rotary embedding and SwiGLU as one op each, forward and backward, as Megatron-Core runs them
with Transformer Engine (TE's fused RMSNorm, fused RoPE and SwiGLU kernels).

Written with plain torch ops these are 5-25 kernels each (RMSNorm: cast, square, mean, rsqrt, two multiplies,
more in backward; rotary: strided slices, four multiplies, add, sub, stack), each a pass over the activations.
On a GPU a TE run reads and writes each tensor once. As custom operators (torch.library) the trace records one
op per fused kernel with the bytes it really moves, the analytical kernel model prices it as one memory-bound
pass, and a real run computes the same numbers (the CPU and CUDA implementations below are the unfused math).

A stack without these kernels (torchtitan or plain PyTorch without torch.compile: model.fused_elementwise false)
runs the same math as separate eager ops, and autograd's kernels backward: `RMSNorm(fused=False)`, `rotate` and
`gated_silu` with fused=False trace exactly those ops, each priced as its own pass.
"""

from __future__ import annotations

import torch
from torch import nn


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 for low-precision tensors (what the fused kernels compute in), the tensor itself otherwise."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@torch.library.custom_op("trainsim::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x / rms(x) * weight over the last dimension, in fp32 (at least) inside; rstd [..., 1]."""
    rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
    return (_wide(x) * rstd).to(x.dtype) * weight, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_wide(x).dtype)


@torch.library.custom_op("trainsim::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    normed = _wide(x) * rstd
    grad_normed = _wide(grad) * _wide(weight)
    dx = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    dw = (_wide(grad) * normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm_unfused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as eager PyTorch computes it (torchtitan's RMSNorm without torch.compile): cast, square, mean,
    rsqrt, two multiplies, each a kernel."""
    wide = _wide(x)
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    """torch.nn.RMSNorm's parameters and results, computed by one op each way (`fused`) or eagerly."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, fused: bool = True):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)[0]
        return rms_norm_unfused(x, self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    if inverse:
        sin = -sin
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


@torch.library.custom_op("trainsim::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotate each interleaved pair (x[2i], x[2i+1]) of the last dimension by its angle (cos, sin: [s, d/2]);
    `inverse` rotates back, which is the rotation's gradient."""
    return _rotate(x, cos, sin, inverse)


@rotary.register_fake
def _(x, cos, sin, inverse):
    torch._check(x.shape[-1] == 2 * cos.shape[-1] == 2 * sin.shape[-1],
                 lambda: f"rotary: last dimension {x.shape[-1]} is not twice the tables' {cos.shape[-1]} "
                         "(an odd head dimension?)")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rotary_setup(ctx, inputs, output):
    _, ctx.cos, ctx.sin, ctx.inverse = inputs  # the tables are buffers: nothing saved per micro-batch


def _rotary_grad(ctx, grad):
    return rotary(grad, ctx.cos, ctx.sin, not ctx.inverse), None, None, None


rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


@torch.library.custom_op("trainsim::swiglu", mutates_args=())
def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h = [gate | up] (the fused gate and up projections' output)."""
    return _silu_gate(h)


def _silu_gate(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


@swiglu.register_fake
def _(h):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


@torch.library.custom_op("trainsim::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    gate, up = _wide(h).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad = _wide(grad)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, grad * gate * sig), dim=-1).to(h.dtype)


@swiglu_backward.register_fake
def _(grad, h):
    return torch.empty_like(h)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, grad):
    return swiglu_backward(grad, ctx.saved_tensors[0])


swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


@torch.library.custom_op("trainsim::weighted_swiglu", mutates_args=())
def weighted_swiglu(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """swiglu(h) scaled row by row by `weights` (the token copies' router probabilities): Megatron-Core's
    weighted_bias_swiglu, one kernel that keeps h and the weights, not the unscaled product."""
    return _silu_gate(h) * weights.unsqueeze(-1).to(h.dtype)


@weighted_swiglu.register_fake
def _(h, weights):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


@torch.library.custom_op("trainsim::weighted_swiglu_backward", mutates_args=())
def weighted_swiglu_backward(grad: torch.Tensor, h: torch.Tensor,
                             weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of h, of the weights): the activation recomputed from h."""
    gate, up = _wide(h).chunk(2, dim=-1)
    grad_weights = (_wide(grad) * nn.functional.silu(gate) * up).sum(dim=-1).to(weights.dtype)
    return swiglu_backward(grad * weights.unsqueeze(-1).to(grad.dtype), h), grad_weights


@weighted_swiglu_backward.register_fake
def _(grad, h, weights):
    return torch.empty_like(h), torch.empty_like(weights)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_swiglu_grad(ctx, grad):
    return weighted_swiglu_backward(grad, *ctx.saved_tensors)


weighted_swiglu.register_autograd(_weighted_swiglu_grad, setup_context=_save_inputs)


@torch.library.custom_op("trainsim::weighted_gelu", mutates_args=())
def weighted_gelu(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """gelu(h) (tanh form) scaled row by row by `weights`: the non-gated experts' weighted activation, one kernel that
    keeps h and the weights (Megatron-Core's weighted_squared_relu for Nemotron's experts; GELU stands in)."""
    return nn.functional.gelu(h, approximate="tanh") * weights.unsqueeze(-1).to(h.dtype)


@weighted_gelu.register_fake
def _(h, weights):
    return torch.empty_like(h)


@torch.library.custom_op("trainsim::weighted_gelu_backward", mutates_args=())
def weighted_gelu_backward(grad: torch.Tensor, h: torch.Tensor,
                           weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of h, of the weights): the activation recomputed from h."""
    wide = _wide(h)
    grad_weights = (_wide(grad) * nn.functional.gelu(wide, approximate="tanh")).sum(dim=-1).to(weights.dtype)
    scaled = _wide(grad) * _wide(weights).unsqueeze(-1)
    return torch.ops.aten.gelu_backward(scaled, wide, approximate="tanh").to(h.dtype), grad_weights


@weighted_gelu_backward.register_fake
def _(grad, h, weights):
    return torch.empty_like(h), torch.empty_like(weights)


def _weighted_gelu_grad(ctx, grad):
    return weighted_gelu_backward(grad, *ctx.saved_tensors)


weighted_gelu.register_autograd(_weighted_gelu_grad, setup_context=_save_inputs)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Rotary embedding of x [..., d] by the tables [s, d/2]: one fused op, or eager slices, multiplies and a stack."""
    return rotary(x, cos, sin, False) if fused else _rotate(x, cos, sin, False)


def gated_silu(h: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of h = [gate | up]: one fused op, or eager silu and multiply."""
    return swiglu(h) if fused else _silu_gate(h)
