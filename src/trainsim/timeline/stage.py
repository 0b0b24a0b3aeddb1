"""The compose stage: read the upstream artifacts, compose the step, publish the timeline artifact.

Files (artifacts/timelines/{hardware}/{model}/{parallelism}/):
  summary.json        step time, per-class breakdown, critical path, memory verdict, models used, with
                      the meaning of every field inside (`field_meanings`; docs/timeline.md)
  classes.parquet     the per-class table of summary.json (breakdown columns exposed_<kind>_s)
  timeline.parquet    one row per replayed node: class, stream, kind, label, micro-batch, start, end,
                      duration, solo compute time, communication time
  rank_classes.parquet  rank -> timeline class (stragglers split the trace's classes)
  trace.json          Chrome / Perfetto trace: one process per class, one thread per stream

summary.json's `inputs` says what the prediction was made from and warns where a fallback stood in
(timeline/provenance.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from trainsim.artifacts import atomic_artifact, read_manifest, read_table
from trainsim.comm.model import CommModel
from trainsim.comm.placement import job_placement
from trainsim.config.devices import device_type_of
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.slowdown.choice import choose_slowdown
from trainsim.slowdown.features import device_numbers
from trainsim.slowdown.predictor import SlowdownPredictor
from trainsim.timeline.chrome import write_chrome_trace
from trainsim.timeline.compose import StepTimeline, compose_step
from trainsim.timeline.costs import CommCost, NoSlowdown, PredictorSlowdown, SlowdownEstimate
from trainsim.timeline.outputs import class_table, node_kind_names, summary
from trainsim.timeline.provenance import prediction_inputs, run_values
from trainsim.trace.stage import GRAPH_FILE, MEMORY_FILE, RANK_CLASSES_FILE
from trainsim.what_if import scaled_compute_times

PROFILE_FILE = "kernels.parquet"  # trainsim.profile.stage.PROFILE_FILE (not imported: it pulls in torch)
SUMMARY_FILE = "summary.json"
CLASSES_FILE = "classes.parquet"
TIMELINE_FILE = "timeline.parquet"
CHROME_FILE = "trace.json"


def comm_model(hw: HardwareConfig, calibration_dir: Path | None) -> CommCost:
    """The calibrated NCCL model when its artifact is given, else the uncalibrated one (datasheet rates
    and NCCL's constants)."""
    if calibration_dir is not None:
        read_manifest(calibration_dir)
        return CommModel.load(calibration_dir, hw)
    return CommModel.from_hardware(hw)


def slowdown_model(hw: HardwareConfig, model_dir: Path | None) -> SlowdownEstimate:
    """The overlap slowdown a compose on `hw` applies: the learned model of `model_dir` where
    hardware.slowdown.use chooses it (slowdown/choice.py; by default only where it beats no slowdown on
    unseen kernel groups), else none. Every accuracy benchmark composes with what this returns."""
    if not choose_slowdown(hw.slowdown.use, model_dir).apply_model:
        return NoSlowdown()
    return PredictorSlowdown(SlowdownPredictor.load(model_dir), device_numbers(hw))


def load_profile(profile_dir: Path) -> tuple[dict[str, float], dict[str, int]]:
    """signature -> solo seconds, and how many ops each backend timed."""
    rows = read_table(profile_dir, PROFILE_FILE).to_pandas()
    backends = rows["backend"].value_counts().to_dict()
    return dict(zip(rows["signature"], rows["median_s"].astype(float))), {str(k): int(v) for k, v in backends.items()}


def timeline_table(t: StepTimeline) -> pa.Table:
    g = t.graph
    return pa.Table.from_pandas(pd.DataFrame({
        "rank_class": g.cls.astype(np.int32),
        "stream": np.asarray(g.streams, dtype=object)[g.stream],
        "kind": node_kind_names(t),
        "label": np.asarray(t.info.label, dtype=object)[g.tnode],
        "phase": g.table.phase[g.tnode],
        "microbatch": g.microbatch.astype(np.int32),
        "kernels": (g.table.last_op - g.table.first_op + 1)[g.tnode],
        "start_s": t.replay.start_s, "end_s": t.replay.end_s, "duration_s": t.duration_s,
        "solo_compute_s": t.solo_compute_s, "comm_s": t.fixed_s, "contention_s": t.contention_s,
    }), preserve_index=False)


def timeline_config(hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig) -> dict:
    """The config a timeline artifact's manifest records (all a composed step depends on besides its inputs)."""
    return {name: dataclasses.asdict(cfg) for name, cfg in (("hardware", hw), ("model", model), ("parallelism", par))}


def write_timeline_artifact(hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig, keys: dict[str, str],
                            inputs: dict[str, Path], output: Path) -> dict:
    """Compose the step from the upstream artifacts and publish it; returns the summary."""
    trace_dir, profile_dir = inputs["trace"], inputs["profile"]
    graph = read_table(trace_dir, GRAPH_FILE).to_pandas()
    rank_classes = read_table(trace_dir, RANK_CLASSES_FILE).to_pandas()
    memory = read_table(trace_dir, MEMORY_FILE).to_pandas()
    compute, backends = load_profile(profile_dir)
    compute = scaled_compute_times(compute, graph[graph["kind"] == "compute"], hw)
    comm = comm_model(hw, inputs.get("calibration"))
    slowdown = slowdown_model(hw, inputs.get("slowdown_model"))
    used = prediction_inputs(hw, inputs, backends, nodes_used=job_placement(hw, par.world_size).domains,
                             device_type=device_type_of(hw.device_kind, hw.device_name, hw.slowdown.device_type),
                             run_values=run_values(model, par), model=model)
    config = timeline_config(hw, model, par)
    with atomic_artifact(output, stage="compose", config=config, config_keys=keys, inputs=list(inputs.values())) as tmp:
        t = compose_step(graph, rank_classes, par, hw, compute, comm, slowdown)
        classes = class_table(t, memory, hw.memory_capacity_bytes)
        result = summary(t, classes, world_size=par.world_size, num_microbatches=par.num_microbatches,
                         compute_backends=backends, inputs=used,
                         extra={"hardware": keys.get("hardware"), "model": keys.get("model"),
                                "parallelism": keys.get("parallelism")})
        (tmp / SUMMARY_FILE).write_text(json.dumps(result, indent=2) + "\n")
        pq.write_table(pa.Table.from_pandas(classes, preserve_index=False), tmp / CLASSES_FILE)
        pq.write_table(timeline_table(t), tmp / TIMELINE_FILE)
        pq.write_table(pa.table({"rank": np.arange(par.world_size, dtype=np.int32),
                                 "rank_class": t.classes.class_of_rank.astype(np.int32)}), tmp / RANK_CLASSES_FILE)
        write_chrome_trace(t, tmp / CHROME_FILE)
    return result
