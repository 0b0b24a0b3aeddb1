"""Mixture-of-experts layer with expert parallelism, as Megatron-Core's MoELayer with the all-to-all dispatcher.

Per micro-batch, on each rank's own tokens (its sequence-parallel shard when tp > 1):
1. router: logits = x W_r^T over all experts; top-k by logit with a softmax over the k chosen (Mixtral, Qwen3), or
   top-k sigmoid scores normalised to sum 1 (DeepSeek-V3); the Switch load-balancing loss when its coefficient
   is set (Fedus et al. 2022, eq. 4: E * sum_e f_e P_e, added to the loss through the gradient, as Megatron's
   MoEAuxLossAutoScaler);
2. permute: token copies sorted by expert (stable, so a token's copies stay in token order); with a capacity
   factor each expert keeps its first ceil(k T / E * factor) tokens and the rest are dropped;
3. dispatch: the ranks' tokens-per-expert are all-gathered over the expert-parallel group (the host then knows
   every split size), and one all-to-all sends each rank the tokens of its experts; the received chunks are
   regrouped by local expert (Megatron's sort_chunks_by_idxs);
4. experts: each local expert's MLP on its tokens, as one grouped GEMM per projection over all local experts
   (Megatron's GroupedMLP; parallelism.moe_grouped_gemm) or a GEMM per expert (SequentialMLP); the groups' rows
   are the tokens each expert received, so an imbalanced routing gives ranks different GEMM shapes. With expert
   tensor parallelism (parallelism.etp) each rank holds 1/etp of every local expert's inner width: the tokens
   the etp ranks of an ep rank received are all-gathered among them first (uneven: each received its own count),
   and the partial outputs reduce-scattered back after;
5. combine: the reverse regrouping and all-to-all, then each copy weighted by its router probability and summed
   back into its token; the shared expert, a dense MLP every token goes through, is added. With
   model.moe_probs_in_experts (Megatron-Core 0.13+) the probabilities instead go to the experts with their tokens
   (one more all-to-all) and weight the activation's output inside it (fused.weighted_swiglu); the combine then
   only sums.
With the all-gather dispatcher (parallelism.moe_token_dispatcher) steps 3-5 are instead: all-gather the tokens,
probabilities and choices of every rank of the tep group (etp x ep), compute the copies routed to the local
experts, reduce-scatter the (partial) sums over the same group.

The token counts come from a counts source (workloads/routing.py): the router's choice in a real run, a routing
plan in a trace. Everything else is the same code. Expert weights carry `expert = True`: their gradients are
reduced over the ranks holding the same experts, not over the data-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainsim.config.schema import ModelConfig
from trainsim.workloads.fp8 import Fp8Linear, Fp8Region, fp8_experts
from trainsim.workloads.fused import gated_silu, weighted_gelu, weighted_swiglu
from trainsim.workloads.grouped_gemm import grouped_mm
from trainsim.workloads.observe import observer
from trainsim.workloads.routing import PlannedCounts, RouterCounts
from trainsim.workloads.tensor_parallel import (
    all_gather_tokens,
    gather_from_sp,
    gather_uneven,
    reduce_scatter_to_sp,
    reduce_scatter_uneven_rows,
)


@dataclass
class ExpertParallel:
    """This rank's place among the ranks that split the experts, and where its token counts come from."""

    size: int
    rank: int
    group: object
    counts: RouterCounts | PlannedCounts
    dispatcher: str = "alltoall"
    """parallelism.moe_token_dispatcher"""
    grouped_gemm: bool = True
    """parallelism.moe_grouped_gemm"""
    etp: int = 1
    """parallelism.etp: ranks splitting each expert's weights"""
    etp_rank: int = 0
    etp_group: object = None
    # (the ranks that exchange tokens, etp x ep, are the counts' group: counts.group, .group_kind, .source)


