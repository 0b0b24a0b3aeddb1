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

HSDP (parallelism.dp_shard_size < dp * cp): each unit is sharded over its dp_shard group alone (a 1-D mesh) and
an all-reduce hook sums the reduce-scattered gradient shards over the dp_replicate group, every micro-batch, before
they accumulate: what FSDP2 runs on a 2-D (replicate, shard) DeviceMesh (reduce-scatter, then all-reduce of the
shard on its all-reduce stream), through hooks so the step observer names both groups.

FP8 (precision 'fp8'): the blocks' linears cast their gathered bf16 weights to FP8 at every use (torchao's
Float8Linear as torchtitan runs it under FSDP; a weight exists only while its unit is gathered). With
parallelism.fp8_param_gather the weights travel in FP8 (torchtitan's enable_fsdp_float8_all_gather): after each
optimizer step the amaxes of every unit's fp32 shards are taken in one kernel and all-reduced (MAX) in one message
over the shard group, giving each unit its scale (precompute_float8_dynamic_scale_for_fsdp); before a unit's
all-gather its shard is cast to FP8 with that scale (one kernel per unit and gather), and the all-gather carries
1 byte per weight. The gathered weights are FP8, so the linears need no cast (fp8.Fp8Linear.gathered_scale). FSDP2
copies out in its parameter dtype, so here the gathered bytes are turned back into bf16 inside the communication
call (not recorded: a GPU has no such kernel) and the linears' cast of them is noted fused. Differences from
torchao, both small: one scale per unit rather than per weight, and a block's norm weights (2 h of its ~12 h^2
elements) travel in FP8 with its linears. The root unit (embedding, output layer: not FP8 in torchtitan) and MoE
experts (sharded over the edp group, which the scales' all-reduce does not span) gather bf16.

The collectives go through FSDP2's custom-communication hooks only so the step observer sees them as the
data-parallel group's communication (and a real run over gloo records the same ops as the trace); the
calls themselves are FSDP2's default flat all-gather and reduce-scatter.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, Shard

from trainsim.workloads.collectives import all_gather_flat, reduce_scatter_flat
from trainsim.workloads.fp8 import FORWARD_DTYPE, FP8_MAX, Fp8Linear, cast_fp8
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


class Fp8GatherScales:
    """The FP8 scale of every unit whose weights are all-gathered in FP8, recomputed after each optimizer step from
    the amaxes of all units' shards in one all-reduce over the shard group (torchtitan's
    precompute_float8_dynamic_scale_for_fsdp)."""

    def __init__(self, group, ranks: int):
        self.group, self.ranks = group, ranks
        self.shards: list[torch.Tensor] = []
        self.unit_of_shard: list[int] = []
        self.units = 0
        self.scales: torch.Tensor | None = None

    def register(self, unit: nn.Module) -> int:
        """Add a unit (after fully_shard: its parameters are the fp32 shards); its index."""
        for p in unit.parameters():
            self.shards.append(local(p))
            self.unit_of_shard.append(self.units)
        self.units += 1
        return self.units - 1

    def precompute(self) -> None:
        if not self.units:
            return
        amaxes = torch.stack(torch._foreach_norm(self.shards, float("inf")))
        if self.ranks > 1:
            with observer().communication():
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.group)
        index = torch.tensor(self.unit_of_shard)
        unit_amax = amaxes.new_zeros(self.units).scatter_reduce_(0, index, amaxes, "amax")
        self.scales = unit_amax.clamp(min=1e-12).reciprocal().mul(FP8_MAX[FORWARD_DTYPE])

    def scale(self, unit: int) -> torch.Tensor:
        return self.scales[unit]


class _Fp8AllGather(_DataParallelAllGather):
    """A unit's all-gather in FP8: its bf16 shard cast with the unit's scale, the bytes gathered into the front of
    FSDP2's output buffer (so the buffer's writer is the collective), then turned back into bf16 there."""

    def __init__(self, scales: Fp8GatherScales, unit: int, group_kind: str = "dp"):
        super().__init__(group_kind)
        self.scales, self.unit = scales, unit

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        scale = self.scales.scale(self.unit)
        shard = cast_fp8(input_tensor, scale).view(torch.uint8)
        gathered = output_tensor.view(torch.uint8)[:shard.numel() * group.size()]
        with observer().communication(async_op=True, group_kind=self.group_kind):
            work = all_gather_flat(gathered, shard, group=group, async_op=async_op)
            if work is not None:
                work.wait()
            output_tensor.copy_(gathered.clone().view(FORWARD_DTYPE)).div_(scale)
        return None


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


