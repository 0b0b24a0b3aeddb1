"""The reference decoder-only transformer, built per (pipeline stage, chunk, tp rank).

GPT family: LayerNorm, learned positions, GELU MLP with biases (GPT-2 / Megatron GPT).
Llama family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases.
Shapes in comments: b micro-batch, s sequence, h hidden, hl heads on this tp rank, d head dim.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainsim.config.schema import ModelConfig
from trainsim.workloads.activation_offload import ActivationOffload
from trainsim.workloads.combined_passes import Step
from trainsim.workloads.context_parallel import ContextParallel
from trainsim.workloads.core_attention import dropout, layer_core_attention
from trainsim.workloads.fp8 import Fp8Region, Fp8Settings
from trainsim.workloads.fused import RMSNorm, gated_silu, rotate
from trainsim.workloads.latent_attention import LatentAttention
from trainsim.workloads.mamba import MambaMixer
from trainsim.workloads.moe import ExpertParallel, MoE
from trainsim.workloads.observe import observer
from trainsim.workloads.op_checkpoint import op_checkpoint_contexts
from trainsim.workloads.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SeparateColumnLinears,
    VocabParallelEmbedding,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
          "fp4": torch.bfloat16}
"""Weight and activation dtype per parallelism.precision; 'fp8' and 'fp4' keep bf16 tensors and run the linear
layers' GEMMs in FP8 / NVFP4 (workloads/fp8.py)."""


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 * tp (--make-vocab-size-divisible-by)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def head_width(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def _norm(cfg: ModelConfig, dtype: torch.dtype, sequence_parallel: bool = False) -> nn.Module:
    norm = (RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, cfg.fused_elementwise) if cfg.family == "llama"
            else nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype))
    for p in norm.parameters():  # applied to a token shard: each tp rank holds a partial gradient
        p.sequence_parallel = sequence_parallel
    return norm


