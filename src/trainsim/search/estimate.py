"""Step time and peak memory of a layout from per-layer slice costs: the search's fast path.

Per stage and micro-batch, forward = layers x (layer compute + its tensor-parallel collectives, which
block compute as in Megatron-LM) plus the embedding on the first stage and the head on the last; the
same for backward. The pipeline schedule is then played out exactly: every stage runs its actions
(`pipeline_actions`, the schedule the tracer and composer use) in order, a forward waits for the same
micro-batch's forward on the previous virtual stage plus the P2P transfer, a backward for the next
stage's backward. Data-parallel gradients are all-reduced in buckets that become ready during the
stage's last backward and run back to back on the communication stream; the optimizer follows.
With the distributed optimizer (zero_stage 1) the buckets are reduce-scattered, the optimizer updates 1/dp
of the stage and its states take 1/dp of the memory, and the updated weights are all-gathered bucket by
bucket after it (or, with overlap_param_gather, under the next step's forward: not on the step's path).
With FSDP (zero_stage 2, 3) every layer's weights are all-gathered in its forward (and again in its backward
for 3) and its gradients reduce-scattered in fp32 after its backward, every micro-batch, each beside the
neighbouring layer's compute (prefetch): a layer takes the longer of its compute and its communication, and
only the last reduce-scatter is exposed. States are 16 bytes per parameter over the replicas (fp32 weights,
gradients, Adam moments); the gathered bf16 weights of two layers (3: the one running and the prefetched
one) or of the whole stage (2: kept from forward to backward) and one layer's gradients are transient.
Memory: model states plus activations of the forwards in flight, as the trace stage computes them.

Host dispatch (hardware.host_dispatch_s): a pass takes at least its ops times the dispatch time (the
composer lets the host run ahead across passes; here each pass is bounded on its own).

What the full composer adds and this does not: overlap slowdown of compute that runs beside the
gradient all-reduce, op-level dependencies inside a pass, stragglers. benchmarks/sweep_speed.py prints
the agreement of the two on full traces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainsim.comm.model import CommModel
from trainsim.comm.network import domain_size, nodes_spanned
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.search.slices import PartCost, SliceCosts
from trainsim.trace.memory import memory_row
from trainsim.workloads.layout import Layout
from trainsim.workloads.model import DTYPES
from trainsim.workloads.schedules import pipeline_actions


@dataclass
class LayoutEstimate:
    step_time_s: float
    pipeline_s: float
    """end of the last backward on the slowest stage"""
    exposed_dp_s: float
    optimizer_s: float
    tp_comm_s: float
    """tensor-parallel collective time per step on the busiest stage (inside pipeline_s)"""
    peak_memory_bytes: int
    oom: bool


def _collective_seconds(counts: dict[str, int], comm: CommModel, tp: int, tp_nodes: int, compute_s: float) -> float:
    """A pass's tensor-parallel collectives, each after an equal share of its compute (the system noise
    wait of trainsim/comm/noise.py, as the composer adds it)."""
    total, calls = 0.0, sum(counts.values())
    for label, count in counts.items():
        collective, message_bytes = label.split(":")
        total += count * comm.collective_seconds(collective, int(message_bytes), tp, tp_nodes)
    return total + (calls * comm.sync_wait_s(compute_s / calls, tp) if calls else 0.0)


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


def _chunk_parts(pp: int, v: int) -> dict[tuple[int, int], list[str]]:
    """(stage, chunk) -> the end parts it carries: the embedding on virtual stage 0, the head on the last."""
    parts = {(s, c): [] for s in range(pp) for c in range(v)}
    parts[(0, 0)].append("first")
    parts[(pp - 1, v - 1)].append("last")
    return parts


def play_pipeline(forward_s: dict, backward_s: dict, p2p_s: float, pp: int, v: int, schedule: str,
                  num_microbatches: int) -> tuple[list[float], list[float], list[float]]:
    """Per stage: end of its last action, start and duration of its last backward (for the DP overlap).

    forward_s / backward_s: (stage, chunk) -> seconds per micro-batch. Virtual stage of (s, c) is c*pp + s.
    Past a few rounds of micro-batches the schedule is periodic (every further round of pp micro-batches
    shifts the end by the same time), so long pipelines are played for 2 pp and 3 pp micro-batches and
    extrapolated linearly; a test checks this against playing every micro-batch.
    """
    short, long = 2 * pp, 3 * pp
    if schedule == "gpipe" or num_microbatches <= long:  # GPipe's memory of m forwards is not periodic in m
        return _play(forward_s, backward_s, p2p_s, pp, v, schedule, num_microbatches)
    a, b = (_play(forward_s, backward_s, p2p_s, pp, v, schedule, m) for m in (short, long))
    scale = (num_microbatches - long) / (long - short)
    ends = [e_b + (e_b - e_a) * scale for e_a, e_b in zip(a[0], b[0], strict=True)]
    starts = [s_b + (s_b - s_a) * scale for s_a, s_b in zip(a[1], b[1], strict=True)]
    return ends, starts, b[2]


def _play(forward_s: dict, backward_s: dict, p2p_s: float, pp: int, v: int, schedule: str,
          num_microbatches: int) -> tuple[list[float], list[float], list[float]]:
    actions = [pipeline_actions(schedule, pp, s, num_microbatches, v) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    position, clock = [0] * pp, [0.0] * pp
    last_backward = [(0.0, 0.0)] * pp
    last_virtual = pp * v - 1
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(actions[s]):
                a = actions[s][position[s]]
                virtual = a.chunk * pp + s
                if a.kind == "F":
                    dep = ("F", virtual - 1, a.microbatch) if virtual > 0 else None
                    duration = forward_s[(s, a.chunk)]
                else:
                    dep = ("B", virtual + 1, a.microbatch) if virtual < last_virtual else None
                    if dep is None:  # the last virtual stage turns its own forward around
                        dep = ("F", virtual, a.microbatch)
                    duration = backward_s[(s, a.chunk)]
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p_s if dep[1] != virtual else 0.0)
                start = max(clock[s], ready)
                clock[s] = start + duration
                done[(a.kind, virtual, a.microbatch)] = clock[s]
                if a.kind == "B":
                    last_backward[s] = (start, duration)
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks for pp={pp}, v={v}")
    return clock, [b[0] for b in last_backward], [b[1] for b in last_backward]


def _stage_memory(costs: SliceCosts, parts: dict, s: int, v: int, layers_per_chunk: int,
                  par: ParallelismConfig) -> int:
    def total(field: str, chunk: int) -> int:
        extra = sum(getattr(getattr(costs, p), field) for p in parts[(s, chunk)])
        return layers_per_chunk * getattr(costs.layer, field) + extra

    states = {f: sum(total(f, c) for c in range(v)) for f in ("parameter_bytes", "gradient_bytes",
                                                               "optimizer_state_bytes")}
    states["optimizer_state_bytes"] //= optimizer_shards(par)
    gathered = 0
    if par.zero_stage >= 2:  # FSDP: 16 bytes per parameter sharded; gathered weights and gradients transient
        element = DTYPES[par.precision].itemsize
        parameters, replicas = states["parameter_bytes"] // element, par.weight_replicas
        states = {"parameter_bytes": 4 * parameters // replicas, "gradient_bytes": 4 * parameters // replicas,
                  "optimizer_state_bytes": 8 * parameters // replicas}
        layer = costs.layer.parameter_bytes
        weights = 2 * layer if par.zero_stage >= 3 else layers_per_chunk * v * layer
        gathered = weights + costs.layer.gradient_bytes * (1 + 4 // element)
    # the forwards in flight peak within the first 2 pp (+ v pp) actions, so 4 pp micro-batches show the peak
    # of any longer 1F1B pipeline; GPipe keeps all m in flight
    m = par.num_microbatches if par.schedule == "gpipe" else min(par.num_microbatches, 4 * par.pp)
    holds_loss = any("last" in parts[(s, c)] for c in range(v))
    transient = max(costs.first_transient_bytes, costs.last_transient_bytes if holds_loss else 0) + gathered
    row = memory_row(s, **states, saved_bytes_per_chunk={c: total("activation_bytes", c) for c in range(v)},
                     actions=pipeline_actions(par.schedule, par.pp, s, m, v), transient_bytes=transient)
    return int(row["peak_bytes"])


def _fsdp_seconds(part: PartCost, par: ParallelismConfig, comm: CommModel, dp_nodes: int) -> tuple[float, float]:
    """(all-gather of a part's weights in the compute dtype, reduce-scatter of its gradients in fp32)."""
    replicas = par.weight_replicas
    if replicas == 1 or not part.parameter_bytes:
        return 0.0, 0.0
    parameters = part.parameter_bytes // DTYPES[par.precision].itemsize
    return (comm.collective_seconds("all_gather", part.parameter_bytes, replicas, dp_nodes),
            comm.collective_seconds("reduce_scatter", 4 * parameters, replicas, dp_nodes))


def optimizer_shards(par: ParallelismConfig) -> int:
    """Over how many replicas (ranks with the same weights) the optimizer's states and update are split."""
    return par.weight_replicas if par.zero_stage >= 1 else 1


def estimate_layout(costs: SliceCosts, model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig,
                    comm: CommModel, memory_only: bool = False) -> LayoutEstimate:
    """Fast step-time and memory estimate of one layout. Memory comes first: a layout that does not fit
    (or memory_only) is returned without timing (step fields NaN)."""
    pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
    layout = Layout(par.dp, par.tp, par.pp, par.cp)
    layers_per_chunk = model.num_layers // (pp * v)
    parts = _chunk_parts(pp, v)
    peak = max(_stage_memory(costs, parts, s, v, layers_per_chunk, par) for s in range(pp))
    oom = bool(hw.memory_capacity_bytes) and peak > hw.memory_capacity_bytes
    if memory_only or oom:
        return LayoutEstimate(math.nan, math.nan, math.nan, math.nan, math.nan, peak, oom)

    domain = domain_size(hw)  # the collective model's node: an NVLink domain
    tp_nodes = nodes_spanned(layout.group_ranks(0, "tp"), hw)
    cp_nodes = nodes_spanned(layout.group_ranks(0, "cp"), hw)

    def pass_seconds(part: PartCost, phase: str) -> tuple[float, float, float]:
        forward = phase == "F"
        compute = part.forward_s if forward else part.backward_s
        counts = part.forward_collectives if forward else part.backward_collectives
        host = part.host_ops.get("forward" if forward else "backward", 0) * hw.host_dispatch_s
        comm_s = _collective_seconds(counts, comm, par.tp, tp_nodes, compute) if par.tp > 1 else 0.0
        if par.cp > 1:
            comm_s += _context_parallel_seconds(part.forward_cp if forward else part.backward_cp, comm, par.cp,
                                                cp_nodes, part.forward_attention_s if forward else
                                                part.backward_attention_s)
        return compute, comm_s, host

    per_part = {name: {ph: pass_seconds(getattr(costs, name), ph) for ph in "FB"} for name in ("layer", "first",
                                                                                                "last")}
    dp_nodes = nodes_spanned(layout.group_ranks(0, "dp"), hw)  # (FSDP; the buckets below: per stage)
    if par.zero_stage >= 2:  # FSDP: each part's compute beside its weights' gather and gradients' scatter
        for name, by_phase in per_part.items():
            gather_s, scatter_s = _fsdp_seconds(getattr(costs, name), par, comm, dp_nodes)
            for phase, comm_s in (("F", gather_s), ("B", scatter_s + (gather_s if par.zero_stage >= 3 else 0.0))):
                compute, collectives, host = by_phase[phase]
                by_phase[phase] = (max(compute, comm_s - collectives), collectives, host)
    forward, backward, tp_comm = {}, {}, [0.0] * pp
    for (s, c), extra in parts.items():
        for phase, table in (("F", forward), ("B", backward)):
            compute, collectives, host = (layers_per_chunk * x for x in per_part["layer"][phase])
            compute += sum(per_part[p][phase][0] for p in extra)
            collectives += sum(per_part[p][phase][1] for p in extra)
            host += sum(per_part[p][phase][2] for p in extra)
            table[(s, c)] = max(compute + collectives, host)
            tp_comm[s] += collectives * m
    next_stage = layout.rank_of(0, 0, 1) if pp > 1 else 0
    p2p_s = comm.p2p_seconds(costs.p2p_message_bytes, same_node=next_stage // domain == 0) if pp > 1 else 0.0
    ends, backward_start, backward_len = play_pipeline(forward, backward, p2p_s, pp, v, par.schedule, m)

    step = exposed_max = optimizer_max = 0.0
    for s in range(pp):
        stage_parts = [costs.layer] * (layers_per_chunk * v) + [getattr(costs, p) for c in range(v)
                                                                 for p in parts[(s, c)]]
        grads = sum(part.gradient_bytes for part in stage_parts)
        end, gather_s = ends[s], 0.0
        replicas = par.weight_replicas  # the gradient group
        if par.zero_stage >= 2:  # the last part's reduce-scatter has no compute left beside it
            last_part = costs.first if s == 0 else costs.layer
            scatter_s = _fsdp_seconds(last_part, par, comm, dp_nodes)[1]
            exposed_max = max(exposed_max, scatter_s)
            end += scatter_s
        elif replicas > 1 and grads > 0:
            buckets = max(1, math.ceil(grads / par.dp_bucket_size_bytes))
            dp_nodes = nodes_spanned(layout.group_ranks(layout.rank_of(0, 0, s), "dp"), hw)
            reduction = "reduce_scatter" if par.zero_stage >= 1 else "all_reduce"
            bucket_s = comm.collective_seconds(reduction, math.ceil(grads / buckets), replicas, dp_nodes)
            if par.zero_stage >= 1 and not par.overlap_param_gather:
                gather_s = buckets * comm.collective_seconds("all_gather", math.ceil(grads / buckets), replicas,
                                                             dp_nodes)
            clock = backward_start[s]
            for i in range(buckets):  # bucket i is ready after (i+1)/buckets of the last backward
                clock = max(clock, backward_start[s] + backward_len[s] * (i + 1) / buckets) + bucket_s
            exposed_max = max(exposed_max, max(clock - ends[s], 0.0))
            end = max(end, clock)
        optimizer = sum(part.optimizer_s for part in stage_parts) / optimizer_shards(par)
        optimizer_ops = sum(part.host_ops.get("optimizer", 0) for part in stage_parts)
        optimizer = max(optimizer, optimizer_ops * hw.host_dispatch_s) + gather_s
        optimizer_max = max(optimizer_max, optimizer)
        step = max(step, end + optimizer)
    return LayoutEstimate(step_time_s=step, pipeline_s=max(ends), exposed_dp_s=exposed_max,
                          optimizer_s=optimizer_max, tp_comm_s=max(tp_comm), peak_memory_bytes=peak, oom=oom)