@dataclass
class TokenExchange:
    """How one micro-batch's token copies move through an MoE layer with the all-to-all dispatcher: sizes known on
    the host once the counts are gathered, kept until the backward (which runs the exchanges in reverse)."""

    order: torch.Tensor
    """token copies (token * k + choice) in the order they are sent: by expert, dropped ones left out"""
    counts: list[int]
    """this source's tokens per expert, as routed (the auxiliary loss)"""
    send: list[int]
    """rows sent to each ep rank"""
    by_source: np.ndarray
    """[source ep rank, its etp rank, my local expert]: rows this rank's experts get from each source"""
    receive: list[int]
    """rows received from each ep rank"""

    def reverse(self) -> TokenExchange:
        """The same exchange with send and receive swapped (the combine)."""
        return TokenExchange(self.order, self.counts, self.receive, self.by_source, self.send)


def exchange_rows(x: torch.Tensor, send: list[int], receive: list[int], group, async_op: bool = False):
    """(rows received, the work or None): all_to_all_single of x's rows, send[r] of them to rank r of `group`."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    with observer().communication(async_op=async_op, group_kind="ep"):
        work = dist.all_to_all_single(out, x.contiguous(), receive, send, group=group, async_op=async_op)
    return out, work


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return exchange_rows(x, input_splits, output_splits, group)[0]

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; in backward the auxiliary loss gets gradient `scale` (the loss scale), so it
    is minimised with the main loss without being added to it (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class _SumCopies(torch.autograd.Function):
    """Each token's copies summed into it (scatter-add); its backward only gathers, so unlike index_add's autograd
    (which keeps the copies for their shape) it keeps nothing but the index."""

    @staticmethod
    def forward(ctx, copies, token_of_copy, tokens):
        ctx.save_for_backward(token_of_copy)
        return copies.new_zeros((tokens, *copies.shape[1:])).index_add_(0, token_of_copy, copies)

    @staticmethod
    def backward(ctx, grad):
        (token_of_copy,) = ctx.saved_tensors
        return grad.index_select(0, token_of_copy), None, None


def _regroup_order(counts: np.ndarray) -> np.ndarray:
    """Row order that takes chunks of counts[i, j] rows, stored by i then j, to j then i."""
    starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    return np.concatenate([np.arange(starts[i, j], starts[i, j] + counts[i, j])
                           for j in range(counts.shape[1]) for i in range(counts.shape[0])]).astype(np.int64)


class _Regroup(torch.autograd.Function):
    """One gather each way (as Transformer Engine's fused sort_chunks_by_index): a split and cat of ep x experts
    chunks would be hundreds of views whose backward is as many slices."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _regroup(x: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """x's rows come in chunks of counts[i, j] rows, ordered by i then j; return them ordered by j then i (from
    grouped by source rank to grouped by expert, and back with counts.T)."""
    if counts.shape[0] == 1 or counts.shape[1] == 1:
        return x
    order = _regroup_order(counts)
    inverse = np.empty_like(order)  # the permutation's inverse (np.argsort's, in linear time)
    inverse[order] = np.arange(len(order))
    return _Regroup.apply(x, torch.tensor(order, device=x.device), torch.tensor(inverse, device=x.device))


def expert_weight_shapes(cfg: ModelConfig, local_experts: int,
                         etp: int = 1) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Shapes of a rank's grouped expert weights in one MoE layer: w1 (up; gate and up with SwiGLU), w2 (down),
    each expert's inner width split over etp ranks (w1 column-, w2 row-parallel)."""
    ffn = cfg.expert_ffn_hidden_size // etp
    up = 2 * ffn if cfg.family == "llama" else ffn
    return (local_experts, cfg.hidden_size, up), (local_experts, ffn, cfg.hidden_size)


