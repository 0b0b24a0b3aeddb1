"""Core attention: softmax(q k^T * scale + mask) v of one layer, with the variants of current models.

Full causal attention runs torch's fused kernel (scaled_dot_product_attention, is_causal) or Megatron's unfused
path. The variants run the same fused kernel with an explicit additive mask, built once per layer shape:
* windows (model.window_size): 'sliding', a query sees itself and the window_size - 1 tokens before it (Mistral,
  GPT-OSS); 'chunked', a query sees the earlier tokens of its own window_size-token chunk (Llama 4).
* attention sinks (model.attention_sinks, GPT-OSS): a learned logit per head joins each query's softmax with a
  zero value. It is one more key: q gets one more channel holding the head's sink logit, the keys a zero channel,
  and the sink key is zero but for that channel (1 / scale), so its score is the logit itself; its value is zero.
* value heads narrower than the query/key heads (multi-head latent attention): v is zero-padded to the query
  width and the output cut back, since torch's CPU flash kernel needs one width.
The padding copies are work the GPU kernels (FlashAttention-3, cuDNN) do not have: they are noted `fused` (no
time of their own), and the padded v and output the kernel keeps for backward count at their real width
(observer.padded). The kernel's notes tell the kernel model what a CPU trace's arguments do not show
(profile/analytical.py): `causal_mask` (the explicit mask is causal: masked blocks are skipped), `window_keys` and
`window_chunked` (only the window's keys are visited), `value_width` (the second matmul's width).
"""

from __future__ import annotations

import torch
from torch import nn

from trainsim.config.schema import ModelConfig
from trainsim.workloads.context_parallel import ContextParallel
from trainsim.workloads.observe import observer


