"""Enumerate the parallel layouts of a model on a GPU budget.

A layout is (dp, tp, pp, micro-batch size, schedule with its virtual stages, recompute), and for a mixture of
experts its expert-parallel and expert-tensor-parallel degrees (folded over a stage's dp * cp * tp ranks;
tensor parallelism then comes with sequence parallelism, as Megatron-Core requires). Pipeline depths that do
not divide the layers get lighter end stages (first/last_stage_layers; DeepSeek-V3's 61 layers as 4 per stage,
1 on the last), interleaved too where Megatron-Core's split allows it (parallel/pipeline_split.py). World sizes
are the budget and its halvings down to one node, so the search can trade time for cost. Tensor parallelism
stays inside a node (its collectives block compute on every layer, so nobody runs it across nodes). Layouts the
model cannot be split into are dropped here with validate_layout's reason. The base's own split (embedding / loss
counted as layers, an explicit pipeline_layout) is for its pp only: the searched layouts use the splits above. The
base's overlaps (overlap_param_gather, moe_a2a_overlap) are kept in the layouts where they apply, off in the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainsim.config.choices import RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.config.validate import a2a_overlap_refusal, validate_layout
from trainsim.errors import ConfigError
from trainsim.parallel.pipeline_split import lighter_end_stages


@dataclass(frozen=True)
class SearchSpace:
    """What the search may vary; everything else comes from the base parallelism config."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b")
    virtual_stages: tuple[int, ...] = (2,)
    """for interleaved-1f1b"""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    min_world_size: int = 0
    """0: one node"""
    tp_sizes: tuple[int, ...] = field(default=())
    """empty: every divisor of the heads up to the devices per node"""
    cp_sizes: tuple[int, ...] = (1,)
    """context-parallel degrees to try (1: none; e.g. (1, 2, 4, 8) for long sequences)"""
    zero_stages: tuple[int, ...] = ()
    """state sharding to try (0 replicated, 1 distributed optimizer, 2/3 FSDP); empty: the base config's"""
    ep_sizes: tuple[int, ...] = ()
    """expert-parallel degrees to try for a mixture of experts; empty: every divisor of the expert count"""
    etp_sizes: tuple[int, ...] = ()
    """expert-tensor-parallel degrees to try; empty: 1 and the layout's tp (Megatron-Core's default expert TP)"""

    def __post_init__(self):
        for name, values, accepted in (("schedules", self.schedules, SCHEDULES),
                                       ("recompute", self.recompute, RECOMPUTE_MODES)):
            unknown = [v for v in values if v not in accepted]
            if unknown or not values:
                raise ConfigError(f"search space {name}={list(values)}: accepted values are {', '.join(accepted)}")
        unknown = [z for z in self.zero_stages if z not in ZERO_STAGES]
        if unknown:
            raise ConfigError(f"search space zero_stages={list(self.zero_stages)}: accepted values are "
                              f"{', '.join(map(str, ZERO_STAGES))}")
        bad = [b for b in (*self.micro_batch_sizes, *self.virtual_stages, *self.tp_sizes, *self.cp_sizes,
                           *self.ep_sizes, *self.etp_sizes) if b < 1]
        if bad or not self.micro_batch_sizes or not self.cp_sizes:
            raise ConfigError(f"search space: micro-batch sizes, virtual stages, tp, cp, ep and etp sizes must be "
                              f">= 1, got {bad}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def world_sizes(budget: int, hw: HardwareConfig, space: SearchSpace) -> list[int]:
    smallest = space.min_world_size or min(hw.devices_per_node, budget)
    sizes, size = [], budget
    while size >= smallest and size >= 1:
        sizes.append(size)
        if size % 2:
            break
        size //= 2
    return sizes


def enumerate_layouts(model: ModelConfig, base: ParallelismConfig, hw: HardwareConfig, budget: int,
                      space: SearchSpace) -> list[ParallelismConfig]:
    """Every valid layout within the budget, in a stable order (world size, tp, cp, pp, ep, etp, mbs, schedule,
    recompute)."""
    if budget < 1:
        raise ConfigError(f"GPU budget {budget} must be positive")
    heads = model.num_attention_heads
    tps = space.tp_sizes or tuple(t for t in _divisors(heads) if t <= hw.devices_per_node)
    eps = (space.ep_sizes or tuple(_divisors(model.num_experts))) if model.num_experts else (1,)
    layouts = []
    # pipeline depths: the even splits of the layers, and the others with lighter end stages (lighter_end_stages)
    splits = {pp: (0, 0) if model.num_layers % pp == 0 else lighter_end_stages(model.num_layers, pp)
              for pp in range(1, model.num_layers + 1)}
    def etps(tp: int) -> tuple[int, ...]:
        if not model.num_experts:
            return (1,)
        return space.etp_sizes or tuple(sorted({1, tp}))

    grid = [(world, tp, cp, pp, ep, etp) for world in world_sizes(budget, hw, space) for tp in tps
            for cp in space.cp_sizes for pp, split in splits.items() for ep in eps for etp in etps(tp)
            if split is not None and world % (tp * cp * pp) == 0 and (world // pp) % (ep * etp) == 0]
    sharding = [(z, f"-zero{z}" if space.zero_stages else "") for z in space.zero_stages or (base.zero_stage,)]
    for world, tp, cp, pp, ep, etp in grid:
        dp = world // (tp * cp * pp)
        context = (f"-cp{cp}" if cp > 1 else "") + (f"-ep{ep}" if ep > 1 else "") + (f"-etp{etp}" if etp > 1 else "")
        first, last = splits[pp]
        stages = f"pp{pp}" + (f"-first{first}" if first else "") + (f"-last{last}" if last else "")
        sequence_parallel = base.sequence_parallel or (model.num_experts > 0 and tp > 1)
        for mbs in space.micro_batch_sizes:
            for schedule in space.schedules:
                for v in (space.virtual_stages if schedule == "interleaved-1f1b" else (1,)):
                    for recompute in space.recompute:
                        for zero, zero_name in sharding:
                            par = dataclasses.replace(
                                base, name=f"dp{dp}-tp{tp}{context}-{stages}-mbs{mbs}-{schedule}-v{v}-{recompute}"
                                           f"{zero_name}",
                                dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
                                micro_batch_size=mbs, schedule=schedule,
                                virtual_stages=v, recompute=recompute, zero_stage=zero,
                                first_stage_layers=first, last_stage_layers=last, pipeline_layout="",
                                account_for_embedding_in_pipeline_split=False,
                                account_for_loss_in_pipeline_split=False,
                                overlap_param_gather=base.overlap_param_gather and zero == 1,
                                # HSDP's shard group where it still divides the replicas (else all of them)
                                dp_shard_size=base.dp_shard_size if zero and base.dp_shard_size
                                and (dp * cp) % base.dp_shard_size == 0 else 0,
                                fp8_param_gather=base.fp8_param_gather and zero >= 2)
                            if par.moe_a2a_overlap and a2a_overlap_refusal(par):  # where it applies only
                                par = dataclasses.replace(par, moe_a2a_overlap=False)
                            try:
                                validate_layout(model, par)
                            except ConfigError:
                                continue
                            layouts.append(par)
    return layouts