def expert_parameters(cfg: ModelConfig, ep: int, etp: int = 1) -> int:
    """Expert weights one rank holds per MoE layer (the rest of the layer is replicated over the expert groups)."""
    return sum(math.prod(shape) for shape in expert_weight_shapes(cfg, cfg.num_experts // ep, etp))


class Experts(nn.Module):
    """A rank's local experts: their weights (`expert = True`: reduced over the ranks holding the same experts, not
    over the data-parallel group) and their MLPs. A module of its own so FSDP shards it over those ranks."""

    def __init__(self, cfg: ModelConfig, local_experts: int, etp: int, dtype: torch.dtype, grouped_gemm: bool,
                 fp8: Fp8Region | None = None):
        super().__init__()
        w1, w2 = expert_weight_shapes(cfg, local_experts, etp)
        self.w1 = nn.Parameter(torch.empty(w1, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(w2, dtype=dtype))
        for weight in (self.w1, self.w2):
            nn.init.normal_(weight, std=0.02)
        self.w1.expert = self.w2.expert = True
        self.swiglu, self.grouped_gemm, self.fused = cfg.family == "llama", grouped_gemm, cfg.fused_elementwise
        # FP8 grouped GEMMs (workloads/fp8.py)
        self.fp8_w1, self.fp8_w2 = (Fp8Linear(fp8), Fp8Linear(fp8)) if fp8 is not None else (None, None)

    def _activation(self, hidden: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if weights is not None and self.fused:
            return weighted_swiglu(hidden, weights) if self.swiglu else weighted_gelu(hidden, weights)
        out = gated_silu(hidden, self.fused) if self.swiglu else nn.functional.gelu(hidden, approximate="tanh")
        return out if weights is None else out * weights.unsqueeze(-1).to(out.dtype)

    def forward(self, x: torch.Tensor, per_expert: list[int], weights: torch.Tensor | None = None) -> torch.Tensor:
        """x: the rows of each local expert in turn (per_expert[e] of them); `weights`: each row's router
        probability, applied in the activation (model.moe_probs_in_experts), or None."""
        if self.fp8_w1 is not None:
            hidden = self._activation(fp8_experts(x, self.w1, per_expert, self.fp8_w1), weights)
            return fp8_experts(hidden, self.w2, per_expert, self.fp8_w2)
        if self.grouped_gemm:
            return grouped_mm(self._activation(grouped_mm(x, self.w1, per_expert), weights), self.w2, per_expert)
        # unbind, not w1[e]: indexing each expert's weight has a backward per expert that writes a zero-filled
        # gradient of all experts' weights and adds it up (E^2 weight-sized passes); unbind's backward is one
        # stack of the experts' gradients, the one weight-sized write a grouped weight gradient costs anyway
        parts = weights.split(per_expert) if weights is not None else [None] * len(per_expert)
        outs = [self._activation(part @ w1, p) @ w2
                for part, p, w1, w2 in zip(x.split(per_expert), parts, self.w1.unbind(0), self.w2.unbind(0))]
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ep: ExpertParallel, dtype: torch.dtype, loss_scale: float,
                 sequence_parallel: bool, shared_expert: nn.Module | None, fp8: Fp8Region | None = None):
        super().__init__()
        self.layer, self.ep, self.loss_scale = layer, ep, loss_scale
        self.num_experts, self.top_k = cfg.num_experts, cfg.moe_top_k
        self.local_experts = cfg.num_experts // ep.size
        self.sigmoid = cfg.moe_router == "sigmoid"
        self.capacity_factor, self.aux_coeff = cfg.moe_capacity_factor, cfg.moe_aux_loss_coeff
        self.probs_in_experts = cfg.moe_probs_in_experts
        # the router stays in the model's dtype with FP8, as in Megatron-Core
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        self.router.sequence_parallel = sequence_parallel  # each tp rank routes its own tokens: partial gradients
        nn.init.normal_(self.router, std=0.02)
        self.router_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=dtype)) if cfg.moe_router_bias else None
        if self.router_bias is not None:  # GPT-OSS's router has a bias
            self.router_bias.sequence_parallel = sequence_parallel
        self.experts = Experts(cfg, self.local_experts, ep.etp, dtype, ep.grouped_gemm, fp8)
        self.shared = shared_expert

    @property
    def w1(self) -> nn.Parameter:
        return self.experts.w1

    @property
    def w2(self) -> nn.Parameter:
        return self.experts.w2

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [T, k], expert indices [T, k], router logits [T, E]); with forced routing the
        planned experts' scores instead of the top-k."""
        logits = nn.functional.linear(tokens, self.router, self.router_bias)
        forced = self.ep.counts.forced(self.layer, tokens.shape[0], self.top_k)
        scores = torch.sigmoid(logits) if self.sigmoid else logits
        if forced is None:
            top, indices = scores.topk(self.top_k, dim=-1)
        else:
            indices = forced
            top = scores.gather(1, indices)
        if self.sigmoid:
            return top / top.sum(dim=-1, keepdim=True), indices, logits
        return torch.softmax(top, dim=-1), indices, logits

    def _aux_loss(self, logits: torch.Tensor, counts: list[int]) -> torch.Tensor:
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if self.sigmoid:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        routed = torch.tensor(counts, dtype=scores.dtype) / (logits.shape[0] * self.top_k)
        return self.aux_coeff * self.num_experts * torch.dot(scores.mean(dim=0), routed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        if ep.dispatcher == "allgather" and ep.size * ep.etp > 1:
            tokens, probs, indices, logits, counts, everyone = self._route_and_count(x)
            combined = self._allgather_experts(tokens, probs, indices, everyone)
            return self._output(combined, x, logits, counts)
        permuted, weights, logits, exchange = self.dispatch_preprocess(x)
        received = self.dispatch(permuted, exchange)
        if self.probs_in_experts:
            out, weights = self.experts_on(received, exchange, self.dispatch(weights, exchange)), None
        else:
            out = self.experts_on(received, exchange)
        return self.combine_postprocess(self.dispatch(out, exchange.reverse()), weights, logits, x, exchange)

    def _route_and_count(self, x: torch.Tensor):
        """Steps 1 and the counts of 3: (tokens [T, h], probs, indices, logits, this source's tokens per expert,
        every source's [sources, E])."""
        tokens = x.reshape(-1, x.shape[-1])
        ep = self.ep
        probs, indices, logits = self._route(tokens)
        # tokens per expert from the routing map, as Megatron-Core (static shapes: traceable on fake tensors)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        per_expert = routing_map.sum(dim=0)
        counts = ep.counts.local(self.layer, per_expert)
        everyone = ep.counts.everyone(self.layer, per_expert, ep.size * ep.etp)  # [token sources, E]
        return tokens, probs, indices, logits, counts, everyone

    def _output(self, combined: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, counts: list[int]) -> torch.Tensor:
        combined = combined.view(x.shape)
        if self.aux_coeff:
            combined = _AttachAuxLoss.apply(combined, self._aux_loss(logits, counts), self.loss_scale)
        return combined + self.shared(x) if self.shared is not None else combined

    def dispatch_preprocess(self, x: torch.Tensor):
        """Steps 1-2 with the all-to-all dispatcher: (token copies sorted by expert, their router probabilities,
        logits, TokenExchange)."""
        tokens, probs, indices, logits, counts, everyone = self._route_and_count(x)
        order = indices.flatten().argsort(stable=True)  # token copies grouped by expert
        exchange = self.token_exchange(order, counts, everyone)
        weights = probs.flatten().index_select(0, exchange.order)
        return tokens.index_select(0, exchange.order // self.top_k), weights, logits, exchange

    def token_exchange(self, order: torch.Tensor, counts: list[int], everyone: np.ndarray) -> TokenExchange:
        """The exchange of the token copies `order` (by expert), with this source's `counts` per expert and every
        source's [sources, E]; with a capacity factor, the late copies of full experts dropped."""
        ep = self.ep
        if self.capacity_factor > 0:
            capacity = math.ceil(order.shape[0] / self.num_experts * self.capacity_factor)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            order = torch.cat([order[int(s):int(s) + min(c, capacity)] for s, c in zip(starts, counts)])
            everyone = np.minimum(everyone, capacity)
        sent = everyone[ep.counts.source].reshape(ep.size, self.local_experts)  # [destination rank, its expert]
        mine = slice(ep.rank * self.local_experts, (ep.rank + 1) * self.local_experts)
        by_source = everyone[:, mine].reshape(ep.size, ep.etp, self.local_experts)  # [ep rank, etp rank, my expert]
        return TokenExchange(order, counts, sent.sum(axis=1).tolist(), by_source,
                             by_source[:, ep.etp_rank].sum(axis=1).tolist())

    def dispatch(self, x: torch.Tensor, exchange: TokenExchange) -> torch.Tensor:
        """Step 3's all-to-all (step 5's with exchange.reverse())."""
        if self.ep.size == 1:
            return x
        return _AllToAll.apply(x, exchange.receive, exchange.send, self.ep.group)

    def experts_on(self, received: torch.Tensor, exchange: TokenExchange,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4 on the rows the all-to-all brought, in the order they came (and their probabilities, when the
        experts apply them)."""
        ep = self.ep
        by_source = exchange.by_source
        rows = by_source[:, ep.etp_rank]  # [source ep rank, my expert], what the all-to-all brings
        if ep.etp > 1:  # every etp rank computes its slice of the experts for what all of them received
            rows = by_source.transpose(1, 0, 2).reshape(-1, self.local_experts)  # by etp rank, then ep rank
            etp_sizes = by_source.sum(axis=(0, 2)).tolist()
            received = gather_uneven(received, etp_sizes, ep.etp_group, "etp")
            if weights is not None:
                weights = gather_uneven(weights, etp_sizes, ep.etp_group, "etp")
        if weights is not None:
            weights = _regroup(weights, rows)
        out = _regroup(self.experts(_regroup(received, rows), rows.sum(axis=0).tolist(), weights), rows.T)
        if ep.etp > 1:
            out = reduce_scatter_uneven_rows(out, etp_sizes, ep.etp_group, "etp")
        return out

    def combine_postprocess(self, back: torch.Tensor, weights: torch.Tensor | None, logits: torch.Tensor,
                            x: torch.Tensor, exchange: TokenExchange) -> torch.Tensor:
        """Step 5 after the all-to-all: each copy weighted by its probability (unless the experts did), summed into
        its token; the auxiliary loss and the shared expert."""
        if weights is not None:
            back = back * weights.unsqueeze(-1).to(back.dtype)
        combined = _SumCopies.apply(back, exchange.order // self.top_k, x.numel() // x.shape[-1])
        return self._output(combined, x, logits, exchange.counts)

    def _allgather_experts(self, tokens, probs, indices, everyone: np.ndarray) -> torch.Tensor:
        """Megatron-Core's all-gather dispatcher: every rank gathers the tep group's tokens, routing and
        probabilities, computes the copies routed to its experts (its slice of them with etp > 1), and the partial
        outputs are reduce-scattered back."""
        k, ep = self.top_k, self.ep
        group, size, kind = ep.counts.group, ep.size * ep.etp, ep.counts.group_kind
        gathered = gather_from_sp(tokens, group, size, kind)  # [tep T, h]
        gathered_probs = gather_from_sp(probs, group, size, kind)
        gathered_indices = all_gather_tokens(indices, group, size, group_kind=kind)
        per_expert = everyone.sum(axis=0)  # over all sources
        first = int(per_expert[:ep.rank * self.local_experts].sum())
        mine = per_expert[ep.rank * self.local_experts:(ep.rank + 1) * self.local_experts]
        order = gathered_indices.flatten().argsort(stable=True)[first:first + int(mine.sum())]
        weights = gathered_probs.flatten().index_select(0, order)
        if self.probs_in_experts:
            out = self.experts(gathered.index_select(0, order // k), mine.tolist(), weights)
        else:
            out = self.experts(gathered.index_select(0, order // k), mine.tolist())
            out = out * weights.unsqueeze(-1).to(out.dtype)
        partial = _SumCopies.apply(out, order // k, gathered.shape[0])
        return reduce_scatter_to_sp(partial, group, size, kind)