def _all_reduce_over(group):
    """FSDP2 all-reduce hook: sum a unit's reduce-scattered gradient shard over the HSDP replicas."""
    def all_reduce(reduce_output: torch.Tensor) -> None:
        with observer().communication(async_op=True, group_kind="dp_replicate"):
            dist.all_reduce(reduce_output, group=group)
    return all_reduce


def shard_chunk(chunk: nn.Module, group, zero_stage: int, dtype: torch.dtype, expert_group=None,
                replicas: int = 1, replicate_group=None, fp8_scales: Fp8GatherScales | None = None,
                reduce_dtype: torch.dtype = torch.float32) -> None:
    """Apply fully_shard to each block (`chunk.layers`) and then to the chunk (the root unit), in place; a block's
    MoE experts first, as a unit of their own over `expert_group`, the ranks holding the same experts (torchtitan's
    FSDP with expert parallelism), their gradients averaged over all `replicas` of the batch like the others'.

    The weights become fp32 DTensor shards (the master weights); forward computes in `dtype`. Every
    parameter gets a zero sharded gradient now, so micro-batches and steps accumulate into it in place.
    replicate_group: HSDP, `group` then holds one replica's shards and the gradients are all-reduced over this group;
    fp8_scales: the blocks (not the root) all-gather their weights in FP8 with these scales."""
    if dtype != torch.float32:
        for p in chunk.parameters():
            p.data = p.data.float()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    reshard = zero_stage >= 3
    blocks = list(chunk.layers)
    experts = {block: _experts_of(block) for block in blocks}
    units = [*blocks, chunk]
    expert_units = [e for block in blocks for e in experts[block]]
    dense_kind = "dp" if replicate_group is None else "dp_shard"
    for unit, mesh_group, kind in ([(e, expert_group, "edp") for e in expert_units]
                                   + [(u, group, dense_kind) for u in units]):
        mesh = _mesh(mesh_group)
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    shard_placement_fn=_expert_placement(mesh.size()) if kind == "edp" else None)
        fp8_gather = fp8_scales is not None and kind != "edp" and unit is not chunk
        if fp8_gather:
            index = fp8_scales.register(unit)
            for linear in _fp8_linears(unit, expert_units):
                linear.gathered_scale = partial(fp8_scales.scale, index)
        unit.set_custom_all_gather(_Fp8AllGather(fp8_scales, index, kind) if fp8_gather
                                   else _DataParallelAllGather(kind))
        unit.set_custom_reduce_scatter(_DataParallelReduceScatter(kind))
        if kind == "dp_shard":
            unit.set_all_reduce_hook(_all_reduce_over(replicate_group))
        if kind != "dp":  # average over every replica, not the edp / shard ranks; as a sum and a division (gloo
            unit.set_gradient_divide_factor(float(replicas))  # takes no pre-scaled sum)
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
    if fp8_scales is not None:
        fp8_scales.precompute()
    every_unit = [*expert_units, *units]
    for unit in every_unit[::-1]:  # the root first (the first to initialise is the root)
        unit.unshard()
    for unit in every_unit:
        unit.reshard()


def _fp8_linears(unit: nn.Module, other_units: list[nn.Module]) -> list[Fp8Linear]:
    """The FP8 state of the linears whose weights `unit` itself holds (not those of a unit inside it)."""
    inside = {id(m) for other in other_units if other is not unit for m in other.modules()}
    return [v for m in unit.modules() if id(m) not in inside for v in vars(m).values() if isinstance(v, Fp8Linear)]


def gathered_weight_bytes(chunks: list[nn.Module], zero_stage: int, dtype: torch.dtype,
                          fp8_blocks: bool = False) -> int:
    """Bytes of gathered weights FSDP2 holds at the step's worst moment, the start of a backward, when the
    micro-batch's activations are all alive. FSDP2 allocates and frees them by resizing storages in place,
    which no dispatched op shows (the trace's allocation timeline cannot see them). ZeRO-3: the root unit
    (gathered from the start of its backward to the end) and two blocks (the one running, the one prefetched);
    ZeRO-2: every unit, kept gathered from its forward to its backward. 0 without FSDP. fp8_blocks: the blocks'
    weights are gathered in FP8 (parallelism.fp8_param_gather), 1 byte each."""
    if zero_stage < 2:
        return 0

    def unit_bytes(params, itemsize: int = dtype.itemsize) -> int:
        return sum(p.numel() for p in params) * itemsize  # a DTensor's numel is the unsharded one

    roots = sum(unit_bytes(p for name, p in chunk.named_parameters() if not name.startswith("layers."))
                for chunk in chunks)
    itemsize = FORWARD_DTYPE.itemsize if fp8_blocks else dtype.itemsize
    blocks = [unit_bytes(block.parameters(), itemsize) for chunk in chunks for block in chunk.layers]
    return roots + (sum(blocks) if zero_stage == 2 else 2 * max(blocks, default=0))
