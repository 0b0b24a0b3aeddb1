"""Data-parallel gradient synchronisation as PyTorch DDP and Megatron-Core issue it: bucketed, overlapped
with backward; with the distributed optimizer, reduce-scattered and followed by a parameter all-gather.

Like DDP's Reducer (torch/csrc/distributed/c10d/reducer.cpp, `gradient_as_bucket_view=True`):
parameters are packed into buckets of about `bucket_size_bytes` in reverse registration order
(the order backward produces their gradients); each gradient is a view into its bucket's flat
buffer, so accumulation writes straight into it; when the last gradient of a bucket is ready the
bucket is averaged and all-reduced asynchronously while backward goes on. Unlike DDP the first
bucket is not special-cased (Megatron-LM does the same). DDP's C++ reducer calls the process
group directly and cannot run on fake tensors, hence this Python twin of its schedule. With dp=1
the buckets still hold the gradients (Megatron's contiguous grad buffer) but nothing is reduced.

With `grad_dtype` fp32 under bf16/fp16 weights the buckets are Megatron's fp32 gradient buffers: each weight's
`main_grad` is its view, a micro-batch's low-precision gradient is added into it once accumulated and then
freed (Megatron's backward hook without gradient-accumulation fusion), and the buckets are reduced in fp32.
Weights in `fused_accumulation` (Megatron's gradient-accumulation fusion: the linears' weight-gradient GEMMs
accumulate into the buffer with beta = 1) also keep a `main_grad` view in any dtype; their add is noted
`fused`, so the kernel model gives it no time of its own, as the real run has no such kernel.

Sharded (ZeRO-1, Megatron-Core's distributed optimizer, Rajbhandari et al. 2020): the weights live in a
flat parameter buffer per bucket too (each weight a view into it). A ready bucket is reduce-scattered in
place, so this rank's 1/dp slice of the gradient buffer holds the sum, and the optimizer updates only
that slice (`grad_shards`, `param_shards`); the updated slices are then all-gathered back into every
replica's parameter buffer, either right after the step or, with `overlap_param_gather`, during the next
step's first forward: all buckets are issued at once and each layer waits for its own bucket in a
forward pre-hook (Megatron-Core dispatches them one bucket ahead; on one communication stream the
order and the waits are the same). Buckets are padded to a multiple of lcm(dp, 128) elements, as
Megatron-Core pads them so every shard is the same size and aligned.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from trainsim.workloads.collectives import all_gather_flat, reduce_scatter_flat
from trainsim.workloads.observe import observer


def gradient(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer reads: the fp32 `main_grad` where a bucket keeps one, else `.grad`."""
    return getattr(p, "main_grad", p.grad)