def _rotary_tables(cfg: ModelConfig, dtype: torch.dtype, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of RoFormer rotary embeddings (Su et al. 2021) at `positions`, shape [len(positions), d/2]."""
    head_dim = cfg.qk_rope_head_dim if cfg.latent_attention else head_width(cfg)  # MLA: the rotary part only
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _column_linear(cfg: ModelConfig, widths: list[int], tp: int, tp_group, dtype, bias: bool, sequence_parallel: bool,
                   comm_overlap: bool, fp8: Fp8Region | None) -> ColumnParallelLinear | SeparateColumnLinears:
    """The column-parallel projections of `widths` over one input: one fused GEMM, or one GEMM each where the model
    keeps them separate (model.separate_projections; not yet with the tensor-parallel overlap rings)."""
    overlapped = comm_overlap and sequence_parallel and tp > 1
    if cfg.separate_projections and len(widths) > 1 and not overlapped:
        return SeparateColumnLinears(cfg.hidden_size, widths, tp, tp_group, dtype, bias, sequence_parallel, fp8)
    return ColumnParallelLinear(cfg.hidden_size, sum(widths), tp, tp_group, dtype, bias, sequence_parallel,
                                comm_overlap, fp8_region=fp8, bulk_backward=cfg.tp_overlap_backward == "bulk")


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention of layer `layer` (its window: model.window_of)."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, selective_recompute: bool,
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8: Fp8Region | None = None,
                 cp: ContextParallel | None = None, layer: int = 0):
        super().__init__()
        self.seq_length = cfg.seq_length // (cp.size if cp else 1)  # this rank's tokens of each sequence
        self.heads = cfg.num_attention_heads // tp
        self.kv_heads = (cfg.num_kv_heads or cfg.num_attention_heads) // tp
        self.head_dim = head_width(cfg)
        self.selective_recompute, self.fused = selective_recompute, cfg.fused_elementwise
        self.core = layer_core_attention(cfg, layer, self.heads, self.kv_heads, self.head_dim, dtype, cp)
        bias = cfg.family == "gpt"
        self.qkv = _column_linear(cfg, [self.heads * tp * self.head_dim, *[self.kv_heads * tp * self.head_dim] * 2],
                                  tp, tp_group, dtype, bias, sequence_parallel, comm_overlap, fp8)
        self.proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, tp, tp_group,
                                      dtype, bias, num_layers=cfg.num_layers, sequence_parallel=sequence_parallel,
                                      comm_overlap=comm_overlap, fp8_region=fp8)

    @property
    def first_linear(self) -> ColumnParallelLinear:
        """The linear that reads the normalised input (Transformer Engine fuses the norm into it with FP8)."""
        return self.qkv

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, (hl + 2 kvl) d]; [b s, ...] when x is a sequence-parallel shard
        s = self.seq_length
        b = qkv[..., 0].numel() // s
        qkv = qkv.view(b, s, -1)
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, hl, s, d]
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = rotate(q, *rotary, self.fused), rotate(k, *rotary, self.fused)  # [b, hl, s, d]
            # q and k are rotated copies, so the values become a tensor of their own and attention does not keep the
            # projection's whole output for backward: Transformer Engine copies a strided v contiguous (its qkv
            # layout check); separate projections (torchtitan's wv) wrote it apart, so that copy is noted fused
            separate = isinstance(self.qkv, SeparateColumnLinears)
            with observer().kernel_notes(fused=1) if separate else contextlib.nullcontext():
                v = v.contiguous()
        if self.selective_recompute:  # Korthikanti et al. 2022: recompute only the core attention
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, sequence_parallel: bool = False,
                 comm_overlap: bool = False, fp8: Fp8Region | None = None, ffn: int | None = None,
                 recompute: bool = False):
        super().__init__()
        self.recompute = recompute  # recompute_modules 'mlp' (dense) or 'shared_experts': checkpointed whole
        ffn = ffn or cfg.ffn_hidden_size or 4 * cfg.hidden_size
        self.swiglu, self.fused = cfg.family == "llama", cfg.fused_elementwise
        bias = not self.swiglu
        up_width = 2 * ffn if self.swiglu else ffn  # SwiGLU fuses gate and up projections
        self.up = _column_linear(cfg, [ffn, ffn] if self.swiglu else [up_width], tp, tp_group, dtype, bias,
                                 sequence_parallel, comm_overlap, fp8)
        self.down = RowParallelLinear(ffn, cfg.hidden_size, tp, tp_group, dtype, bias, num_layers=cfg.num_layers,
                                      sequence_parallel=sequence_parallel, comm_overlap=comm_overlap, fp8_region=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._mlp, x, use_reentrant=False)
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            h = gated_silu(h, self.fused)
        else:
            h = nn.functional.gelu(h, approximate="tanh")
        return self.down(h)


class Block(nn.Module):
    """One layer: a token mixer (attention or Mamba-2) and an MLP (or MoE), each after its norm and added to the
    residual. `kind` '' is a transformer block (both); a hybrid model's layers have one part each, as Megatron-Core's
    hybrid stack builds them (model.hybrid_layer_pattern: 'M' Mamba-2, '*' attention, '-' MLP, 'E' MoE)."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group, dtype, recompute_modules: frozenset[str],
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8: Fp8Region | None = None,
                 cp: ContextParallel | None = None, experts: MoE | None = None, kind: str = "", layer: int = 0):
        super().__init__()
        self.dropout = cfg.dropout
        self.attn: Attention | LatentAttention | None = None
        self.mamba: MambaMixer | None = None
        self.mlp: MLP | MoE | None = None
        if kind in ("", "*", "M"):
            self.norm1 = _norm(cfg, dtype, sequence_parallel)
        if kind in ("", "*"):
            recompute_up = {"up_proj_recompute": "mla_up_proj" in recompute_modules} if cfg.latent_attention else {}
            attention = LatentAttention if cfg.latent_attention else Attention
            self.attn = attention(cfg, tp, tp_group, dtype, selective_recompute="core_attn" in recompute_modules,
                                  sequence_parallel=sequence_parallel, comm_overlap=comm_overlap, fp8=fp8, cp=cp,
                                  layer=layer, **recompute_up)
        elif kind == "M":
            self.mamba = MambaMixer(cfg, tp, tp_group, dtype, sequence_parallel, comm_overlap, fp8)
        if kind in ("", "-", "E"):
            self.norm2 = _norm(cfg, dtype, sequence_parallel)
            self.mlp = experts or MLP(cfg, tp, tp_group, dtype, sequence_parallel, comm_overlap, fp8=fp8,
                                      recompute="mlp" in recompute_modules)
        if fp8 is not None:  # Megatron-Core's TE spec: the norms run inside linear_qkv, in_proj and linear_fc1
            firsts = [self.attn.first_linear if self.attn is not None else None,
                      self.mamba.in_proj if self.mamba is not None else None,
                      self.mlp.up if isinstance(self.mlp, MLP) else None]
            for first in filter(None, firsts):
                for linear in getattr(first, "linears", [first]):  # SeparateColumnLinears: each projection
                    linear.fp8.input_from_norm = True

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.dropout) if self.dropout else x

    def _mix(self, x: torch.Tensor, rotary) -> torch.Tensor:
        if self.attn is not None:
            return x + self._drop(self.attn(self.norm1(x), rotary))
        return x if self.mamba is None else x + self._drop(self.mamba(self.norm1(x)))

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = self._mix(x, rotary)
        return x if self.mlp is None else x + self._drop(self.mlp(self.norm2(x)))

    def steps(self, rotary=None) -> list[Step]:
        """This block's forward as steps (combined_passes.py): cut at the experts' all-to-alls, if it has them."""
        moe = self.mlp
        if not isinstance(moe, MoE) or moe.ep.dispatcher != "alltoall":
            return [Step("block", lambda st: {"x": self(st["x"], rotary)})]

        def attention(st):
            x1 = self._mix(st["x"], rotary)
            h = self.norm2(x1)
            tokens, weights, logits, exchange = moe.dispatch_preprocess(h)
            return {"x1": x1, "h": h, "tokens": tokens, "weights": weights, "logits": logits, "exchange": exchange}

        def experts(st):
            if moe.probs_in_experts:  # the probabilities came with the tokens and are used up here
                return {**st, "tokens": moe.experts_on(st["tokens"], st["exchange"], st["weights"]), "weights": None}
            return {**st, "tokens": moe.experts_on(st["tokens"], st["exchange"])}

        def output(st):
            moe_out = moe.combine_postprocess(st["tokens"], st["weights"], st["logits"], st["h"], st["exchange"])
            return {"x": st["x1"] + self._drop(moe_out)}

        group = moe.ep.group
        dispatched = ("tokens", "weights") if moe.probs_in_experts else ("tokens",)
        return [Step("attention", attention),
                Step("dispatch", exchange=lambda st: (st["exchange"].send, st["exchange"].receive), group=group,
                     rows=dispatched),
                Step("experts", experts),
                Step("combine", exchange=lambda st: (st["exchange"].receive, st["exchange"].send), group=group),
                Step("output", output)]


