"""Fully sharded data parallelism (ZeRO-2/3) with PyTorch's own FSDP2 (`fully_shard`), as torchtitan runs it.

Each transformer block is one FSDP unit and the chunk (embedding, final norm, output layer) the root unit; an MoE
block's experts are a unit of their own inside it, sharded over the ranks that hold the same experts (the edp
group), as torchtitan shards experts with expert parallelism.
Parameters, gradients and optimizer state live sharded over the data-parallel group (dp x cp ranks, the
group that holds the same weights): fp32 shards, all-gathered into bf16 weights before a unit's forward
(MixedPrecisionPolicy, the all-gather carries bf16) and, for ZeRO-3, again before its backward; gradients
are reduce-scattered in fp32 after every micro-batch's backward (FSDP2's default, torchtitan's
`mixed_precision_reduce: float32`) and accumulate into the sharded gradient. zero_stage 2 keeps the
gathered weights from forward to backward (`reshard_after_forward=False`, FSDP's SHARD_GRAD_OP: one
all-gather per micro-batch); zero_stage 3 frees them after forward (two all-gathers per micro-batch).

On a GPU FSDP2 overlaps the next unit's all-gather with this unit's compute through its own CUDA streams
(implicit prefetch: the host runs ahead). Here every unit explicitly prefetches the next one, in forward
and in backward (`set_modules_to_forward_prefetch` / `_backward_prefetch`), so the issue order on the host,
and therefore the trace, has each all-gather before the compute it overlaps with on a GPU. (FSDP2's default
backward prefetch follows the order of the last forwards, which the root's end of backward clears: with
pipelining's interleaved micro-batches every backward after the first would then gather without prefetch.)

The collectives go through FSDP2's custom-communication hooks only so the step observer sees them as the
data-parallel group's communication (and a real run over gloo records the same ops as the trace); the
calls themselves are FSDP2's default flat all-gather and reduce-scatter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, Shard

from trainsim.workloads.collectives import all_gather_flat, reduce_scatter_flat
from trainsim.workloads.moe import Experts
from trainsim.workloads.observe import observer


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP2 DTensor, the tensor itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _DataParallelAllGather(AllGather):
    def __init__(self, group_kind: str = "dp"):
        self.group_kind = group_kind

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # waited for where its result is read (FSDP2's copy-out), as on the GPU's all-gather stream
        with observer().communication(async_op=True, group_kind=self.group_kind):
            return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)


class _DataParallelReduceScatter(ReduceScatter):
    def __init__(self, group_kind: str = "dp"):
        self.group_kind = group_kind

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with observer().communication(async_op=True, group_kind=self.group_kind):
            return reduce_scatter_flat(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def _mesh(group) -> DeviceMesh:
    # outside fake tensors: the mesh keeps its ranks in a real tensor and reads them back (.tolist())
    with unset_fake_temporarily():
        return DeviceMesh.from_group(group, torch.get_default_device().type)


def _experts_of(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(m, Experts)]


def _expert_placement(ranks: int):
    """Where FSDP2 shards an expert weight over `ranks`: with fewer local experts than ranks it would pad the experts'
    dim to the ranks (twice the bytes for 2 experts on 4 ranks), so the next dim then, as torchtitan does."""
    return lambda weight: Shard(1) if weight.shape[0] < ranks else None


def shard_chunk(chunk: nn.Module, group, zero_stage: int, dtype: torch.dtype, expert_group=None,
                replicas: int = 1) -> None:
    """Apply fully_shard to each block (`chunk.layers`) and then to the chunk (the root unit), in place; a block's
    MoE experts first, as a unit of their own over `expert_group`, the ranks holding the same experts (torchtitan's
    FSDP with expert parallelism), their gradients averaged over all `replicas` of the batch like the others'.

    The weights become fp32 DTensor shards (the master weights); forward computes in `dtype`. Every
    parameter gets a zero sharded gradient now, so micro-batches and steps accumulate into it in place."""
    if dtype != torch.float32:
        for p in chunk.parameters():
            p.data = p.data.float()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = zero_stage >= 3
    blocks = list(chunk.layers)
    experts = {block: _experts_of(block) for block in blocks}
    units = [*blocks, chunk]
    expert_units = [e for block in blocks for e in experts[block]]
    for unit, mesh_group, kind in ([(e, expert_group, "edp") for e in expert_units]
                                   + [(u, group, "dp") for u in units]):
        mesh = _mesh(mesh_group)
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    shard_placement_fn=_expert_placement(mesh.size()) if kind == "edp" else None)
        unit.set_custom_all_gather(_DataParallelAllGather(kind))
        unit.set_custom_reduce_scatter(_DataParallelReduceScatter(kind))
        if kind == "edp":  # average over every replica, not the edp ranks; as a sum and a division (gloo takes no
            unit.set_gradient_divide_factor(float(replicas))  # pre-scaled sum)
            unit.set_force_sum_reduction_for_comms(True)
    # the root gathers its own weights, then the first block's (with its experts); each block the next one's
    if blocks:
        chunk.set_modules_to_forward_prefetch([blocks[0], *experts[blocks[0]]])
        chunk.set_modules_to_backward_prefetch([blocks[-1], *experts[blocks[-1]]])
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following, *experts[following]])
        following.set_modules_to_backward_prefetch([block, *experts[block]])
    for p in chunk.parameters():
        p.grad = torch.zeros_like(p)
    # FSDP2 initialises lazily in the first forward (root state, the gathered weights' tensors): do it now, so
    # the traced step is a steady-state step like the measured ones
    every_unit = [*expert_units, *units]
    for unit in every_unit[::-1]:  # the root first (the first to initialise is the root)
        unit.unshard()
    for unit in every_unit:
        unit.reshard()


def gathered_weight_bytes(chunks: list[nn.Module], zero_stage: int, dtype: torch.dtype) -> int:
    """Bytes of gathered weights FSDP2 holds at the step's worst moment, the start of a backward, when the
    micro-batch's activations are all alive. FSDP2 allocates and frees them by resizing storages in place,
    which no dispatched op shows (the trace's allocation timeline cannot see them). ZeRO-3: the root unit
    (gathered from the start of its backward to the end) and two blocks (the one running, the one prefetched);
    ZeRO-2: every unit, kept gathered from its forward to its backward. 0 without FSDP."""
    if zero_stage < 2:
        return 0

    def unit_bytes(params) -> int:
        return sum(p.numel() for p in params) * dtype.itemsize  # a DTensor's numel is the unsharded one

    roots = sum(unit_bytes(p for name, p in chunk.named_parameters() if not name.startswith("layers."))
                for chunk in chunks)
    blocks = [unit_bytes(block.parameters()) for chunk in chunks for block in chunk.layers]
    return roots + (sum(blocks) if zero_stage == 2 else 2 * max(blocks, default=0))
