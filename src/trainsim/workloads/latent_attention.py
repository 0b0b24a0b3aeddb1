"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, sec. 2.1; DeepSeek-V3, Kimi K2).

Keys and values come from one low-rank latent per token: hidden -> kv_lora_rank (normalised) -> every head's
key part without position (head_dim wide) and value (v_head_dim), plus one rotary key part (qk_rope_head_dim)
shared by all heads. Queries likewise pass through a q_lora_rank latent (or one full-rank projection), and each
head's query has its own rotary part. Scores use the width head_dim + qk_rope_head_dim.

Tensor parallelism as Megatron-Core's MLASelfAttention with Transformer Engine: the down projections are
duplicated on every tp rank (TELinear, parallel_mode 'duplicated'), the up projections are column-parallel over
the heads, the output projection row-parallel. With sequence parallelism the down projections run on this
rank's token shard (their weight gradients are partial: reduced over tp like the norms'), the up projections
all-gather the latents, and the shared rotary key is all-gathered on its own. Without it every rank computes
the latents of all tokens; the up projections' inputs and the rotary key reduce their gradients over tp.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainsim.config.schema import ModelConfig
from trainsim.workloads.context_parallel import ContextParallel
from trainsim.workloads.core_attention import layer_core_attention, pad_values
from trainsim.workloads.fp8 import Fp8Region
from trainsim.workloads.fused import RMSNorm, rotate
from trainsim.workloads.module_recompute import OutputDiscardingCheckpoint
from trainsim.workloads.tensor_parallel import ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_sp


def duplicated_linear(in_features: int, out_features: int, dtype: torch.dtype, sequence_parallel: bool,
                      fp8: Fp8Region | None) -> ColumnParallelLinear:
    """A linear whose whole weight every tp rank holds (Transformer Engine's 'duplicated' mode)."""
    linear = ColumnParallelLinear(in_features, out_features, 1, None, dtype, bias=False, fp8_region=fp8)
    linear.weight.sequence_parallel = sequence_parallel  # applied to a token shard: each rank's gradient is partial
    return linear


def latent_norm(width: int, cfg: ModelConfig, dtype: torch.dtype, sequence_parallel: bool) -> RMSNorm:
    norm = RMSNorm(width, cfg.norm_eps, dtype, cfg.fused_elementwise)
    norm.weight.sequence_parallel = sequence_parallel
    return norm


class LatentAttention(nn.Module):
    """MLA self-attention of layer `layer` for this tp rank's heads (input and output as model.Attention's)."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, selective_recompute: bool,
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8: Fp8Region | None = None,
                 cp: ContextParallel | None = None, layer: int = 0, up_proj_recompute: bool = False):
        super().__init__()
        self.tp, self.tp_group = tp, tp_group
        self.sequence_parallel = sequence_parallel and tp > 1
        self.seq_length = cfg.seq_length // (cp.size if cp else 1)
        self.heads = cfg.num_attention_heads // tp
        self.nope_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.rope_dim, self.kv_rank = cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.v_dim = cfg.v_head_dim or self.nope_dim
        self.selective_recompute, self.fused = selective_recompute, cfg.fused_elementwise
        self.up_proj_recompute = up_proj_recompute  # recompute_modules 'mla_up_proj'
        self.padded_values = cp is None and cfg.attention == "fused"  # the fused kernel's v, as wide as q
        heads, qk_dim = cfg.num_attention_heads, self.nope_dim + self.rope_dim
        sp = self.sequence_parallel
        if cfg.q_lora_rank:
            self.q_down = duplicated_linear(cfg.hidden_size, cfg.q_lora_rank, dtype, sp, fp8)
            self.q_norm = latent_norm(cfg.q_lora_rank, cfg, dtype, sp)
            q_in = cfg.q_lora_rank
        else:
            self.q_down = self.q_norm = None
            q_in = cfg.hidden_size
        self.q_up = ColumnParallelLinear(q_in, heads * qk_dim, tp, tp_group, dtype, False, sequence_parallel,
                                         comm_overlap, fp8_region=fp8)
        self.kv_down = duplicated_linear(cfg.hidden_size, self.kv_rank + self.rope_dim, dtype, sp, fp8)
        self.kv_norm = latent_norm(self.kv_rank, cfg, dtype, sp)
        self.kv_up = ColumnParallelLinear(self.kv_rank, heads * (self.nope_dim + self.v_dim), tp, tp_group, dtype,
                                          False, sequence_parallel, comm_overlap, fp8_region=fp8)
        self.core = layer_core_attention(cfg, layer, self.heads, self.heads, qk_dim, dtype, cp)
        self.proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, tp, tp_group, dtype, False,
                                      num_layers=cfg.num_layers, sequence_parallel=sequence_parallel,
                                      comm_overlap=comm_overlap, fp8_region=fp8)

    @property
    def first_linear(self) -> ColumnParallelLinear:
        """The linear that reads the normalised input first (Transformer Engine fuses the norm into it with FP8)."""
        return self.q_down if self.q_down is not None else self.q_up

    def forward(self, x: torch.Tensor, rotary_tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q_latent = self.q_down(x) if self.q_down is not None else x
        latent, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        up = partial(self._up, rotary_tables=rotary_tables)
        if self.up_proj_recompute:  # Megatron's mla_up_proj: q, k, v freed once the core attention keeps them
            up = OutputDiscardingCheckpoint(up)
        q, k, v = up(q_latent, latent, k_rope)
        if self.selective_recompute:
            out = checkpoint(self.core, q, k, v, self.v_dim, use_reentrant=False)
        else:
            out = self.core(q, k, v, self.v_dim)
        if self.up_proj_recompute:
            up.discard_after(out)
        b = q.shape[0]
        return self.proj(out.transpose(1, 2).reshape(b, self.seq_length, self.heads * self.v_dim))

    def _up(self, q_latent: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
            rotary_tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up projections and the rotary embedding: each head's q, k [b, hl, s, d + dr] and v (zero-padded to
        that width for the fused kernel)."""
        q = self.q_up(self.q_norm(q_latent) if self.q_norm is not None else q_latent)
        kv = self.kv_up(self.kv_norm(latent))
        k_rope = k_rope.reshape(-1, self.rope_dim)
        k_rope = (gather_from_sp(k_rope, self.tp_group, self.tp) if self.sequence_parallel
                  else copy_to_tp(k_rope, self.tp_group, self.tp))
        s = self.seq_length
        b = k_rope.shape[0] // s
        q = q.view(b, s, self.heads, -1).transpose(1, 2)  # [b, hl, s, d + dr]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv = kv.view(b, s, self.heads, -1).transpose(1, 2)  # [b, hl, s, d + dv]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = rotate(k_rope.view(b, 1, s, self.rope_dim), *rotary_tables, self.fused)
        q = torch.cat([q_nope, rotate(q_rope, *rotary_tables, self.fused)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, self.heads, s, self.rope_dim)], dim=-1)
        if self.padded_values and self.v_dim != q.shape[-1]:
            v = pad_values(v, q.shape[-1])
        elif self.up_proj_recompute:  # its outputs are freed: v must not be a view of kv
            v = v.contiguous()
        return q, k, v
