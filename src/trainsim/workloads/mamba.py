"""The Mamba-2 mixer of hybrid models (Nemotron-H, Nemotron 3), split over tensor-parallel ranks as Megatron-Core's
MambaMixer splits it.

Dao & Gu 2024, "Transformers are SSMs" (arXiv 2405.21060): in_proj gives z (gate), x, B, C and dt per token; a
causal depthwise convolution and SiLU run over x, B and C; the selective state-space model runs as the chunked SSD
algorithm (quadratic attention-like work inside each chunk, a linear recurrence of states between chunks); the
output is normalised by an RMSNorm gated with SiLU(z), per group, and projected back by out_proj.

Tensor parallelism: heads and groups are split over tp, so in_proj is column-parallel (each rank's z, x, B, C, dt
columns), the convolution, scan and gated norm are local, and out_proj is row-parallel (one all-reduce, or a
reduce-scatter with sequence parallelism, whose all-gather in_proj does, as Megatron-Core's MambaMixer).

The scan is written as plain torch ops (the minimal SSD algorithm), so the trace records its matmuls, cumsums and
exps one by one and the kernel model prices each; Megatron runs it as a few fused Triton kernels that keep the
[chunk, chunk] decay matrices on chip, so the traced scan moves more bytes than those kernels. Those kernels keep
only the scan's inputs for backward and recompute the decays and chunk states inside their backward kernels
(mamba_ssm's _chunk_scan_combined_bwd): the scan is checkpointed, its recomputation noted fused (time of the
backward kernels, not of its own), so its [chunk, chunk] intermediates are not counted as kept. The convolution
(with its SiLU) and the gated norm are one custom op each, as the causal-conv1d and Triton norm kernels are: one
memory-bound pass over their tensors. Shapes: b micro-batch, s sequence, c chunks of l tokens, h heads on this
rank, g groups on this rank, p head channels, n state size.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainsim.config.schema import MAMBA_CHUNK_TOKENS, ModelConfig
from trainsim.workloads.fp8 import Fp8Region
from trainsim.workloads.observe import observer
from trainsim.workloads.tensor_parallel import ColumnParallelLinear, RowParallelLinear

DT_INIT_RANGE = (1e-3, 1e-1)  # cite: Mamba-2 reference MambaMixer dt_min / dt_max (Dao & Gu 2024)
"""Range the time steps are initialised in (log-uniform), through the inverse softplus of dt_bias."""


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 for low-precision tensors (what the fused kernels compute in), the tensor itself otherwise."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(z)
    return sig * (1 + z * (1 - sig))


@torch.library.custom_op("trainsim::causal_conv1d_silu", mutates_args=())
def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv1d) over the sequence: x [b, s, ch], weight [ch, k], bias [ch] -> [b, s, ch]."""
    k = weight.shape[-1]
    pre = nn.functional.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[-1])
    return nn.functional.silu(pre[..., :x.shape[1]]).transpose(1, 2).contiguous()


@causal_conv1d_silu.register_fake
def _(x, weight, bias):
    return torch.empty_like(x)


@torch.library.custom_op("trainsim::causal_conv1d_silu_backward", mutates_args=())
def causal_conv1d_silu_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of causal_conv1d_silu: one pass over x and the gradient, as causal-conv1d's backward."""
    k, ch, s = weight.shape[-1], x.shape[-1], x.shape[1]
    xt = _wide(x.transpose(1, 2))  # [b, ch, s]
    pre = nn.functional.conv1d(xt, _wide(weight).unsqueeze(1), _wide(bias), padding=k - 1, groups=ch)[..., :s]
    dpre = _wide(grad.transpose(1, 2)) * _silu_grad(pre)
    # out[t] = sum_j w[j] x[t - (k-1) + j]: dx[t] = sum_j w[j] dpre[t + (k-1) - j], a convolution of the gradient
    # padded on the right with the flipped kernel
    dx = nn.functional.conv1d(nn.functional.pad(dpre, (0, k - 1)), _wide(weight).flip(-1).unsqueeze(1),
                              groups=ch)
    windows = nn.functional.pad(xt, (k - 1, 0)).unfold(-1, k, 1)  # [b, ch, s, k]
    dweight = torch.einsum("bcs,bcsk->ck", dpre, windows)
    return (dx.transpose(1, 2).to(x.dtype).contiguous(), dweight.to(weight.dtype),
            dpre.sum((0, 2)).to(bias.dtype))


@causal_conv1d_silu_backward.register_fake
def _(grad, x, weight, bias):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_grad(ctx, grad):
    return causal_conv1d_silu_backward(grad.contiguous(), *ctx.saved_tensors)


causal_conv1d_silu.register_autograd(_conv_grad, setup_context=_conv_setup)


