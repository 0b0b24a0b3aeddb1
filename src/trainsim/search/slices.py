"""Per-layer costs of a model from two small traces, so a layout search never traces the whole model.

Every transformer layer of a layout is the same graph, and a stage is its layers plus the embedding
(first stage) or the head and loss (last stage). So for one (tp, micro-batch size, recompute,
precision) we trace two 2-stage slices of the model, with 1 and 2 layers per stage, profile their ops
through the hardware's profile database (nothing is timed twice), and take differences:

    layer = stage0(2 layers) - stage0(1 layer)
    first = stage0(1 layer) - layer          (embedding and what only the first stage does)
    last  = stage1(1 layer) - layer          (final norm, head, loss)

Each part keeps its forward, backward and optimizer compute seconds, its tensor-parallel collectives per
micro-batch (priced later by the communication model, since their cost depends on the hardware only),
and its memory (parameters, gradients, optimizer states, activations saved per micro-batch).

A mixture of experts' layer is traced with the layout's expert and expert tensor parallelism (the slice gets the
fewest data-parallel ranks that fold into etp x ep groups), so its token exchanges and grouped GEMMs have the
layout's sizes; its expert weights are counted apart, since their gradients and optimizer states are split over the
expert replicas, not the model's. The dense layers a model starts with (model.moe_first_dense_layers), and those
between its MoE layers (model.moe_layer_freq), are a part of their own, from two more slices of the model without
experts.

Skewed routing (model.moe_routing 'zipf:<s>' or 'dirichlet:<alpha>'): every all-to-all of a layer waits for the
expert-parallel rank whose experts received the most tokens, so each layer takes that rank's time. The parts
above come from balanced slices; a 1-layer slice traced with the skewed routing (a rank class per ep rank) gives
the busiest rank's stage 0, and what it adds to the balanced stage 0 (expert GEMMs on more rows, larger saved
activations) is added to every layer, its all-to-alls replacing the balanced ones. Each layer draws its own
shares, so this takes the traced layer as typical of them all (exact for Zipf with one expert per rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from trainsim.config.choices import PRECISION_WEIGHT_BYTES
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.profile.database import ProfileDatabase
from trainsim.profile.stage import distinct_ops, profile_ops
from trainsim.what_if import scaled_compute_times

PART_NAMES = ("layer", "first", "last", "dense_layer")
MEMORY_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes",
                 "expert_parameter_bytes")
SECONDS_FIELDS = ("forward_s", "backward_s", "optimizer_s", "forward_attention_s", "backward_attention_s")
COUNT_FIELDS = ("forward_collectives", "backward_collectives", "forward_cp", "backward_cp", "forward_experts",
                "backward_experts", "host_ops")
"""PartCost's fields of seconds and of counts ('label' -> count), beside MEMORY_FIELDS (bytes)."""


