"""Data-parallel gradient synchronisation as PyTorch DDP issues it: bucketed, overlapped with backward.

Like DDP's Reducer (torch/csrc/distributed/c10d/reducer.cpp, `gradient_as_bucket_view=True`):
parameters are packed into buckets of about `bucket_size_bytes` in reverse registration order
(the order backward produces their gradients); each gradient is a view into its bucket's flat
buffer, so accumulation writes straight into it; when the last gradient of a bucket is ready the
bucket is averaged and all-reduced asynchronously while backward goes on. Unlike DDP the first
bucket is not special-cased (Megatron-LM does the same). DDP's C++ reducer calls the process
group directly and cannot run on fake tensors, hence this Python twin of its schedule. With dp=1
the buckets still hold the gradients (Megatron's contiguous grad buffer) but nothing is reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainsim.workloads.observe import observer


class GradientBuckets:
    def __init__(self, params: list[nn.Parameter], bucket_size_bytes: int, group, dp: int):
        self.group, self.dp = group, dp
        self.sync_enabled = False
        self._buckets: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._pending: list[int] = []
        self._works: list = []

        members: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            members.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_size_bytes:
                self._add_bucket(members)
                members, size = [], 0
        if members:
            self._add_bucket(members)
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _add_bucket(self, members: list[nn.Parameter]) -> None:
        index = len(self._buckets)
        buffer = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype)
        offset = 0
        for p in members:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            self._bucket_of[p] = index
        self._buckets.append((buffer, members))

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b, _ in self._buckets]

    def zero_grad(self) -> None:
        for buffer, _ in self._buckets:
            buffer.zero_()

    def start_backward(self, sync: bool) -> None:
        """Call before each micro-batch's backward; sync=True on the last one (DDP's no_sync otherwise)."""
        self.sync_enabled = sync
        self._pending = [len(members) for _, members in self._buckets]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_enabled or self.dp == 1:
            return
        index = self._bucket_of[param]
        self._pending[index] -= 1
        if self._pending[index] == 0:
            buffer = self._buckets[index][0]
            with observer().once_per_step():
                buffer.div_(self.dp)  # average (gloo has no AVG reduction; DDP divides before too)
                with observer().communication():
                    self._works.append(dist.all_reduce(buffer, group=self.group, async_op=True))

    def finish(self) -> None:
        """Wait for every bucket's all-reduce (before the optimizer step)."""
        with observer().communication():
            for work in self._works:
                work.wait()
        self._works.clear()
        self.sync_enabled = False