class TransformerChunk(nn.Module):
    """Consecutive layers of the model held by one (pipeline rank, virtual stage) on one tp rank.

    The first chunk of the model embeds tokens; the last one applies the final norm, the
    vocab-parallel output layer and the loss. Embedding and output weights are untied. With sequence
    parallelism the hidden states between blocks (and between pipeline stages) are this tp rank's shard of
    the micro-batch's tokens, [b s / tp, h]: the embedding output is split after its all-reduce, as
    Megatron-Core does, and the output layer all-gathers the shards. With `fp8` the blocks' linears run FP8
    GEMMs and the layers run inside the chunk's FP8 autocast region (workloads/fp8.py); the output layer
    stays bf16, as in Transformer Engine. With `cp` the chunk sees this context-parallel rank's tokens of
    each sequence (workloads/context_parallel.py): positions and rotary tables are theirs. A model with experts
    has MoE layers in place of the MLPs after its first dense layers (workloads/moe.py), split over `ep`.
    """

    def __init__(self, cfg: ModelConfig, *, layers: range, first: bool, last: bool, tp: int, tp_rank: int,
                 tp_group, dtype: torch.dtype, recompute: str, loss_scale: float, sequence_parallel: bool = False,
                 tp_comm_overlap: bool = False, fp8: Fp8Settings | None = None, cp: ContextParallel | None = None,
                 ep: ExpertParallel | None = None, offload_layers: int = 0,
                 recompute_modules: tuple[str, ...] = ("core_attn",)):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.offload_layers = offload_layers  # this chunk's first blocks whose activations go to the host
        self.tp, self.tp_group, self.recompute = tp, tp_group, recompute
        # Megatron's selective recomputation: the modules recomputed (workloads/module_recompute.py)
        self.recompute_modules = frozenset(recompute_modules if recompute == "selective" else ())
        self.sequence_parallel = sequence_parallel and tp > 1
        self.loss_scale = loss_scale  # 1 / num_microbatches: gradients accumulate to the batch mean
        self.fp8 = Fp8Region(fp8) if fp8 is not None else None
        vocab = padded_vocab_size(cfg.vocab_size, tp)
        positions = cp.positions(cfg.seq_length) if cp else torch.arange(cfg.seq_length)
        if cfg.family == "llama":
            cos, sin = _rotary_tables(cfg, dtype, positions)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        # Parameters are registered in the order forward uses them, as Megatron-Core's modules are: data-parallel
        # buckets follow the reverse of that order, so the embedding's bucket is reduced last and gathered first.
        if first:
            self.embed = VocabParallelEmbedding(vocab, cfg.hidden_size, tp, tp_rank, tp_group, dtype)
            if cfg.family == "gpt":
                self.positions = nn.Parameter(torch.empty(cfg.seq_length, cfg.hidden_size, dtype=dtype))
                nn.init.normal_(self.positions, std=0.02)
                # context parallelism: this rank's rows of the position table (an embedding lookup, as Megatron)
                self.register_buffer("position_ids", positions if cp else None, persistent=False)
        kinds = cfg.hybrid_layer_pattern
        self.layers = nn.ModuleList(Block(cfg, tp, tp_group, dtype, self.recompute_modules, self.sequence_parallel,
                                          tp_comm_overlap, self.fp8, cp, self._experts(layer, dtype, ep),
                                          kinds[layer] if kinds else "", layer)
                                    for layer in layers)
        if self.fp8 is not None:
            self.fp8.allocate()
        if last:
            self.final_norm = _norm(cfg, dtype, self.sequence_parallel)
            self.head = ColumnParallelLinear(cfg.hidden_size, vocab, tp, tp_group, dtype, bias=False,
                                             sequence_parallel=self.sequence_parallel)
            self.vocab_start = tp_rank * (vocab // tp)

    def _experts(self, layer: int, dtype: torch.dtype, ep: ExpertParallel | None) -> MoE | None:
        """The MoE layer in place of the MLP of `layer`, if it has experts (ModelConfig.has_experts: none in the
        first dense layers, only every moe_layer_freq-th layer, in a hybrid model the 'E' layers of its pattern)."""
        cfg = self.cfg
        if not cfg.has_experts(layer):
            return None
        width = cfg.moe_shared_expert_ffn_hidden_size
        shared = MLP(cfg, self.tp, self.tp_group, dtype, self.sequence_parallel, fp8=self.fp8, ffn=width,
                     recompute="shared_experts" in self.recompute_modules) if width else None
        return MoE(cfg, layer, ep, dtype, self.loss_scale, self.sequence_parallel, shared, self.fp8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [b, s] on the first chunk, else hidden states [b, s, h] (or their sequence-parallel
        shard); returns h or the loss."""
        if self.first:
            x = self._embed(x)
        rotary = self._rotary()
        offload = ActivationOffload() if self.offload_layers else None
        with self.fp8.autocast() if self.fp8 is not None else contextlib.nullcontext():
            for index, block in enumerate(self.layers):
                if self.recompute == "full":
                    x = checkpoint(block, x, rotary, use_reentrant=False)
                elif self.recompute == "op":
                    x = checkpoint(block, x, rotary, use_reentrant=False, context_fn=op_checkpoint_contexts)
                elif index < self.offload_layers:
                    with offload.layer(index):
                        x = block(x, rotary)
                else:
                    x = block(x, rotary)
                if offload is not None and 0 < index <= self.offload_layers:
                    offload.reload_when_differentiated(index - 1, x)
        return self._loss(x, targets) if self.last else x

    def steps(self, targets: torch.Tensor | None = None) -> list[Step]:
        """The forward as steps (combined_passes.py; not with full recomputation): the state's 'x' is the input
        and, on the last chunk, 'loss' the output. Blocks run inside the FP8 region (ChunkPass(region=...))."""
        rotary = self._rotary()
        out = [Step("embed", lambda st: {"x": self._embed(st["x"])}, keeps_turn=True, in_region=False)] \
            if self.first else []
        for block in self.layers:
            out += block.steps(rotary)
        if self.last:
            out.append(Step("loss", lambda st: {"loss": self._loss(st["x"], targets)}, keeps_turn=True,
                            in_region=False))
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.family != "gpt":  # nothing added after the lookup: its partial sums go straight to the shards
            return self.embed(ids, scatter_tokens=self.sequence_parallel)
        x = self.embed(ids)
        x = x + (self.positions if self.position_ids is None
                 else nn.functional.embedding(self.position_ids, self.positions))
        if self.sequence_parallel:
            x = scatter_to_sp(x, self.tp_group, self.tp)
        return x

    def _rotary(self):
        return (self.rotary_cos, self.rotary_sin) if self.cfg.family == "llama" else None

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.final_norm(x))  # [b, s, vocab / tp] ([b s, vocab / tp] sequence-parallel)
        logits = logits.view(*targets.shape, logits.shape[-1])
        loss = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.tp_group, self.tp,
                                            fused=self.cfg.fused_cross_entropy)
        return loss.mean() * self.loss_scale