@torch.library.custom_op("trainsim::gated_rms_norm", mutates_args=())
def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                   eps: float) -> torch.Tensor:
    """RMSNorm(y * SiLU(z)) * weight, the norm over each group's channels of the last dimension (Mamba-2's
    RMSNormGated with norm_before_gate=False and group_size = inner width / groups)."""
    gated = (_wide(y) * nn.functional.silu(_wide(z))).unflatten(-1, (groups, -1))
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * _wide(weight)).to(y.dtype)


@gated_rms_norm.register_fake
def _(y, z, weight, groups, eps):
    return torch.empty_like(y)


@torch.library.custom_op("trainsim::gated_rms_norm_backward", mutates_args=())
def gated_rms_norm_backward(grad: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, dz, dweight) of gated_rms_norm, recomputing the normalised values from y and z."""
    silu_z = nn.functional.silu(_wide(z))
    gated = (_wide(y) * silu_z).unflatten(-1, (groups, -1))
    rstd = torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    normed = gated * rstd
    dnormed = (_wide(grad) * _wide(weight)).unflatten(-1, (groups, -1))
    dgated = (rstd * (dnormed - normed * (dnormed * normed).mean(-1, keepdim=True))).flatten(-2)
    dweight = (_wide(grad) * normed.flatten(-2)).reshape(-1, y.shape[-1]).sum(0)
    dy = dgated * silu_z
    dz = dgated * _wide(y) * _silu_grad(_wide(z))
    return dy.to(y.dtype), dz.to(z.dtype), dweight.to(weight.dtype)


@gated_rms_norm_backward.register_fake
def _(grad, y, z, weight, groups, eps):
    return torch.empty_like(y), torch.empty_like(z), torch.empty_like(weight)


def _norm_setup(ctx, inputs, output):
    y, z, weight, groups, eps = inputs
    ctx.save_for_backward(y, z, weight)
    ctx.groups, ctx.eps = groups, eps


def _norm_grad(ctx, grad):
    dy, dz, dweight = gated_rms_norm_backward(grad.contiguous(), *ctx.saved_tensors, ctx.groups, ctx.eps)
    return dy, dz, dweight, None, None


gated_rms_norm.register_autograd(_norm_grad, setup_context=_norm_setup)


def _decay(cumulative: torch.Tensor) -> torch.Tensor:
    """exp(segment sums): [..., t] cumulative log-decays -> [..., t, t] with entry (i, j) = exp(cum[i] - cum[j])
    for j <= i, 0 above the diagonal (the causal mask)."""
    t = cumulative.shape[-1]
    segments = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)
    above = torch.ones(t, t, dtype=torch.bool, device=cumulative.device).triu(1)
    return torch.exp(segments.masked_fill(above, float("-inf")))


def _recomputed_inside_the_backward():
    """The scan's checkpoint contexts: the forward as it is; its recomputation noted fused (kept on chip and redone
    by the fused backward kernels)."""
    return contextlib.nullcontext(), observer().kernel_notes(fused=1.0)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             chunk: int) -> torch.Tensor:
    """The selective state-space model y_t = C_t h_t, h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t, by the chunked SSD
    algorithm (Dao & Gu 2024, sec. 6; the reference's ssd_minimal_discrete), with heads in groups sharing B and C.

    x [b, s, h, p], dt [b, s, h] (after softplus, fp32), a [h] (negative), b and c [b, s, g, n], s a multiple of
    `chunk`; returns y [b, s, h, p] in x's dtype (without the D skip)."""
    bsz, s, h, p = x.shape
    g, n = b.shape[-2:]
    nc, hpg = s // chunk, h // g
    log_decay = (dt * a).view(bsz, nc, chunk, h).permute(0, 3, 1, 2)  # [b, h, c, l]
    cumulative = torch.cumsum(log_decay, dim=-1)
    xdt = (x * dt.unsqueeze(-1).to(x.dtype)).view(bsz, nc, chunk, g, hpg, p)
    bc = b.view(bsz, nc, chunk, g, n)
    cc = c.view(bsz, nc, chunk, g, n)
    # 1. inside each chunk: (C B^T, masked by the decays) x, the quadratic "attention" form
    scores = torch.einsum("bclgn,bcsgn->bcgls", cc, bc)  # one per group, shared by its heads
    decays = _decay(cumulative).view(bsz, g, hpg, nc, chunk, chunk).permute(0, 3, 1, 2, 4, 5)
    y_diag = torch.einsum("bcghls,bcsghp->bclghp", scores.unsqueeze(3) * decays.to(x.dtype), xdt)
    # 2. each chunk's final state from its own tokens
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [b, h, c, l]
    to_end = to_end.view(bsz, g, hpg, nc, chunk).permute(0, 3, 4, 1, 2).unsqueeze(-1).to(x.dtype)
    states = torch.einsum("bclgn,bclghp->bcghpn", bc, xdt * to_end)
    # 3. states passed between chunks: a [c + 1, c + 1] decay matrix over the chunks' total decays
    totals = torch.cumsum(nn.functional.pad(cumulative[..., -1], (1, 0)), dim=-1)  # [b, h, c + 1]
    between = _decay(totals).view(bsz, g, hpg, nc + 1, nc + 1)[..., :-1, :].to(x.dtype)  # [b, g, hpg, c, c + 1]
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # no state before the first chunk
    entering = torch.einsum("bghzc,bcghpn->bzghpn", between, states)  # the state entering each chunk
    # 4. each token's output from the state entering its chunk
    from_start = torch.exp(cumulative).view(bsz, g, hpg, nc, chunk).permute(0, 3, 4, 1, 2).unsqueeze(-1)
    y_off = torch.einsum("bclgn,bcghpn->bclghp", cc, entering) * from_start.to(x.dtype)
    return (y_diag + y_off).reshape(bsz, s, h, p)


class MambaMixer(nn.Module):
    """One Mamba-2 mixer on one tp rank: this rank's heads and groups (Megatron-Core MambaMixer)."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype: torch.dtype, sequence_parallel: bool = False,
                 comm_overlap: bool = False, fp8: Fp8Region | None = None):
        super().__init__()
        self.seq_length = cfg.seq_length
        self.heads, self.groups = cfg.mamba_heads // tp, cfg.mamba_num_groups // tp
        self.head_dim, self.state_dim = cfg.mamba_head_dim, cfg.mamba_state_dim
        self.inner = self.heads * self.head_dim  # this rank's share of mamba_heads * mamba_head_dim
        self.norm_eps = cfg.norm_eps
        conv_width = self.inner + 2 * self.groups * self.state_dim  # x, B and C
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, tp * (self.inner + conv_width + self.heads), tp,
                                            tp_group, dtype, False, sequence_parallel, comm_overlap, fp8_region=fp8)
        self.conv_weight = nn.Parameter(torch.empty(conv_width, cfg.mamba_conv_kernel, dtype=dtype))
        nn.init.uniform_(self.conv_weight, -cfg.mamba_conv_kernel ** -0.5, cfg.mamba_conv_kernel ** -0.5)
        self.conv_bias = nn.Parameter(torch.zeros(conv_width, dtype=dtype))
        low, high = DT_INIT_RANGE
        dt = torch.exp(torch.rand(self.heads) * (torch.log(torch.tensor(high)) - torch.log(torch.tensor(low)))
                       + torch.log(torch.tensor(low)))
        self.dt_bias = nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(dtype))  # inverse softplus
        self.a_log = nn.Parameter(torch.log(torch.empty(self.heads).uniform_(1, 16)).to(dtype))
        self.d_skip = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.norm_weight = nn.Parameter(torch.ones(self.inner, dtype=dtype))
        self.out_proj = RowParallelLinear(tp * self.inner, cfg.hidden_size, tp, tp_group, dtype, False,
                                          num_layers=cfg.num_layers, sequence_parallel=sequence_parallel,
                                          comm_overlap=comm_overlap, fp8_region=fp8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, h] (or its sequence-parallel token shard) -> the mixer's output, the same shape."""
        projected = self.in_proj(hidden)
        s = self.seq_length
        bsz = projected[..., 0].numel() // s
        z, xbc, dt = projected.view(bsz, s, -1).split(
            [self.inner, self.inner + 2 * self.groups * self.state_dim, self.heads], dim=-1)
        xbc = causal_conv1d_silu(xbc.contiguous(), self.conv_weight, self.conv_bias)
        x, b, c = xbc.split([self.inner, self.groups * self.state_dim, self.groups * self.state_dim], dim=-1)
        x = x.reshape(bsz, s, self.heads, self.head_dim)
        b = b.reshape(bsz, s, self.groups, self.state_dim)
        c = c.reshape(bsz, s, self.groups, self.state_dim)
        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())
        chunk = min(MAMBA_CHUNK_TOKENS, s)
        pad = -s % chunk  # zero tokens at the end: causal, so earlier outputs are unchanged
        if pad:
            x, b, c = (nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
            dt = nn.functional.pad(dt, (0, 0, 0, pad))
        y = checkpoint(ssd_scan, x, dt, -torch.exp(self.a_log.float()), b, c, chunk, use_reentrant=False,
                       context_fn=_recomputed_inside_the_backward)[:, :s]
        y = y + x[:, :s] * self.d_skip.to(x.dtype).unsqueeze(-1)
        y = gated_rms_norm(y.reshape(bsz, s, self.inner), z.contiguous(), self.norm_weight, self.groups,
                           self.norm_eps)
        return self.out_proj(y)