def visible_keys(seq_length: int, window: int, chunked: bool) -> torch.Tensor:
    """[s, s] booleans, True where query i may attend key j: causal, within the window if any (0 = none)."""
    positions = torch.arange(seq_length)
    offset = positions[:, None] - positions[None, :]
    visible = offset >= 0
    if window and chunked:
        visible &= (positions[:, None] // window) == (positions[None, :] // window)
    elif window:
        visible &= offset < window
    return visible


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, sink: bool) -> torch.Tensor:
    """0 where visible, -inf elsewhere; with `sink` one more key column every query sees."""
    if sink:
        visible = torch.cat([visible, visible.new_ones(visible.shape[0], 1)], dim=1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout as one kernel (output and mask), as CUDA PyTorch runs it; the CPU's
    functional dropout decomposes into bernoulli_, div_ and mul, three passes over the tensor."""
    return torch.native_dropout(x, p, True)[0]


class CoreAttention(nn.Module):
    """softmax(q k^T * scale) v for this tp rank's heads, q [b, hl, s, d], k [b, kvl, s, d], v [b, kvl, s, dv]."""

    def __init__(self, *, heads: int, kv_heads: int, seq_length: int, qk_width: int, dtype: torch.dtype,
                 fused: bool, dropout_p: float, window: int = 0, chunked: bool = False, sinks: bool = False,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.fused, self.dropout_p, self.cp = heads, kv_heads, fused, dropout_p, cp
        self.window, self.chunked = window, chunked
        self.scale = qk_width ** -0.5
        # the sinks are split over tp with their heads; GPT-OSS initialises them to zero
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=dtype)) if sinks else None
        self.explicit_mask = bool(window) or sinks
        if self.explicit_mask:  # a buffer built once: not a step allocation
            self.register_buffer("mask", additive_mask(visible_keys(seq_length, window, chunked), dtype, sinks),
                                 persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value_width: int = 0) -> torch.Tensor:
        """`value_width`: v was zero-padded to q's width by the caller (pad_values) from that width."""
        if value_width and value_width != v.shape[-1]:
            v = v[..., :value_width]
            if self.cp is not None or not self.fused:
                v = v.contiguous()
        if self.cp is not None:
            return self.cp.attention(q, k, v)
        if not self.fused:
            return self._unfused(q, k, v)
        value_width = v.shape[-1]
        notes = {"dropout_p": self.dropout_p} if self.dropout_p else {}
        if value_width != q.shape[-1]:
            notes["value_width"] = value_width
        if self.explicit_mask:
            notes.update(causal_mask=1.0, window_keys=self.window, window_chunked=float(self.chunked))
        q, k, v = self._padded(q, k, v)
        with observer().kernel_notes(**notes):
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=self.mask if self.explicit_mask else None, is_causal=not self.explicit_mask,
                dropout_p=self.dropout_p if q.is_cuda else 0.0, enable_gqa=self.kv_heads != self.heads,
                **({"scale": self.scale} if self.sinks is not None else {}))  # else SDPA's own 1 / sqrt(width)
        if notes:
            observer().kernel_notes_for_backward(out, **notes)
        if out.shape[-1] != value_width:
            observer().padded(out, out.numel() // out.shape[-1] * value_width * out.element_size())
        return out[..., :value_width] if out.shape[-1] != value_width else out

    def _padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v with the sink channel and key, and v as wide as q (see the module's docstring)."""
        if self.sinks is None and v.shape[-1] == q.shape[-1]:
            return q, k, v
        with observer().kernel_notes(fused=1.0):
            if self.sinks is not None:
                b, hl, s, _ = q.shape
                q = torch.cat([q, self.sinks.view(1, hl, 1, 1).expand(b, hl, s, 1)], dim=-1)
                sink_key = k.new_zeros(b, k.shape[1], 1, k.shape[-1] + 1)
                sink_key[..., -1] = 1.0 / self.scale
                k = torch.cat([nn.functional.pad(k, (0, 1)), sink_key], dim=2)
                v = nn.functional.pad(v, (0, 0, 0, 1))
            if v.shape[-1] != q.shape[-1]:
                v = pad_values(v, q.shape[-1])
        return q, k, v

    def _unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Megatron's CoreAttention before flash attention: one baddbmm computes the scaled scores and adds the
        mask (-inf where not visible, broadcast), then softmax, attention dropout and a bmm with V: the kernels of
        its fused scale-mask-softmax path, with the [s, s] scores in memory."""
        b, hl, s, d = q.shape
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        mask = self.mask if self.explicit_mask else \
            torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        if self.sinks is not None:  # the sink's column: its logit, then dropped with its zero value
            mask = (mask.unsqueeze(0) + nn.functional.pad(self.sinks.view(hl, 1, 1).expand(hl, s, 1),
                                                          (s, 0))).repeat(b, 1, 1)
            k = nn.functional.pad(k, (0, 0, 0, 1))
            v = nn.functional.pad(v, (0, 0, 0, 1))
        scores = torch.baddbmm(mask, q.reshape(b * hl, s, d), k.reshape(b * hl, -1, d).transpose(1, 2),
                               alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        if self.dropout_p:
            probs = dropout(probs, self.dropout_p)
        return torch.bmm(probs, v.reshape(b * hl, -1, v.shape[-1])).view(b, hl, s, v.shape[-1])


def pad_values(v: torch.Tensor, width: int) -> torch.Tensor:
    """v zero-padded to `width` (q's), counted at its own size where kept for backward (observer.padded); or v
    itself if a view of such a padding (CoreAttention(value_width=) hands the fused kernel that)."""
    if v._base is not None and v._base.shape[-1] == width and v.storage_offset() == v._base.storage_offset():
        return v._base
    with observer().kernel_notes(fused=1.0):
        padded = nn.functional.pad(v, (0, width - v.shape[-1]))
    observer().padded(padded, v.numel() * v.element_size())
    return padded


def layer_core_attention(cfg: ModelConfig, layer: int, heads: int, kv_heads: int, qk_width: int, dtype: torch.dtype,
                         cp: ContextParallel | None) -> CoreAttention:
    """The core attention of layer `layer` (0-based): its window, sinks and kernel as the model config says."""
    return CoreAttention(heads=heads, kv_heads=kv_heads, seq_length=cfg.seq_length // (cp.size if cp else 1),
                         qk_width=qk_width, dtype=dtype, fused=cfg.attention == "fused",
                         dropout_p=cfg.attention_dropout, window=cfg.window_of(layer),
                         chunked=cfg.window_kind == "chunked", sinks=cfg.attention_sinks, cp=cp)
