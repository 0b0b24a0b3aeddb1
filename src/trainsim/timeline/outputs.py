"""What the composer reports: per-class breakdown, critical path, memory verdict, summary JSON.

Breakdown of the step time T for each rank class (the parts add up to T exactly):
  compute_s          solo time of the class's kernels on the compute stream (straggler factor included)
  slowdown_added_s   extra time of those kernels from overlapping communication (Echo's t - t0)
  exposed_comm_s     per group kind (tp, dp, pp, ...): time the compute stream is idle, or blocked inside
                     a collapsed run, while that kind of communication runs (split evenly where kinds overlap)
  exposed_host_copy_s compute idle with no communication running while activations are copied between host
                     and device memory (parallelism.cpu_offload_layers)
  pipeline_bubble_s  compute idle with no communication running, until the pipeline flushes (the last
                     backward of any class ends); waiting for a neighbour stage, a straggler, or the host
                     to issue kernels (hardware.host_dispatch_s)
  idle_s             compute idle with no communication running after the flush (optimizer waits, end of step)
Parts of the above, shown on their own lines because users ask for them:
  optimizer_step_s   from the class's last backward kernel to its end: the last gradient buckets'
                     reduction, the gradient-norm all-reduce over the model-parallel group, clipping,
                     the Adam update and the parameter copies (Megatron's optimizer.step())
Not a part of the sum either (it is communication time, hidden behind compute or exposed):
  contention_added_s extra time of the class's inter-node transfers from sharing the rank's NIC with its
                     other concurrent inter-node transfers (timeline/contention.py); summed over the
                     class's communication nodes as slowdown_added_s is over its kernels, so transfers
                     that overlap each other each count their own extra
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainsim.parallel.layout import EXPERT_GROUP_KINDS, GROUP_KINDS
from trainsim.timeline.compose import StepTimeline
from trainsim.timeline.engine import HOST
from trainsim.timeline.overlap import covered, is_comm_kind, merged
from trainsim.timeline.program import BLOCK, COMPUTE, KIND_NAMES, MEMCPY

COMM_KINDS = (*GROUP_KINDS, *EXPERT_GROUP_KINDS, "world", "other")
"""Group kinds communication time is reported under (the trace's group_kind values)."""
SUMMARY_FIELDS = {
    "step_time_s": "predicted wall time of one training step (seconds)",
    "world_size": "ranks (devices) in the layout",
    "num_microbatches": "micro-batches per step per pipeline",
    "schedule": "pipeline schedule used",
    "num_rank_classes": "classes simulated (ranks with identical timelines share one)",
    "num_ops": "kernels the step runs over all classes and micro-batches (per class, not per rank)",
    "num_nodes": "timeline nodes replayed (serial runs of kernels are one node)",
    "slowdown_iterations": "replays until overlap slowdown and NIC contention reproduced their own durations",
    "slowdown_converged": "false when the iteration limit was reached first",
    "models": "communication model, slowdown model, schedule, dependency rules and NIC contention used",
    "compute_backends": "how the kernel times were obtained (profile backends and their op counts)",
    "inputs": "what the prediction was made from: calibration (files, held-out error), kernels (backends, "
              "what the kernel model was fitted on), slowdown model (training data, CV error), and warnings "
              "where a fallback stood in (timeline/provenance.py)",
    "pipeline_flush_s": "time the last backward pass of any class ends",
    "classes": "per rank class: ranks, stage, straggler factor, breakdown (see below), memory verdict",
    "critical_path": "chain of nodes that decides the step time: time by category and by class, segments",
    "oom": "true when any class needs more memory than hardware.memory_capacity_bytes",
    "simulate_s": "wall time of the composition (seconds)",
}
CLASS_FIELDS = {
    "rank_class": "timeline class id", "trace_class": "rank class of the trace whose graph it runs",
    "ranks": "number of ranks in the class", "representative_rank": "lowest rank of the class",
    "pp_rank": "pipeline stage", "compute_factor": "straggler multiplier on compute time (1 = normal)",
    "end_s": "when the class's last node ends",
    "compute_s": "solo kernel time on the compute stream",
    "slowdown_added_s": "extra kernel time from overlap with communication",
    "exposed_comm_s": "communication not hidden behind compute, per group kind",
    "exposed_host_copy_s": "idle without communication while activations are copied to or from host memory",
    "pipeline_bubble_s": "idle without communication until the pipeline flush",
    "idle_s": "idle without communication after the flush",
    "optimizer_step_s": "part of the step after the class's last backward kernel: gradient reduction tail, "
                        "norm all-reduce, clipping, optimizer update",
    "contention_added_s": "extra time of the class's inter-node transfers from sharing the rank's NIC with its "
                          "other concurrent inter-node transfers (summed over transfers; hidden or exposed, "
                          "not a part of the step-time sum)",
    "peak_memory_bytes": "peak device memory of the class (trace stage estimate)",
    "memory_capacity_bytes": "device memory of the hardware",
    "oom": "peak_memory_bytes > memory_capacity_bytes",
}


def _node_kind(t: StepTimeline) -> np.ndarray:
    return t.graph.table.kind[t.graph.tnode]


def pipeline_flush_s(t: StepTimeline) -> float:
    phase = t.graph.table.phase[t.graph.tnode]
    mask = (phase == "forward") | (phase == "backward")
    return float(t.replay.end_s[mask].max()) if mask.any() else 0.0


def breakdown(t: StepTimeline) -> pd.DataFrame:
    """One row per class: the parts of the step time (module docstring)."""
    kind_all, cls = _node_kind(t), t.graph.cls
    start_all, step = t.replay.start_s, t.step_time_s
    end_all = np.minimum(t.replay.end_s, start_all + t.duration_s)  # a run waiting for its last issue is idle
    flush = pipeline_flush_s(t)
    group_kind_all = np.asarray(t.info.group_kind, dtype=object)[t.graph.tnode]
    backward_all = t.graph.table.phase[t.graph.tnode] == "backward"
    order = np.argsort(cls, kind="stable")  # each class's nodes once: the cost grows with nodes, not classes x nodes
    bounds = np.searchsorted(cls[order], np.arange(t.classes.count + 1))
    rows = []
    for c in range(t.classes.count):
        mine = order[bounds[c]:bounds[c + 1]]
        kind, group_kind, start, end = kind_all[mine], group_kind_all[mine], start_all[mine], end_all[mine]
        fixed, replay_end = t.fixed_s[mine], t.replay.end_s[mine]
        busy = (kind == COMPUTE) | (kind == BLOCK)
        comm = is_comm_kind(kind)
        b0, b1 = merged(start[busy], end[busy])
        busy_len = float((b1 - b0).sum())
        exposed = {k: float(fixed[busy & (group_kind == k)].sum()) for k in COMM_KINDS}
        uncovered: dict[str, float] = {}
        for k in COMM_KINDS:
            q = comm & (group_kind == k)
            a, b = merged(start[q], end[q])
            uncovered[k] = float((b - a).sum() - (covered(b0, b1, b) - covered(b0, b1, a)).sum())
        a, b = merged(start[comm], end[comm])
        total_exposed = float((b - a).sum() - (covered(b0, b1, b) - covered(b0, b1, a)).sum())
        scale = total_exposed / sum(uncovered.values()) if sum(uncovered.values()) > 0 else 0.0
        for k in COMM_KINDS:
            exposed[k] += uncovered[k] * scale
        u0, u1 = merged(np.concatenate([b0, a]), np.concatenate([b1, b]))
        # host copies (activation offloading) beside neither compute nor communication: the step waited for them
        c0, c1 = merged(start[kind == MEMCPY], end[kind == MEMCPY])
        exposed_copy = float((c1 - c0).sum() - (covered(u0, u1, c1) - covered(u0, u1, c0)).sum())
        u0, u1 = merged(np.concatenate([u0, c0]), np.concatenate([u1, c1]))
        in_flush = float(covered(u0, u1, np.asarray([flush]))[0])
        compute_s = float(t.solo_compute_s[mine][busy].sum())
        backward = busy & backward_all[mine]
        last_backward = float(replay_end[backward].max()) if backward.any() else 0.0
        class_end = float(replay_end.max()) if len(mine) else 0.0
        rows.append({
            "rank_class": c,
            "compute_s": compute_s,
            "slowdown_added_s": max(busy_len - compute_s - float(fixed[busy].sum()), 0.0),
            **{f"exposed_{k}_s": v for k, v in exposed.items()},
            "exposed_host_copy_s": exposed_copy,
            "pipeline_bubble_s": max(flush - in_flush, 0.0),
            "idle_s": max((step - flush) - (float((u1 - u0).sum()) - in_flush), 0.0),
            "optimizer_step_s": max(class_end - last_backward, 0.0) if len(mine) else 0.0,
            "contention_added_s": float(t.contention_s[mine].sum()),
            "end_s": class_end,
        })
    return pd.DataFrame(rows)


def critical_path(t: StepTimeline, max_segments: int = 200) -> dict:
    """Follow 'what decided my start' back from the last node to the first; time by category and class."""
    end, cause = t.replay.end_s, t.replay.cause
    if not len(end):
        return {"duration_s": 0.0, "num_nodes": 0, "by_category": {}, "by_class": {}, "segments": []}
    path = [int(np.argmax(end))]
    while cause[path[-1]] >= 0:
        path.append(int(cause[path[-1]]))
    path.reverse()
    nodes = np.asarray(path)
    ends = end[nodes]
    contribution = np.diff(np.concatenate([[0.0], ends]))
    # host-bound time: waiting for the first node's issue, and nodes ending after their last op's issue
    host_s = ends - t.replay.start_s[nodes] - t.duration_s[nodes]
    host_s = np.where(host_s > 1e-12 * max(float(ends[-1]), 1.0), host_s, 0.0)
    host_s[0] += t.replay.start_s[nodes[0]] if t.replay.cause[nodes[0]] == HOST else 0.0
    contribution = contribution - host_s
    kind = _node_kind(t)[nodes]
    group_kind = np.asarray(t.info.group_kind, dtype=object)[t.graph.tnode[nodes]]
    comm_part = np.where(kind == BLOCK, np.minimum(t.fixed_s[nodes], contribution), 0.0)
    comm_category = np.asarray([f"comm.{g}" for g in group_kind], dtype=object)
    category = np.where((kind == COMPUTE) | (kind == BLOCK), "compute",
                        np.where(kind == MEMCPY, "host_copy", comm_category))
    by_category: dict[str, float] = {"host": float(host_s.sum())} if host_s.sum() > 0 else {}
    for cat, value, inner, g in zip(category, contribution, comm_part, group_kind):
        by_category[cat] = by_category.get(cat, 0.0) + float(value - inner)
        if inner > 0:
            by_category[f"comm.{g}"] = by_category.get(f"comm.{g}", 0.0) + float(inner)
    cls = t.graph.cls[nodes]
    by_class = {int(c): float((contribution + host_s)[cls == c].sum()) for c in np.unique(cls)}
    phase = t.graph.table.phase[t.graph.tnode[nodes]]
    mb = t.graph.microbatch[nodes]
    segments, i = [], 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and cls[j + 1] == cls[i] and phase[j + 1] == phase[i]:
            j += 1
        segments.append({"rank_class": int(cls[i]), "phase": str(phase[i]),
                         "microbatches": [int(mb[i:j + 1].min()), int(mb[i:j + 1].max())],
                         "start_s": float(t.replay.start_s[nodes[i]]), "end_s": float(ends[j]),
                         "nodes": j - i + 1})
        i = j + 1
    return {"duration_s": float(ends[-1]), "num_nodes": len(nodes),
            "by_category": {k: round(v, 9) for k, v in sorted(by_category.items())},
            "by_class": by_class, "segments": segments[:max_segments], "truncated": len(segments) > max_segments}


def memory_verdict(t: StepTimeline, memory: pd.DataFrame | None, capacity_bytes: float) -> pd.DataFrame:
    """Peak bytes per timeline class (from its trace class) and whether it fits the device."""
    peak = np.full(t.classes.count, np.nan)
    if memory is not None and len(memory):
        by_base = memory.set_index("rank_class")["peak_bytes"]
        peak = by_base.reindex(t.classes.base_class).to_numpy(dtype=float)
    return pd.DataFrame({"rank_class": np.arange(t.classes.count), "peak_memory_bytes": peak,
                         "memory_capacity_bytes": float(capacity_bytes),
                         "oom": (peak > capacity_bytes) if capacity_bytes > 0 else np.zeros(len(peak), bool)})


def class_table(t: StepTimeline, memory: pd.DataFrame | None, capacity_bytes: float) -> pd.DataFrame:
    info = pd.DataFrame({"rank_class": np.arange(t.classes.count), "trace_class": t.classes.base_class,
                         "ranks": t.classes.size, "representative_rank": t.classes.representative,
                         "pp_rank": t.pp_rank, "compute_factor": t.classes.compute_factor})
    return info.merge(breakdown(t), on="rank_class").merge(memory_verdict(t, memory, capacity_bytes),
                                                           on="rank_class")


def summary(t: StepTimeline, classes: pd.DataFrame, *, world_size: int, num_microbatches: int,
            compute_backends: dict | None = None, inputs: dict | None = None, extra: dict | None = None) -> dict:
    """The summary JSON (field meanings: SUMMARY_FIELDS, CLASS_FIELDS; docs/timeline.md)."""
    rows = []
    for row in classes.to_dict("records"):
        exposed = {k: row.pop(f"exposed_{k}_s") for k in COMM_KINDS}
        row["exposed_comm_s"] = {k: v for k, v in exposed.items() if v or k in ("tp", "dp", "pp")}
        peak = row["peak_memory_bytes"]
        row["peak_memory_bytes"] = None if peak != peak else int(peak)
        rows.append({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()})
    out = {
        "step_time_s": t.step_time_s, "world_size": world_size, "num_microbatches": num_microbatches,
        "schedule": t.models["schedule"], "num_rank_classes": t.classes.count, "num_ops": t.num_ops,
        "num_nodes": t.graph.num_nodes, "slowdown_iterations": t.iterations,
        "slowdown_converged": t.converged, "models": t.models, "compute_backends": compute_backends or {},
        "inputs": inputs or {},
        "pipeline_flush_s": pipeline_flush_s(t), "classes": rows, "critical_path": critical_path(t),
        "oom": bool(classes["oom"].any()), "simulate_s": t.simulate_s,
    }
    out.update(extra or {})
    out["field_meanings"] = {**SUMMARY_FIELDS, "classes[]": CLASS_FIELDS}
    return out


def node_kind_names(t: StepTimeline) -> np.ndarray:
    return np.asarray(KIND_NAMES, dtype=object)[_node_kind(t)]
