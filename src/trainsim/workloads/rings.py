"""Rings that overlap tensor- and context-parallel communication with the GEMMs that need it.

Each step multiplies the block a rank holds while the next block travels one hop (Transformer Engine's
ring-exchange overlap, Megatron-Core --tp-comm-overlap; the context-parallel attention ring). Both the bf16
layers (tensor_parallel.py) and their FP8 twins (fp8.py) run them, passing their own block GEMM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainsim.workloads.collectives import all_gather_flat, reduce_scatter_flat
from trainsim.workloads.observe import observer


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor (the one-byte floats) as uint8 for c10d (no FP8 type in NCCL or gloo); others unchanged."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group, size: int, group_kind: str = "tp") -> list:
    """Start sending `send` to the next rank of `group` (a ring of `size`, of kind `group_kind`) and receiving
    `recv` from the previous one (async)."""
    me = dist.get_rank(group)
    send, recv = as_bytes(send), as_bytes(recv)
    with observer().communication(async_op=True, group_kind=group_kind):
        return [dist.isend(send, group=group, group_dst=(me + 1) % size),
                dist.irecv(recv, group=group, group_src=(me - 1) % size)]


def wait_all(works: list, group_kind: str = "tp") -> None:
    with observer().communication(group_kind=group_kind):
        for work in works:
            work.wait()


# cite: Transformer Engine's default num_sm of its pipelined and bulk overlap
REDUCE_SCATTER_COMM_SMS = 16
"""SMs Transformer Engine's reduce-scatter overlap gives its communication kernels, which do the reduction there
(TE's default `num_sm` for the "pipeline" and "bulk" methods; the GEMMs meanwhile run on the other SMs)."""


def ring_all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group, tp: int, mm=None,
                           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(all-gather(x) @ weight^T, all-gather(x)) with the gather overlapped: tp steps, each multiplying the
    token block it holds while the next block travels one hop around the ring (Transformer Engine's
    ring-exchange all-gather overlap, Megatron-Core --tp-comm-overlap). x: [t, k] -> [tp t, n].
    mm(block, out): the block GEMM (default torch.mm with weight^T; FP8 layers pass theirs, fp8.py)."""
    me, t = dist.get_rank(group), x.shape[0]
    if mm is None:
        def mm(block, out):
            return torch.mm(block, weight.t(), out=out)
    gathered = torch.empty((tp * t, x.shape[1]), dtype=x.dtype, device=x.device)
    out = torch.empty((tp * t, weight.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    gathered[me * t:(me + 1) * t].copy_(x)
    for step in range(tp):
        block = (me - step) % tp
        works = []
        if step < tp - 1:
            incoming = (me - step - 1) % tp
            works = ring_exchange(gathered[block * t:(block + 1) * t], gathered[incoming * t:(incoming + 1) * t],
                                   group, tp)
        mm(gathered[block * t:(block + 1) * t], out[block * t:(block + 1) * t])
        wait_all(works)
    return out, gathered


def ring_matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, tp: int, mm=None) -> torch.Tensor:
    """reduce-scatter(x @ weight^T) over tokens with the reduction overlapped: at each of tp steps a rank
    multiplies one token block, adds the partial sum the previous rank passed on and sends it on; after
    the last step it holds the full sum of its own block. x: [tp t, k] -> [t, n]. mm(block): the block
    GEMM (default torch.mm with weight^T). As Transformer Engine does, the additions are the communication
    kernels' work, on REDUCE_SCATTER_COMM_SMS SMs the GEMMs meanwhile go without."""
    me, t = dist.get_rank(group), x.shape[0] // tp
    if mm is None:
        def mm(block):
            return torch.mm(block, weight.t())
    incoming: tuple[torch.Tensor, list] | None = None  # the partial sum on its way from the previous rank
    for step in range(tp):
        block = (me - 1 - step) % tp  # the last step is this rank's own block
        with observer().kernel_notes(comm_sms=REDUCE_SCATTER_COMM_SMS):
            product = mm(x[block * t:(block + 1) * t])
        if incoming is not None:
            received, works = incoming
            wait_all(works)
            with observer().kernel_notes(comm_kernel=1):
                product.add_(received)
        if step < tp - 1:
            received = torch.empty_like(product)
            incoming = received, ring_exchange(product, received, group, tp)
    return product


def gather_tokens(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """All-gather token shards [t, h] -> [tp t, h] and wait (FP8 shards as their bytes)."""
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with observer().communication():
        all_gather_flat(as_bytes(out), as_bytes(x), group=group)
    return out


def start_all_gather_tokens(x: torch.Tensor, group, tp: int) -> tuple[torch.Tensor, list]:
    """Start all-gathering token shards [t, h] -> [tp t, h] (FP8 shards as their bytes); the caller waits where it
    needs them."""
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with observer().communication(async_op=True):
        return out, [all_gather_flat(as_bytes(out), as_bytes(x), group=group, async_op=True)]


def start_reduce_scatter_tokens(grad_input: torch.Tensor, group, tp: int, behind_next_gemm: bool = True
                                ) -> tuple[torch.Tensor, list]:
    """Start reduce-scattering partial sums [tp t, h] into this rank's [t, h]; the caller waits. Without
    `behind_next_gemm` (model.tp_overlap_backward 'none') the step waits for it before its next kernel."""
    grad_x = grad_input.new_empty((grad_input.shape[0] // tp, *grad_input.shape[1:]))
    with observer().communication(async_op=behind_next_gemm):
        return grad_x, [reduce_scatter_flat(grad_x, grad_input, group=group, async_op=True)]
