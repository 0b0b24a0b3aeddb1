"""torch.distributed collectives under one name whatever the installed torch and backend.

torch 2.13 calls the flat all-gather and reduce-scatter all_gather_single / reduce_scatter_single (and warns on
the old names); the older releases the project accepts (pyproject: torch >= 2.6, e.g. the 2.11 CUDA build of a GPU
machine) have only all_gather_into_tensor / reduce_scatter_tensor. Both dispatch to the same c10d ops, so traces
agree. The uneven all-gather (chunks of different lengths, as MoE's expert-tensor-parallel token exchange needs)
is one all_gather on NCCL and the fake backend; gloo has none (see all_gather_uneven).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainsim.workloads.observe import observer

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""(output [world * n, ...], input [n, ...], group=..., async_op=...)"""
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""(output [n, ...], input [world * n, ...], group=..., async_op=...)"""


def all_gather_uneven(chunks: list[torch.Tensor], x: torch.Tensor, group, group_kind: str) -> None:
    """Gather every rank's `x` into `chunks` (rank order; lengths along dim 0 may differ): Megatron-Core's
    all_gather of a list, which NCCL runs as coalesced broadcasts. Gloo gathers equal chunks only, so there each
    is padded to the longest and trimmed; the recorder is told the unpadded call stands for it (what NCCL runs)."""
    if dist.get_backend(group) != "gloo":
        with observer().communication(group_kind=group_kind):
            dist.all_gather(chunks, x, group=group)
        return
    longest = max(c.shape[0] for c in chunks)
    with observer().communication(group_kind=group_kind, stands_for=([chunks], [x])):
        padded = [x.new_empty((longest, *x.shape[1:])) for _ in chunks]
        dist.all_gather(padded, torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))]), group=group)
        for chunk, received in zip(chunks, padded):
            chunk.copy_(received[:chunk.shape[0]])


def reduce_scatter_uneven(out: torch.Tensor, chunks: list[torch.Tensor], group, group_kind: str) -> None:
    """Sum every rank's `chunks` and keep this rank's in `out` (lengths may differ; gloo and NCCL take a list)."""
    with observer().communication(group_kind=group_kind):
        dist.reduce_scatter(out, chunks, group=group)
