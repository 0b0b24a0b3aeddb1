"""The reference decoder-only transformer, built per (pipeline stage, chunk, tp rank).

GPT family: LayerNorm, learned positions, GELU MLP with biases (GPT-2 / Megatron GPT).
Llama family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases.
Shapes in comments: b micro-batch, s sequence, h hidden, hl heads on this tp rank, d head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainsim.config.schema import ModelConfig
from trainsim.workloads.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 * tp (--make-vocab-size-divisible-by)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def _norm(cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    if cfg.family == "llama":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)


def _rotary_tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of RoFormer rotary embeddings (Su et al. 2021), shape [s, d/2]."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [b, hl, s, d/2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, selective_recompute: bool):
        super().__init__()
        self.heads = cfg.num_attention_heads // tp
        self.kv_heads = (cfg.num_kv_heads or cfg.num_attention_heads) // tp
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.selective_recompute = selective_recompute
        bias = cfg.family == "gpt"
        full_heads = cfg.num_attention_heads + 2 * (cfg.num_kv_heads or cfg.num_attention_heads)
        self.qkv = ColumnParallelLinear(cfg.hidden_size, full_heads * self.head_dim, tp, tp_group, dtype, bias)
        self.proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, tp, tp_group,
                                      dtype, bias, num_layers=cfg.num_layers)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)  # [b, s, (hl + 2 kvl) d]
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, hl, s, d]
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
        if self.selective_recompute:  # Korthikanti et al. 2022: recompute only the core attention
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype):
        super().__init__()
        ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
        self.swiglu = cfg.family == "llama"
        bias = not self.swiglu
        up_width = 2 * ffn if self.swiglu else ffn  # SwiGLU fuses gate and up projections
        self.up = ColumnParallelLinear(cfg.hidden_size, up_width, tp, tp_group, dtype, bias)
        self.down = RowParallelLinear(ffn, cfg.hidden_size, tp, tp_group, dtype, bias, num_layers=cfg.num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = nn.functional.silu(gate) * up
        else:
            h = nn.functional.gelu(h, approximate="tanh")
        return self.down(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, recompute: str):
        super().__init__()
        self.dropout = cfg.dropout
        self.norm1 = _norm(cfg, dtype)
        self.attn = Attention(cfg, tp, tp_group, dtype, selective_recompute=recompute == "selective")
        self.norm2 = _norm(cfg, dtype)
        self.mlp = MLP(cfg, tp, tp_group, dtype)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.dropout, training=True) if self.dropout else x

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self._drop(self.attn(self.norm1(x), rotary))
        return x + self._drop(self.mlp(self.norm2(x)))


class TransformerChunk(nn.Module):
    """Consecutive layers of the model held by one (pipeline rank, virtual stage) on one tp rank.

    The first chunk of the model embeds tokens; the last one applies the final norm, the
    vocab-parallel output layer and the loss. Embedding and output weights are untied.
    """

    def __init__(self, cfg: ModelConfig, *, layers: range, first: bool, last: bool, tp: int, tp_rank: int,
                 tp_group, dtype: torch.dtype, recompute: str, loss_scale: float):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.tp, self.tp_group, self.recompute_full = tp, tp_group, recompute == "full"
        self.loss_scale = loss_scale  # 1 / num_microbatches: gradients accumulate to the batch mean
        self.layers = nn.ModuleList(Block(cfg, tp, tp_group, dtype, recompute) for _ in layers)
        vocab = padded_vocab_size(cfg.vocab_size, tp)
        if cfg.family == "llama":
            cos, sin = _rotary_tables(cfg, dtype)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        if first:
            self.embed = VocabParallelEmbedding(vocab, cfg.hidden_size, tp, tp_rank, tp_group, dtype)
            if cfg.family == "gpt":
                self.positions = nn.Parameter(torch.empty(cfg.seq_length, cfg.hidden_size, dtype=dtype))
                nn.init.normal_(self.positions, std=0.02)
        if last:
            self.final_norm = _norm(cfg, dtype)
            self.head = ColumnParallelLinear(cfg.hidden_size, vocab, tp, tp_group, dtype, bias=False)
            self.vocab_start = tp_rank * (vocab // tp)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [b, s] on the first chunk, else hidden states [b, s, h]; returns h or the loss."""
        if self.first:
            x = self.embed(x)
            if self.cfg.family == "gpt":
                x = x + self.positions
        rotary = (self.rotary_cos, self.rotary_sin) if self.cfg.family == "llama" else None
        for block in self.layers:
            if self.recompute_full:
                x = checkpoint(block, x, rotary, use_reentrant=False)
            else:
                x = block(x, rotary)
        if not self.last:
            return x
        logits = self.head(self.final_norm(x))  # [b, s, vocab / tp]
        loss = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.tp_group, self.tp)
        return loss.mean() * self.loss_scale