class GradientBuckets:
    def __init__(self, params: list[nn.Parameter], bucket_size_bytes: int, group, dp: int,
                 shard: bool = False, modules: list[nn.Module] = (), average_over: int | None = None,
                 grad_dtype: torch.dtype | None = None, fused_accumulation: frozenset = frozenset(),
                 replicate_group=None):
        """dp: ranks in `group` (that reduce, and shard with `shard`); average_over: replicas the gradients are
        averaged over (default dp; MoE experts: every data replica, though fewer ranks hold each expert);
        grad_dtype: the buckets' dtype (default the weights'); fused_accumulation: the weights whose gradient
        the GEMM accumulates into the buffer itself; replicate_group: with `shard`, the ranks holding the same
        slice in the other distributed-optimizer instances (Megatron-Core's
        --num-distributed-optimizer-instances): a reduce-scattered slice is then all-reduced over them."""
        self.group, self.dp, self.shard, self.grad_dtype = group, dp, shard, grad_dtype
        self.replicate_group = replicate_group
        self.fused_accumulation = fused_accumulation
        self.average_over = dp if average_over is None else average_over
        self.sync_enabled = False
        self._buckets: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        self._param_buffers: list[torch.Tensor] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._pending: list[int] = []
        self._works: list = []
        self._gather_works: dict[int, object] = {}

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
        if shard:
            for module in modules:  # layers wait for their weights' all-gather (overlap_param_gather)
                if any(p in self._bucket_of for p in module.parameters(recurse=False)):
                    module.register_forward_pre_hook(self._wait_for_weights)

    def _add_bucket(self, members: list[nn.Parameter]) -> None:
        index = len(self._buckets)
        numel = sum(p.numel() for p in members)
        if self.shard:
            numel = math.ceil(numel / math.lcm(self.dp, 128)) * math.lcm(self.dp, 128)
        buffer = torch.zeros(numel, dtype=self.grad_dtype or members[0].dtype)
        weights = torch.empty(numel, dtype=members[0].dtype) if self.shard else None
        offset = 0
        for p in members:
            view = buffer[offset:offset + p.numel()].view_as(p)
            if view.dtype == p.dtype and p not in self.fused_accumulation:
                p.grad = view
            else:
                p.main_grad = view
            if weights is not None:
                with torch.no_grad():
                    weights[offset:offset + p.numel()].copy_(p.detach().flatten())
                p.data = weights[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            self._bucket_of[p] = index
        self._buckets.append((buffer, members))
        if weights is not None:
            self._param_buffers.append(weights)

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b, _ in self._buckets]

    def _my_slice(self, flat: torch.Tensor) -> torch.Tensor:
        size = flat.numel() // self.dp
        me = dist.get_rank(self.group) if self.dp > 1 else 0
        return flat[me * size:(me + 1) * size]

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's slice of each gradient bucket (after the reduce-scatter: the summed gradients)."""
        return [self._my_slice(buffer) for buffer, _ in self._buckets]

    def param_shards(self) -> list[torch.Tensor]:
        """This rank's slice of each parameter buffer: the weights its optimizer updates."""
        return [self._my_slice(weights) for weights in self._param_buffers]

    def zero_grad(self) -> None:
        for buffer, _ in self._buckets:
            buffer.zero_()

    def start_backward(self, sync: bool) -> None:
        """Call before each micro-batch's backward; sync=True on the last one (DDP's no_sync otherwise)."""
        self.sync_enabled = sync
        self._pending = [len(members) for _, members in self._buckets]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if hasattr(param, "main_grad"):
            with observer().kernel_notes(fused=1) if param in self.fused_accumulation else contextlib.nullcontext():
                param.main_grad.add_(param.grad)
            param.grad = None
        if not self.sync_enabled or self.average_over == 1:
            return
        index = self._bucket_of[param]
        self._pending[index] -= 1
        if self._pending[index] == 0:
            buffer = self._buckets[index][0]
            with observer().once_per_step():
                buffer.div_(self.average_over)  # average (gloo has no AVG reduction; DDP divides before too)
                if self.dp == 1 and self.replicate_group is None:
                    return
                with observer().communication(async_op=True):  # waited for in finish(), before the optimizer
                    if self.shard:
                        work = reduce_scatter_flat(self._my_slice(buffer), buffer, group=self.group,
                                                   async_op=True) if self.dp > 1 else None
                        if self.replicate_group is not None:  # then the slice across the instances (Megatron's
                            if work is not None:  # second stream waits for the first: ordered, as here)
                                work.wait()
                            work = dist.all_reduce(self._my_slice(buffer), group=self.replicate_group,
                                                   async_op=True)
                    else:
                        work = dist.all_reduce(buffer, group=self.group, async_op=True)
                    self._works.append(work)

    def finish(self) -> None:
        """Wait for every bucket's reduction (before the optimizer step)."""
        with observer().communication():
            for work in self._works:
                work.wait()
        self._works.clear()
        self.sync_enabled = False

    def gather_params(self, wait: bool) -> None:
        """All-gather every bucket's updated weights into all replicas, in the order forward uses them (the
        last bucket holds the first layers); wait=False leaves each bucket to its layers' pre-hooks."""
        if not self.shard or self.dp == 1:
            return
        with observer().once_per_step(), observer().communication(async_op=not wait):
            for index in reversed(range(len(self._param_buffers))):
                weights = self._param_buffers[index]
                work = all_gather_flat(weights, self._my_slice(weights), group=self.group, async_op=True)
                if wait:
                    work.wait()
                else:
                    self._gather_works[index] = work

    def _wait_for_weights(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=False):
            work = self._gather_works.pop(self._bucket_of.get(p, -1), None)
            if work is not None:
                with observer().communication():
                    work.wait()
