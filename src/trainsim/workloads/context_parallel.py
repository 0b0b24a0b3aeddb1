"""Context parallelism as Megatron-Core runs it with Transformer Engine: one sequence over cp ranks.

Every rank holds the same weights and 1/cp of each sequence's tokens; everything but attention is
token-local. The causal split is load-balanced (Megatron's get_batch_on_this_cp_rank): the sequence is
cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so each rank has the same share of the
causal attention work. Attention over the whole sequence then comes in one of two ways:

* 'p2p', ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): cp steps; at each
  the rank attends its queries to one rank's keys and values while the next block travels one hop round
  the ring (send to the next rank, receive from the previous one), and merges the block's result into
  its output with the blocks' log-sum-exps (online softmax). Backward goes round again: the keys and
  values travel as in forward, and their gradients travel with them, each rank adding its part, until
  they are back with their owner.
* 'all_gather': the keys and values of all ranks are all-gathered before attention (and again in
  backward, rather than kept), and their gradients reduce-scattered after.

Attention blocks run the flash-attention kernel that returns its log-sum-exp (the CPU's or the GPU's);
attention dropout is not applied under context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainsim.workloads.collectives import all_gather_flat, reduce_scatter_flat
from trainsim.workloads.observe import observer
from trainsim.workloads.rings import ring_exchange, wait_all


def chunk_order(cp: int) -> list[tuple[int, int]]:
    """(rank, half) that holds each of the sequence's 2 cp chunks, in sequence order."""
    return [(k, 0) if k < cp else (2 * cp - 1 - k, 1) for k in range(2 * cp)]


def local_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions in the sequence of the tokens context-parallel rank `cp_rank` holds, in its order."""
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in (cp_rank, 2 * cp - 1 - cp_rank)])


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a full-sequence tensor (token ids, targets): one index_select, as Megatron."""
    index = local_positions(x.shape[dim], cp, cp_rank).to(x.device)
    return x.index_select(dim, index)


def _expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys/values repeated to `heads` (the GPU flash op wants equal head counts)."""
    group = heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def flash_forward(q, k, v, causal: bool):
    """(out, log-sum-exp [b, h, s] fp32, what the backward needs) of one attention block."""
    if q.is_cuda:
        k, v = _expand_kv(k, v, q.shape[1])
        out, lse, *extra = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse, extra
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def flash_backward(dout, q, k, v, out, lse, causal: bool, extra):
    """(dq, dk, dv) of one block, given the output and log-sum-exp of the whole attention (ring attention's
    backward: each block's probabilities are exact with the final log-sum-exp)."""
    if q.is_cuda:  # the CUDA kernel reads the log-sum-exp as a dense [b, h, s]: a slice of it must be copied
        kv_heads = k.shape[1]
        ke, ve = _expand_kv(k, v, q.shape[1])
        cum_q, cum_k, max_q, max_k, seed, offset, _ = extra
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), out.contiguous(), lse.contiguous(),
            cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        if dk.shape[1] != kv_heads:
            b, _, s, d = dk.shape
            dk, dv = (g.view(b, kv_heads, -1, s, d).sum(2) for g in (dk, dv))
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's normalised result into the running one, in place (online softmax): out [.., s, d]
    fp32, lse [.., s] fp32."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _ring_block(step: int, rank: int, cp: int, c: int) -> tuple[slice, slice, bool]:
    """Which of my queries attend which of the keys held at ring step `step`, and whether causally.

    Step 0 holds my own chunks (causal over both). Keys of an earlier rank: its first chunk comes before
    both of mine and its second after both, so all my queries see its first chunk. Keys of a later rank:
    both its chunks lie between my two, so only my second chunk sees them.
    """
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % cp < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _save(ctx, q, kv, out, lse, group, cp: int, extras: list) -> torch.Tensor:
    """Keep what the backward of either attention needs; return the output in the queries' dtype."""
    out = out.to(q.dtype)
    ctx.save_for_backward(q, kv, out, lse)
    ctx.group, ctx.cp, ctx.extras = group, cp, extras
    return out