@dataclass
class PartCost:
    """Costs of one part of a stage, per micro-batch unless named otherwise."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    """once per step"""
    forward_collectives: dict[str, int] = field(default_factory=dict)
    """'collective:message_bytes' -> count, tensor-parallel collectives in the forward pass"""
    backward_collectives: dict[str, int] = field(default_factory=dict)
    forward_cp: dict[str, int] = field(default_factory=dict)
    """'collective:message_bytes' -> count, context-parallel communication in the forward pass (ring sends,
    all-gathers, reduce-scatters)"""
    backward_cp: dict[str, int] = field(default_factory=dict)
    forward_experts: dict[str, int] = field(default_factory=dict)
    """'group_kind:collective:message_bytes' -> count, the MoE layers' token exchanges in the forward pass (kinds
    ep, etp and tep: parallel/layout.py)"""
    backward_experts: dict[str, int] = field(default_factory=dict)
    forward_attention_s: float = 0.0
    """the attention kernels' time, which the context-parallel ring's sends run beside"""
    backward_attention_s: float = 0.0
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    activation_bytes: int = 0
    """saved for the backward pass, per micro-batch"""
    expert_parameter_bytes: int = 0
    """the part of parameter_bytes that is expert weights (their gradients and states go with them)"""
    host_ops: dict[str, int] = field(default_factory=dict)
    """phase -> ops the host dispatches (kernels, no-kernel ops, collectives), for hardware.host_dispatch_s"""

    def minus(self, other: PartCost) -> PartCost:
        """Difference of two parts; collective counts below zero are dropped (never negative work)."""
        return PartCost(**{f: max(getattr(self, f) - getattr(other, f), 0.0) for f in SECONDS_FIELDS},
                        **{f: max(getattr(self, f) - getattr(other, f), 0) for f in MEMORY_FIELDS},
                        **{f: dict(Counter(getattr(self, f)) - Counter(getattr(other, f))) for f in COUNT_FIELDS})

    def plus(self, other: PartCost) -> PartCost:
        """Sum of two parts (collective counts added)."""
        return PartCost(**{f: getattr(self, f) + getattr(other, f) for f in SECONDS_FIELDS + MEMORY_FIELDS},
                        **{f: dict(Counter(getattr(self, f)) + Counter(getattr(other, f))) for f in COUNT_FIELDS})


@dataclass
class SliceCosts:
    """What the layout estimator needs for one (tp, micro_batch_size, recompute, precision)."""

    layer: PartCost
    first: PartCost
    last: PartCost
    p2p_message_bytes: int
    """activation tensor sent between pipeline stages per micro-batch"""
    first_transient_bytes: list[int]
    """what a stage's step holds beyond one micro-batch's saved activations at its worst moment
    (trace/memory.py), for a stage without the output layer of 1 and of 2 or more layers (with one layer the
    saved activations are small beside the step's other temporaries: the figure shrinks with depth, and the
    2-layer slice stands for deeper stages; 11-layer MoE stage: 112 MB from 1 layer, 65 from 2, 61 in full)"""
    last_transient_bytes: list[int]
    """the same for the stage with the output layer and the loss (their logits-sized temporaries)"""
    dense_layer: PartCost = field(default_factory=PartCost)
    """a dense layer of a mixture of experts (model.moe_first_dense_layers, moe_layer_freq); empty for other
    models"""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def format_digest() -> str:
        """Hash of this module: slice files written by other code (other fields, other parts) are not read."""
        return hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> SliceCosts:
        data = json.loads(text)
        return cls(**{k: PartCost(**data[k]) for k in PART_NAMES}, p2p_message_bytes=data["p2p_message_bytes"],
                   first_transient_bytes=data["first_transient_bytes"],
                   last_transient_bytes=data["last_transient_bytes"])


def slice_key(par: ParallelismConfig) -> str:
    """The parallelism fields a slice depends on (dp, pp, schedule, batch and the optimizer's sharding do not
    change a layer: slices are traced with the fewest replicas and estimate.py shards the optimizer)."""
    sp = "-sp" + ("-overlap" if par.tp_comm_overlap else "") if par.sequence_parallel and par.tp > 1 else ""
    precision = f"fp8-{par.fp8_recipe}" if par.precision == "fp8" else par.precision
    context = f"-cp{par.cp}-{par.cp_comm_type}" if par.cp > 1 else ""
    experts = f"-ep{par.ep}-etp{par.etp}-{par.moe_token_dispatcher}" if par.ep * par.etp > 1 else ""
    experts += "" if par.moe_grouped_gemm else "-sequential-experts"
    return f"tp{par.tp}{sp}{context}{experts}-mbs{par.micro_batch_size}-{par.recompute}-{precision}"


def _comm_counts(events: pd.DataFrame, phase: str, with_kind: bool = False) -> dict[str, int]:
    """'collective:message_bytes' ('group_kind:collective:message_bytes' `with_kind`) -> count of `events` in
    `phase`."""
    events = events[events["phase"] == phase]
    labels = events["collective"] + ":" + events["message_bytes"].astype(str)
    return dict(Counter(events["group_kind"] + ":" + labels if with_kind else labels))


def _stage_cost(graph: pd.DataFrame, times: dict[str, float], memory: pd.Series,
                expert_parameter_bytes: int = 0) -> PartCost:
    compute = graph[(graph["kind"] == "compute") & ~graph["no_kernel"]]
    seconds = compute["signature"].map(times).groupby(compute["phase"]).sum()
    attention = compute[compute["op"].str.contains("scaled_dot_product")]
    attention_s = attention["signature"].map(times).groupby(attention["phase"]).sum()
    per_microbatch = graph[graph["per_microbatch"]]
    tp = per_microbatch[(per_microbatch["kind"] == "collective") & (per_microbatch["group_kind"] == "tp")]
    cp = per_microbatch[(per_microbatch["group_kind"] == "cp") & (per_microbatch["collective"] != "recv")]
    ep = per_microbatch[(per_microbatch["kind"] == "collective")
                        & per_microbatch["group_kind"].isin(("ep", "etp", "tep"))]
    return PartCost(
        forward_s=float(seconds.get("forward", 0.0)), backward_s=float(seconds.get("backward", 0.0)),
        optimizer_s=float(seconds.get("optimizer", 0.0)),
        forward_collectives=_comm_counts(tp, "forward"), backward_collectives=_comm_counts(tp, "backward"),
        forward_cp=_comm_counts(cp, "forward"), backward_cp=_comm_counts(cp, "backward"),
        forward_experts=_comm_counts(ep, "forward", True), backward_experts=_comm_counts(ep, "backward", True),
        forward_attention_s=float(attention_s.get("forward", 0.0)),
        backward_attention_s=float(attention_s.get("backward", 0.0)),
        parameter_bytes=int(memory["parameter_bytes"]), gradient_bytes=int(memory["gradient_bytes"]),
        optimizer_state_bytes=int(memory["optimizer_state_bytes"]),
        activation_bytes=int(memory["activation_bytes_per_microbatch"]),
        expert_parameter_bytes=expert_parameter_bytes,
        host_ops={str(k): int(v) for k, v in graph.groupby("phase").size().items()})


def _trace_slice(model: ModelConfig, par: ParallelismConfig, layers_per_stage: int):
    """A 2-stage slice of the model with `layers_per_stage` layers per stage, on the fewest data-parallel ranks
    the layout's expert groups fold into (one without experts); split evenly, whatever the layout's own split (the
    search's estimate places the layers by it, search/estimate.py)."""
    from trainsim.trace.tracer import trace_layout  # torch: only when a slice is actually traced

    sliced_model = dataclasses.replace(model, num_layers=2 * layers_per_stage)
    dp = par.ep * par.etp // math.gcd(par.ep * par.etp, par.tp * par.cp)
    sliced_par = dataclasses.replace(par, dp=dp, pp=2, virtual_stages=1, schedule="1f1b",
                                     global_batch_size=par.micro_batch_size * dp, zero_stage=0,
                                     overlap_param_gather=False, first_stage_layers=0, last_stage_layers=0,
                                     account_for_embedding_in_pipeline_split=False,
                                     account_for_loss_in_pipeline_split=False, pipeline_layout="")
    result = trace_layout(sliced_model, sliced_par)
    stages = result.rank_classes.to_pandas().groupby("rank_class")["pp_rank"].first()
    return result.graph.to_pandas(), result.memory.to_pandas().set_index("rank_class"), stages


def _layer_parts(model: ModelConfig, par: ParallelismConfig, times_of) -> tuple[PartCost, PartCost, PartCost, int,
                                                                            list[int], list[int]]:
    """(layer, first, last, p2p bytes, first and last transient bytes by depth) of `model` from its two slices;
    `times_of(ops)` profiles the ops of both slices."""
    from trainsim.workloads.moe import expert_parameters

    one, one_memory, _ = _trace_slice(model, par, 1)
    two, two_memory, _ = _trace_slice(model, par, 2)
    times = times_of(distinct_ops(pd.concat([one, two], ignore_index=True)))
    weight_bytes = PRECISION_WEIGHT_BYTES[par.precision]
    per_layer = expert_parameters(model, par.ep, par.etp) * weight_bytes if model.num_experts else 0

    def stage(graph, memory, cls, layers):
        return _stage_cost(graph[graph["rank_class"] == cls], times, memory.loc[cls], layers * per_layer)

    first_one, last_one, first_two = stage(one, one_memory, 0, 1), stage(one, one_memory, 1, 1), \
        stage(two, two_memory, 0, 2)
    layer = first_two.minus(first_one)
    sends = one[(one["group_kind"] == "pp") & (one["collective"] == "send")]["message_bytes"]
    transient = [[int(one_memory.loc[c, "transient_bytes"]), int(two_memory.loc[c, "transient_bytes"])]
                 for c in (0, 1)]
    return (layer, first_one.minus(layer), last_one.minus(layer), int(sends.max()) if len(sends) else 0,
            *transient)


def _with_busiest_rank(layer: PartCost, first: PartCost, model: ModelConfig, par: ParallelismConfig,
                       times_of) -> PartCost:
    """`layer` (balanced routing) as the busiest expert-parallel rank runs it under model.moe_routing (module doc);
    `first` + `layer` is the balanced 1-layer slice's stage 0."""
    skewed, skewed_memory, stages = _trace_slice(model, par, 1)
    times = times_of(distinct_ops(skewed))
    first_stage = [c for c, pp_rank in stages.items() if pp_rank == 0]
    costs = [_stage_cost(skewed[skewed["rank_class"] == c], times, skewed_memory.loc[c]) for c in first_stage]
    busiest = max(costs, key=lambda part: part.forward_s + part.backward_s)
    return dataclasses.replace(layer.plus(busiest.minus(layer.plus(first))), forward_experts=busiest.forward_experts,
                               backward_experts=busiest.backward_experts)


def measure_slice_costs(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, hardware_key: str,
                        database: Path) -> SliceCosts:
    """Trace the slices, profile their ops into `database`, and split them into parts."""
    def times_of(ops: pd.DataFrame) -> dict[str, float]:
        rows, _ = profile_ops(ops, hw, hardware_key, ProfileDatabase(database))
        return scaled_compute_times(dict(zip(rows["signature"], rows["median_s"].astype(float))), ops, hw)

    moe_only = dataclasses.replace(model, moe_first_dense_layers=0, moe_layer_freq=1)
    balanced = dataclasses.replace(moe_only, moe_routing="balanced")
    layer, first, last, p2p_bytes, first_transient, last_transient = _layer_parts(balanced, par, times_of)
    if model.num_experts and model.moe_routing != "balanced":
        layer = _with_busiest_rank(layer, first, moe_only, par, times_of)
    dense_layer = PartCost()
    if model.num_experts and not all(model.has_experts(layer) for layer in range(model.num_layers)):
        dense = dataclasses.replace(model, num_experts=0, moe_first_dense_layers=0, moe_layer_freq=1)
        dense_layer = _layer_parts(dense, dataclasses.replace(par, ep=1, etp=1), times_of)[0]
    return SliceCosts(layer=layer, first=first, last=last, p2p_message_bytes=p2p_bytes,
                      first_transient_bytes=first_transient, last_transient_bytes=last_transient,
                      dense_layer=dense_layer)
