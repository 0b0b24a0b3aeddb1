"""Step time and peak memory of a layout from per-layer slice costs: the search's fast path.

Per stage and micro-batch, forward = layers x (layer compute + its tensor-parallel collectives, which
block compute as in Megatron-LM) plus the embedding on the first stage and the head on the last; the
same for backward. The pipeline schedule is then played out exactly: every stage runs its actions
(`pipeline_actions`, the schedule the tracer and composer use) in order, a forward waits for the same
micro-batch's forward on the previous virtual stage, a backward for the next stage's backward, and then
for the P2P transfer, which starts only when the stage has posted its receive (a stage posts it when it
reaches the action, as Megatron's blocking send/recv pairs do; NCCL moves a large message once both sides
are posted). Data-parallel gradients are all-reduced in buckets that become ready during the
stage's last backward and run back to back on the communication stream; the optimizer follows.
With the distributed optimizer (zero_stage 1) the buckets are reduce-scattered, the optimizer updates 1/dp
of the stage and its states take 1/dp of the memory, and the updated weights are all-gathered bucket by
bucket after it (or, with overlap_param_gather, under the next step's forward: not on the step's path).
With FSDP (zero_stage 2, 3) every layer's weights are all-gathered in its forward (and again in its backward
for 3) and its gradients reduce-scattered (in fp32 with grad_reduce_in_fp32, else in the weights' dtype) after
its backward, every micro-batch, each beside the neighbouring layer's compute (prefetch): a layer takes the
longer of its compute and its communication, and only the last reduce-scatter is exposed. States are 16 bytes
per parameter over the replicas (fp32 weights, gradients, Adam moments); the gathered bf16 weights of two
layers (3: the one running and the prefetched one) or of the whole stage (2: kept from forward to backward) and
one layer's gradients are transient.
Memory: model states plus activations of the forwards in flight, as the trace stage computes them.

Mixtures of experts: a layer also waits for its token dispatch and combine over the expert-parallel group
(Megatron's all-to-all dispatcher, no overlap with the experts' compute; with parallelism.moe_a2a_overlap a
combined pass's all-to-alls hide under its other half's compute, as far as that lasts), and the expert weights'
share of a stage's gradients is reduced over the expert replicas (dp * cp * tp / ep ranks, their own stream),
where the distributed optimizer also shards their states and update. Under skewed routing a layer's costs are
its busiest expert-parallel rank's (slices.py).

Host dispatch (hardware.host_dispatch_s): each stage's host issues its passes' ops back to back, running
ahead of the device (as the composer's host model): a pass cannot end before its last op is issued.

What the full composer adds and this does not: overlap slowdown of compute that runs beside the
gradient all-reduce, op-level dependencies inside a pass, stragglers. benchmarks/sweep_speed.py prints
the agreement of the two on full traces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainsim.comm.model import CommModel
from trainsim.comm.placement import job_placement
from trainsim.config.choices import PRECISION_WEIGHT_BYTES, gradient_reduce_bytes
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.parallel.layout import layout_of
from trainsim.parallel.pipeline_split import split_of
from trainsim.parallel.schedules import passes, pipeline_actions
from trainsim.search.slices import PART_NAMES, PartCost, SliceCosts
from trainsim.trace.memory import memory_row


@dataclass
class LayoutEstimate:
    step_time_s: float
    pipeline_s: float
    """end of the last backward on the slowest stage"""
    exposed_dp_s: float
    optimizer_s: float
    tp_comm_s: float
    """the collectives layers wait for (tensor-, context- and expert-parallel), per step on the busiest stage
    (inside pipeline_s)"""
    peak_memory_bytes: int
    oom: bool


def pass_collective_seconds(counts: dict[str, int], comm: CommModel, size: int, nodes: int, compute_s: float) -> float:
    """A pass's collectives over a group of `size` ranks on `nodes` nodes, each after an equal share of its
    compute (the system noise wait of trainsim/comm/noise.py, as the composer adds it)."""
    total, calls = 0.0, sum(counts.values())
    for label, count in counts.items():
        collective, message_bytes = label.split(":")
        total += count * comm.collective_seconds(collective, int(message_bytes), size, nodes)
    return total + (calls * comm.sync_wait_s(compute_s / calls, size) if calls else 0.0)


def _by_group_kind(counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """'group_kind:collective:message_bytes' -> count, split into {group_kind: {'collective:message_bytes': count}}."""
    split: dict[str, dict[str, int]] = {}
    for label, count in counts.items():
        kind, _, rest = label.partition(":")
        split.setdefault(kind, {})[rest] = count
    return split


def _context_parallel_seconds(counts: dict[str, int], comm: CommModel, cp: int, cp_nodes: int,
                              attention_s: float) -> float:
    """A pass's context-parallel communication left exposed: the ring's sends run beside the attention blocks
    (exposed where they take longer); the all-gather variant waits for its collectives."""
    ring = other = 0.0
    for label, count in counts.items():
        collective, message_bytes = label.split(":")
        if collective == "send":
            ring += count * comm.p2p_seconds(int(message_bytes), same_node=cp_nodes == 1)
        else:
            other += count * comm.collective_seconds(collective, int(message_bytes), cp, cp_nodes)
    return max(ring - attention_s, 0.0) + other


def _chunk_parts(model: ModelConfig, par: ParallelismConfig) -> dict[tuple[int, int], dict[str, int]]:
    """(stage, chunk) -> how many of each part it runs: its layers (a mixture of experts' dense layers apart: its
    first ones, and those between MoE layers with moe_layer_freq > 1), the embedding on virtual stage 0, the head
    on the last."""
    split = split_of(model, par)
    parts = {}
    for s in range(par.pp):
        for c in range(par.virtual_stages):
            layers = split.layers(s, c)
            dense = sum(bool(model.num_experts) and not model.has_experts(layer) for layer in layers)
            parts[(s, c)] = {"layer": len(layers) - dense, "dense_layer": dense}
            if split.holds_embedding(s, c):
                parts[(s, c)]["first"] = 1
            if split.holds_loss(s, c):
                parts[(s, c)]["last"] = 1
    return parts


def play_pipeline(forward_s: dict, backward_s: dict, p2p_s: float, pp: int, v: int, schedule: str,
                  num_microbatches: int, host_s: dict | None = None,
                  exchange_s: dict | None = None) -> tuple[list[float], list[float], list[float]]:
    """Per stage: end of its last action, start and duration of its last backward (for the DP overlap).

    forward_s / backward_s: (stage, chunk) -> seconds per micro-batch. Virtual stage of (s, c) is c*pp + s.
    exchange_s: ("F" or "B", stage, chunk) -> seconds of the pass's expert all-to-alls; given, the schedule is
    played with them overlapped (parallelism.moe_a2a_overlap): a forward and the backward paired with it run as
    one pass whose all-to-alls hide under the other half's compute, as far as it lasts.
    host_s: ("F" or "B", stage, chunk) -> seconds the host takes to issue the pass's ops. Each stage's host
    issues its passes back to back from the start of the step, never waiting for the device (as the composer's
    host_issue): a pass starts no earlier than its issue starts and ends no earlier than its issue ends.
    Past a few rounds of micro-batches the schedule is periodic (every further round of pp micro-batches
    shifts the end by the same time), so long pipelines are played for 2 pp and 3 pp micro-batches and
    extrapolated linearly; a test checks this against playing every micro-batch.
    """
    short, long = 2 * pp, 3 * pp
    if schedule == "gpipe" or num_microbatches <= long:  # GPipe's memory of m forwards is not periodic in m
        return play_schedule(forward_s, backward_s, p2p_s, pp, v, schedule, num_microbatches, host_s, exchange_s)
    a, b = (play_schedule(forward_s, backward_s, p2p_s, pp, v, schedule, m, host_s, exchange_s) for m in (short, long))
    scale = (num_microbatches - long) / (long - short)
    ends = [e_b + (e_b - e_a) * scale for e_a, e_b in zip(a[0], b[0], strict=True)]
    starts = [s_b + (s_b - s_a) * scale for s_a, s_b in zip(a[1], b[1], strict=True)]
    return ends, starts, b[2]


def play_schedule(forward_s: dict, backward_s: dict, p2p_s: float, pp: int, v: int, schedule: str,
                  num_microbatches: int, host_s: dict | None = None,
                  exchange_s: dict | None = None) -> tuple[list[float], list[float], list[float]]:
    """Play one pipeline schedule from per-pass times, without the event engine: each stage's passes in
    schedule order, a pass starting when its stage is free and its input arrived (p2p_s after the sender).
    Returns per stage the end of its last pass, and the start and duration of its last backward."""
    groups = [passes(pipeline_actions(schedule, pp, s, num_microbatches, v, exchange_s is not None))
              for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    position, clock, issued = [0] * pp, [0.0] * pp, [0.0] * pp
    last_backward = [(0.0, 0.0)] * pp
    last_virtual = pp * v - 1

    def dependency(a, virtual: int):
        if a.kind == "F":
            return ("F", virtual - 1, a.microbatch) if virtual > 0 else None
        # (the last virtual stage turns its own forward around)
        return ("B", virtual + 1, a.microbatch) if virtual < last_virtual else ("F", virtual, a.microbatch)

    remaining = sum(len(group) for stage in groups for group in stage)  # actions
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(groups[s]):
                group = groups[s][position[s]]
                deps = [(a, a.chunk * pp + s, dependency(a, a.chunk * pp + s)) for a in group]
                if any(dep is not None and dep not in done for _, _, dep in deps):
                    break
                start = issued[s]
                for _, virtual, dep in deps:
                    if dep is None or dep[1] == virtual:
                        start = max(start, clock[s], done.get(dep, 0.0))
                    else:  # the transfer starts once the sender has sent and this stage posted its receive
                        start = max(start, max(clock[s], done[dep], issued[s]) + p2p_s)
                durations = {a.kind: (forward_s if a.kind == "F" else backward_s)[(s, a.chunk)] for a in group}
                duration = sum(durations.values())
                if len(group) == 2:  # combined: each half's all-to-alls under the other half's compute
                    exchange = {a.kind: exchange_s[(a.kind, s, a.chunk)] for a in group}
                    duration -= sum(min(exchange[k], durations[o] - exchange[o]) for k, o in ("FB", "BF"))
                issued[s] += sum(host_s[(a.kind, s, a.chunk)] for a in group) if host_s else 0.0
                clock[s] = max(start + duration, issued[s])
                for a, virtual, _ in deps:
                    done[(a.kind, virtual, a.microbatch)] = clock[s]
                if group[-1].kind == "B":
                    last_backward[s] = (start, duration)
                position[s] += 1
                remaining -= len(group)
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks for pp={pp}, v={v}")
    return clock, [b[0] for b in last_backward], [b[1] for b in last_backward]


def _stage_memory(costs: SliceCosts, parts: dict, s: int, v: int, par: ParallelismConfig) -> int:
    def total(field: str, chunk: int) -> int:
        return sum(n * getattr(getattr(costs, p), field) for p, n in parts[(s, chunk)].items())

    states = {f: sum(total(f, c) for c in range(v)) for f in ("parameter_bytes", "gradient_bytes",
                                                               "optimizer_state_bytes")}
    expert = _expert_share(sum(total("expert_parameter_bytes", c) for c in range(v)), states["parameter_bytes"])
    states["optimizer_state_bytes"] = int(states["optimizer_state_bytes"] * _optimizer_share(par, expert))
    gathered = 0
    if par.zero_stage >= 2:  # FSDP: 16 bytes per parameter sharded; gathered weights and gradients transient
        # (experts sharded over their replicas, the rest over the model's)
        element = PRECISION_WEIGHT_BYTES[par.precision]
        sharded = states["parameter_bytes"] // element * ((1 - expert) / par.shard_ranks
                                                           + expert / expert_replicas(par))
        states = {"parameter_bytes": int(4 * sharded), "gradient_bytes": int(4 * sharded),
                  "optimizer_state_bytes": int(8 * sharded)}
        layer = costs.layer.parameter_bytes // (element if par.fp8_param_gather else 1)  # held in FP8: 1 byte
        weights = 2 * layer if par.zero_stage >= 3 else sum(parts[(s, c)]["layer"] for c in range(v)) * layer
        # the root unit (embedding; final norm and output layer) stays gathered through its backward
        roots = sum(getattr(costs, p).parameter_bytes for c in range(v) for p in ("first", "last")
                    if p in parts[(s, c)])
        gathered = roots + weights + costs.layer.gradient_bytes * (1 + 4 // element)
    # the forwards in flight peak within the first 2 pp (+ v pp) actions, so 4 pp micro-batches show the peak
    # of any longer 1F1B pipeline; GPipe keeps all m in flight
    m = par.num_microbatches if par.schedule == "gpipe" else min(par.num_microbatches, 4 * par.pp)
    holds_loss = any("last" in parts[(s, c)] for c in range(v))
    depth = min(sum(parts[(s, c)]["layer"] + parts[(s, c)]["dense_layer"] for c in range(v)), 2) - 1
    transient = max(costs.first_transient_bytes[depth], costs.last_transient_bytes[depth] if holds_loss else 0) \
        + gathered
    row = memory_row(s, **states, saved_bytes_per_chunk={c: total("activation_bytes", c) for c in range(v)},
                     actions=pipeline_actions(par.schedule, par.pp, s, m, v, par.moe_a2a_overlap),
                     transient_bytes=transient)
    return int(row["peak_bytes"])


def _fsdp_seconds(part: PartCost, par: ParallelismConfig, comm: CommModel, dp_nodes: int,
                  edp_nodes: int, replicate_nodes: int = 1, fp8_gather: bool = False) -> tuple[float, float]:
    """(all-gather of a part's weights in the compute dtype, reduce-scatter of its gradients in their reduce dtype:
    fp32 with parallelism.grad_reduce_in_fp32, else the weights'): the dense
    weights over their shard group (HSDP: then the scattered shard all-reduced over the replicas), the experts'
    over their replicas. fp8_gather: the dense weights travel in FP8 (a block with parallelism.fp8_param_gather)."""
    gather_s = scatter_s = 0.0
    reduce_bytes = gradient_reduce_bytes(par.precision, par.grad_reduce_in_fp32)
    for dense, parameter_bytes, replicas, nodes in ((True, part.parameter_bytes - part.expert_parameter_bytes,
                                                     par.shard_ranks, dp_nodes),
                                                    (False, part.expert_parameter_bytes, expert_replicas(par),
                                                     edp_nodes)):
        if parameter_bytes <= 0 or (replicas == 1 and not (dense and par.shard_replicas > 1)):
            continue
        parameters = parameter_bytes // PRECISION_WEIGHT_BYTES[par.precision]
        if replicas > 1:
            gathered = parameters if dense and fp8_gather else parameter_bytes
            gather_s += comm.collective_seconds("all_gather", gathered, replicas, nodes)
            scatter_s += comm.collective_seconds("reduce_scatter", reduce_bytes * parameters, replicas, nodes)
        if dense and par.shard_replicas > 1:
            scatter_s += comm.collective_seconds("all_reduce", reduce_bytes * parameters // replicas,
                                                 par.shard_replicas, replicate_nodes)
    return gather_s, scatter_s


def optimizer_shards(par: ParallelismConfig) -> int:
    """Over how many replicas (ranks with the same weights) the optimizer's states and update are split."""
    return par.shard_ranks if par.zero_stage >= 1 else 1


def expert_replicas(par: ParallelismConfig) -> int:
    """Ranks holding the same expert shards (Megatron's expert data-parallel group)."""
    return layout_of(par).expert_replicas


def expert_shards(par: ParallelismConfig) -> int:
    """Over how many ranks the distributed optimizer splits the experts' states and update."""
    return expert_replicas(par) if par.zero_stage >= 1 else 1


def _expert_share(expert_bytes: float, parameter_bytes: float) -> float:
    """Share of a stage's parameters (so of its gradients and optimizer states) that are expert weights."""
    return expert_bytes / parameter_bytes if parameter_bytes else 0.0


def _optimizer_share(par: ParallelismConfig, expert_share: float) -> float:
    """Share of a stage's optimizer states (and of its update) one rank holds: the dense weights' split over
    the model's replicas, the experts' over theirs."""
    return (1 - expert_share) / optimizer_shards(par) + expert_share / expert_shards(par)


def estimate_layout(costs: SliceCosts, model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig,
                    comm: CommModel, memory_only: bool = False) -> LayoutEstimate:
    """Fast step-time and memory estimate of one layout. Memory comes first: a layout that does not fit
    (or memory_only) is returned without timing (step fields NaN)."""
    pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
    layout = layout_of(par)
    parts = _chunk_parts(model, par)
    peak = max(_stage_memory(costs, parts, s, v, par) for s in range(pp))
    oom = bool(hw.memory_capacity_bytes) and peak > hw.memory_capacity_bytes
    if memory_only or oom:
        return LayoutEstimate(math.nan, math.nan, math.nan, math.nan, math.nan, peak, oom)

    placement = job_placement(hw, par.world_size)  # the collective model's node: an NVLink domain
    tp_nodes = placement.domains_spanned(layout.group_ranks(0, "tp"))
    cp_nodes = placement.domains_spanned(layout.group_ranks(0, "cp"))
    expert_groups = {kind: (len(ranks), placement.domains_spanned(ranks))
                     for kind in ("ep", "etp", "tep") for ranks in [layout.group_ranks(0, kind)]}

    def pass_seconds(part: PartCost, phase: str) -> tuple[float, float, float, float]:
        """(compute, collectives waited for, host issue, the expert all-to-alls among those collectives)."""
        forward = phase == "F"
        compute = part.forward_s if forward else part.backward_s
        counts = part.forward_collectives if forward else part.backward_collectives
        host = part.host_ops.get("forward" if forward else "backward", 0) * hw.host_dispatch_s
        comm_s = pass_collective_seconds(counts, comm, par.tp, tp_nodes, compute) if par.tp > 1 else 0.0
        # token dispatch and combine (and the expert-tensor-parallel gathers): the layer waits for them
        by_kind = _by_group_kind(part.forward_experts if forward else part.backward_experts)
        for kind, counts in by_kind.items():
            comm_s += pass_collective_seconds(counts, comm, *expert_groups[kind], compute)
        all_to_alls = {k: n for k, n in by_kind.get("ep", {}).items() if k.startswith("all_to_all")}
        exchange_s = pass_collective_seconds(all_to_alls, comm, *expert_groups["ep"], compute)
        if par.cp > 1:
            comm_s += _context_parallel_seconds(part.forward_cp if forward else part.backward_cp, comm, par.cp,
                                                cp_nodes, part.forward_attention_s if forward else
                                                part.backward_attention_s)
        return compute, comm_s, host, exchange_s

    per_part = {name: {ph: pass_seconds(getattr(costs, name), ph) for ph in "FB"} for name in PART_NAMES}
    dp_nodes = placement.domains_spanned(layout.group_ranks(0, "dp_shard"))  # (FSDP; the buckets below: per stage)
    edp_nodes = placement.domains_spanned(layout.group_ranks(0, "edp"))
    replicate_nodes = placement.domains_spanned(layout.group_ranks(0, "dp_replicate"))
    if par.zero_stage >= 2:  # FSDP: each part's compute beside its weights' gather and gradients' scatter
        for name, by_phase in per_part.items():  # (the blocks gather in FP8 with fp8_param_gather, the root not)
            gather_s, scatter_s = _fsdp_seconds(getattr(costs, name), par, comm, dp_nodes, edp_nodes,
                                                replicate_nodes, par.fp8_param_gather and name == "layer")
            for phase, comm_s in (("F", gather_s), ("B", scatter_s + (gather_s if par.zero_stage >= 3 else 0.0))):
                compute, collectives, host, exchange = by_phase[phase]
                by_phase[phase] = (max(compute, comm_s - collectives), collectives, host, exchange)
    forward, backward, host_s, exchange_s, tp_comm = {}, {}, {}, {}, [0.0] * pp
    for (s, c), counts in parts.items():
        for phase, table in (("F", forward), ("B", backward)):
            compute, collectives, host, exchange = (sum(n * per_part[p][phase][i] for p, n in counts.items())
                                                    for i in range(4))
            table[(s, c)], host_s[(phase, s, c)], exchange_s[(phase, s, c)] = compute + collectives, host, exchange
            tp_comm[s] += collectives * m
    next_stage = layout.rank_of(0, 0, 1) if pp > 1 else 0
    same_domain = placement.domains_spanned([0, next_stage]) == 1
    p2p_s = comm.p2p_seconds(costs.p2p_message_bytes, same_node=same_domain) if pp > 1 else 0.0
    ends, backward_start, backward_len = play_pipeline(forward, backward, p2p_s, pp, v, par.schedule, m, host_s,
                                                       exchange_s if par.moe_a2a_overlap else None)

    step = exposed_max = optimizer_max = 0.0
    for s in range(pp):
        stage_parts = [(getattr(costs, p), n) for c in range(v) for p, n in parts[(s, c)].items()]
        grads = sum(n * part.gradient_bytes for part, n in stage_parts)
        expert = _expert_share(sum(n * part.expert_parameter_bytes for part, n in stage_parts),
                               sum(n * part.parameter_bytes for part, n in stage_parts))
        end, gather_s = ends[s], 0.0
        representative = layout.rank_of(0, 0, s)
        if par.zero_stage >= 2:  # the last part's reduce-scatter has no compute left beside it
            last_part = costs.first if s == 0 else costs.layer
            scatter_s = _fsdp_seconds(last_part, par, comm, dp_nodes, edp_nodes, replicate_nodes)[1]
            exposed_max = max(exposed_max, scatter_s)
            end += scatter_s
        # dense gradients over the model's replicas, expert gradients over the experts' (own stream each)
        for group_bytes, replicas, kind in ((grads * (1 - expert), par.shard_ranks if par.zero_stage else
                                             par.weight_replicas, "dp_shard"),
                                            (grads * expert, expert_replicas(par), "edp")):
            instances = par.shard_replicas if kind == "dp_shard" and par.zero_stage == 1 else 1
            if par.zero_stage >= 2 or replicas * instances == 1 or group_bytes <= 0:
                continue
            buckets = max(1, math.ceil(group_bytes / par.dp_bucket_size_bytes))
            bucket_bytes = math.ceil(group_bytes / buckets)
            group_nodes = placement.domains_spanned(layout.group_ranks(representative, kind))
            reduction = "reduce_scatter" if par.zero_stage >= 1 else "all_reduce"
            bucket_s = comm.collective_seconds(reduction, bucket_bytes, replicas, group_nodes) if replicas > 1 else 0.0
            if instances > 1:  # distributed-optimizer instances: the reduce-scattered slice across them
                bucket_s += comm.collective_seconds("all_reduce", bucket_bytes // replicas, instances,
                                                    placement.domains_spanned(
                                                        layout.group_ranks(representative, "dp_replicate")))
            if par.zero_stage >= 1 and not par.overlap_param_gather:
                gather_s += buckets * comm.collective_seconds("all_gather", bucket_bytes, replicas, group_nodes)
            clock = backward_start[s]
            for i in range(buckets):  # bucket i is ready after (i+1)/buckets of the last backward
                clock = max(clock, backward_start[s] + backward_len[s] * (i + 1) / buckets) + bucket_s
            exposed_max = max(exposed_max, max(clock - ends[s], 0.0))
            end = max(end, clock)
        optimizer = sum(n * part.optimizer_s for part, n in stage_parts) * _optimizer_share(par, expert)
        optimizer_ops = sum(n * part.host_ops.get("optimizer", 0) for part, n in stage_parts)
        optimizer = max(optimizer, optimizer_ops * hw.host_dispatch_s) + gather_s
        optimizer_max = max(optimizer_max, optimizer)
        step = max(step, end + optimizer)
    return LayoutEstimate(step_time_s=step, pipeline_s=max(ends), exposed_dp_s=exposed_max,
                          optimizer_s=optimizer_max, tp_comm_s=max(tp_comm), peak_memory_bytes=peak, oom=oom)