def _restore(ctx, dout):
    """(q, kv, out, lse, dout, an fp32 dq to accumulate into, group, cp, rank, chunk length) for backward."""
    q, kv, out, lse = ctx.saved_tensors
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return q, kv, out, lse, dout.contiguous(), dq, ctx.group, ctx.cp, dist.get_rank(ctx.group), q.shape[2] // 2


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp):
        rank, c = dist.get_rank(group), q.shape[2] // 2
        kv = torch.stack((k, v))  # one buffer travels the ring
        held, out, lse, extras = kv, None, None, []
        for step in range(cp):
            if step + 1 < cp:
                incoming = torch.empty_like(held)
                works = ring_exchange(held, incoming, group, cp, "cp")
            qs, ks, causal = _ring_block(step, rank, cp, c)
            block_out, block_lse, extra = flash_forward(q[:, :, qs], held[0][:, :, ks], held[1][:, :, ks], causal)
            extras.append(extra)
            if out is None:
                out, lse = block_out.float(), block_lse.float()
            else:
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if step + 1 < cp:
                wait_all(works, "cp")
                held = incoming
        return _save(ctx, q, kv, out, lse, group, cp, extras)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, dout, dq, group, cp, rank, c = _restore(ctx, dout)
        held, passing = kv, None
        for step in range(cp):
            if step + 1 < cp:
                incoming = torch.empty_like(held)
                works = ring_exchange(held, incoming, group, cp, "cp")
            qs, ks, causal = _ring_block(step, rank, cp, c)
            dq_block, dk_block, dv_block = flash_backward(
                dout[:, :, qs], q[:, :, qs], held[0][:, :, ks], held[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                causal, ctx.extras[step])
            dq[:, :, qs] += dq_block
            dkv = torch.zeros_like(kv)  # my part of the gradient of the keys/values held now
            dkv[0][:, :, ks] += dk_block
            dkv[1][:, :, ks] += dv_block
            if passing is not None:  # the parts of the ranks they visited before me
                wait_all(passing[1], "cp")
                dkv += passing[0]
            received = torch.empty_like(dkv)
            passing = received, ring_exchange(dkv, received, group, cp, "cp")
            if step + 1 < cp:
                wait_all(works, "cp")
                held = incoming
        wait_all(passing[1], "cp")  # my own keys' and values' gradient, back from its round
        dkv = passing[0]
        return dq.to(q.dtype), dkv[0], dkv[1], None, None


def _gather_sequence(kv: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[2, b, hkv, 2c, d] of each rank -> [2, b, hkv, 2 cp c, d] in sequence order."""
    gathered = torch.empty((cp, *kv.shape), dtype=kv.dtype, device=kv.device)
    with observer().communication(group_kind="cp"):
        all_gather_flat(gathered.view(-1, *kv.shape[1:]), kv, group=group)
    c = kv.shape[3] // 2
    return torch.cat([gathered[r][:, :, :, half * c:(half + 1) * c] for r, half in chunk_order(cp)], dim=3)


def _all_gather_blocks(rank: int, cp: int, c: int) -> list[tuple[slice, slice, bool]]:
    """(my queries, keys in sequence order, causal) blocks: each of my chunks attends every earlier chunk
    fully and its own causally."""
    blocks = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        qs = slice(half * c, (half + 1) * c)
        if chunk:
            blocks.append((qs, slice(0, chunk * c), False))
        blocks.append((qs, slice(chunk * c, (chunk + 1) * c), True))
    return blocks


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp):
        rank, c = dist.get_rank(group), q.shape[2] // 2
        kv = torch.stack((k, v))
        full = _gather_sequence(kv, group, cp)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        extras, started = [], set()
        for qs, ks, causal in _all_gather_blocks(rank, cp, c):
            block_out, block_lse, extra = flash_forward(q[:, :, qs], full[0][:, :, ks], full[1][:, :, ks], causal)
            extras.append(extra)
            if qs.start in started:
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            else:
                out[:, :, qs] = block_out
                lse[:, :, qs] = block_lse
                started.add(qs.start)
        return _save(ctx, q, kv, out, lse, group, cp, extras)  # the local keys/values: gathered again in backward

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, dout, dq, group, cp, rank, c = _restore(ctx, dout)
        full = _gather_sequence(kv, group, cp)
        dfull = torch.zeros_like(full)
        for (qs, ks, causal), extra in zip(_all_gather_blocks(rank, cp, c), ctx.extras):
            dq_block, dk_block, dv_block = flash_backward(
                dout[:, :, qs], q[:, :, qs], full[0][:, :, ks], full[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                causal, extra)
            dq[:, :, qs] += dq_block
            dfull[0][:, :, ks] += dk_block
            dfull[1][:, :, ks] += dv_block
        # back to rank order ([cp, 2, b, hkv, 2c, d]), summed over the ranks into each owner's chunks
        by_rank = [[None, None] for _ in range(cp)]
        for k, (r, half) in enumerate(chunk_order(cp)):
            by_rank[r][half] = dfull[:, :, :, k * c:(k + 1) * c]
        send = torch.stack([torch.cat(halves, dim=3) for halves in by_rank])
        dkv = torch.empty_like(kv)
        with observer().communication(group_kind="cp"):
            reduce_scatter_flat(dkv, send.view(-1, *kv.shape[1:]), group=group)
        return dq.to(q.dtype), dkv[0], dkv[1], None, None


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in its context-parallel group (parallelism.cp > 1)."""

    size: int
    rank: int
    group: object
    comm_type: str
    """parallelism.cp_comm_type: 'p2p' or 'all_gather'."""

    def positions(self, seq_length: int) -> torch.Tensor:
        return local_positions(seq_length, self.size, self.rank)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return split_sequence(x, self.size, self.rank, dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries [b, h, 2c, d] over the whole sequence, whose keys and
        values [b, hkv, 2c, d] are spread over the group's ranks (load-balanced chunks)."""
        attention = _RingAttention if self.comm_type == "p2p" else _AllGatherAttention
        return attention.apply(q, k, v, self.group, self.size)
