"""The step as a Chrome trace (JSON Trace Event Format), for ui.perfetto.dev or chrome://tracing.

One process per rank class (named with its stage, rank count and straggler factor), one thread per
stream of that class (compute, comm.tp, comm.dp, comm.pp.send, comm.pp.recv, memcpy). Each timeline
node is a complete event ('X', microseconds); a collapsed run is one event named after its pass with
its kernel count in args. The args also give the slowdown added and, on a transfer that shared its
rank's NIC, the contention added.
Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainsim.timeline.compose import StepTimeline
from trainsim.timeline.outputs import node_kind_names


def chrome_trace(t: StepTimeline, max_events: int = 2_000_000) -> dict:
    g = t.graph
    events: list[dict] = []
    for c in range(t.classes.count):
        factor = float(t.classes.compute_factor[c])
        name = (f"class {c}: stage {int(t.pp_rank[c])}, {int(t.classes.size[c])} rank(s) from "
                f"{int(t.classes.representative[c])}" + (f", compute x{factor:g}" if factor != 1 else ""))
        events.append({"ph": "M", "name": "process_name", "pid": c, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": c, "tid": 0, "args": {"sort_index": c}})
        for s in np.unique(g.stream[g.cls == c]).tolist():
            events.append({"ph": "M", "name": "thread_name", "pid": c, "tid": s, "args": {"name": g.streams[s]}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": c, "tid": s, "args": {"sort_index": s}})
    order = np.argsort(t.replay.start_s, kind="stable")[:max_events]
    labels = np.asarray(t.info.label, dtype=object)[g.tnode[order]]
    kinds = node_kind_names(t)[order]
    ops = (g.table.last_op - g.table.first_op + 1)[g.tnode[order]]
    start_us = (t.replay.start_s[order] * 1e6).tolist()
    dur_us = (t.duration_s[order] * 1e6).tolist()
    added = (t.duration_s - t.fixed_s - t.solo_compute_s - t.contention_s)[order].tolist()
    contention = t.contention_s[order].tolist()
    for i, n in enumerate(order.tolist()):
        events.append({"name": labels[i], "cat": kinds[i], "ph": "X", "ts": start_us[i], "dur": dur_us[i],
                       "pid": int(g.cls[n]), "tid": int(g.stream[n]),
                       "args": {"microbatch": int(g.microbatch[n]), "kernels": int(ops[i]),
                                "slowdown_added_us": added[i] * 1e6,
                                **({"contention_added_us": contention[i] * 1e6} if contention[i] else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": t.step_time_s, "truncated": len(order) < g.num_nodes}}


def write_chrome_trace(t: StepTimeline, path: Path, max_events: int = 2_000_000) -> None:
    Path(path).write_text(json.dumps(chrome_trace(t, max_events), separators=(",", ":")))
