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

from trainsim.artifacts import atomic_artifact, is_current, read_manifest, read_table
from trainsim.comm.model import CommModel
from trainsim.comm.network import domain_size
from trainsim.config.devices import device_type_of
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.slowdown.features import device_numbers
from trainsim.slowdown.predictor import SlowdownPredictor
from trainsim.timeline.chrome import write_chrome_trace
from trainsim.timeline.compose import StepTimeline, compose_step
from trainsim.timeline.costs import CommCost, NoSlowdown, PredictorSlowdown, SlowdownEstimate
from trainsim.timeline.outputs import class_table, node_kind_names, summary
from trainsim.timeline.plugins import replaced_builtins
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
    """The learned slowdown model when its artifact is given, else no slowdown."""
    if model_dir is None:
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
    used = prediction_inputs(hw, inputs, backends, nodes_used=-(-par.world_size // domain_size(hw)),
                             device_type=device_type_of(hw.device_kind, hw.device_name, hw.slowdown.device_type),
                             run_values=run_values(model, par))
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


def compose_run_artifacts(run, output: Path | None = None, build_missing: bool = True) -> tuple[dict, Path]:
    """What `trainsim compose` does: compose a run from the artifacts at the registry's paths, first
    writing those that are missing (cached there for the next run), so that the default is the whole
    pipeline's prediction. With `build_missing=False` only the trace and kernel profile are built; a
    missing calibration or slowdown model is then left out, and summary.json's `inputs` warns of it.
    Returns the summary and the timeline directory."""
    from trainsim.comm.calibration import write_calibration_artifact
    from trainsim.profile.stage import write_profile_artifact
    from trainsim.registry import STAGES
    from trainsim.slowdown.stage import write_dataset_artifact, write_model_artifact
    from trainsim.slowdown.train import SCHEMA_VERSION as SLOWDOWN_SCHEMA_VERSION
    from trainsim.trace.stage import tracer_code_digest, write_trace_artifact

    keys, hw = run.keys, run.hardware
    paths = {name: Path(stage.path(keys)) for name, stage in STAGES.items()}

    def missing(name: str) -> bool:
        return not (paths[name] / "manifest.json").is_file()

    def outdated_slowdown() -> bool:
        """A slowdown model of an older feature schema (built before an upgrade) is rebuilt, not refused."""
        schema = paths["slowdown_model"] / "schema.json"
        return schema.is_file() and json.loads(schema.read_text()).get("schema_version") != SLOWDOWN_SCHEMA_VERSION

    def outdated_trace() -> bool:
        """A trace made by other tracer or workload code (before an upgrade) is traced again, not reused."""
        manifest = paths["trace"] / "manifest.json"
        return json.loads(manifest.read_text())["config"].get("tracer_code") != tracer_code_digest()

    retrace = missing("trace") or outdated_trace()
    if retrace:
        write_trace_artifact(run.model, run.parallelism, keys, paths["trace"])
    if retrace or missing("profile"):
        write_profile_artifact(hw, keys, paths["trace"], Path(STAGES["profile"].database_path(keys)), paths["profile"])
    if build_missing and missing("calibration"):
        write_calibration_artifact(hw, keys, paths["calibration"])
    if build_missing and (missing("slowdown_model") or outdated_slowdown()):
        if missing("slowdown_dataset") or outdated_slowdown():
            write_dataset_artifact(hw, keys, paths["slowdown_dataset"])
        write_model_artifact(hw, keys, paths["slowdown_dataset"], paths["slowdown_model"])
    inputs = {name: paths[name] for name in STAGES["compose"].inputs
              if name in paths and (paths[name] / "manifest.json").is_file()}
    output = Path(output or paths["compose"])
    config = timeline_config(hw, run.model, run.parallelism)
    if not replaced_builtins() and is_current(output, stage="compose", config=config, config_keys=keys,
                                              inputs=list(inputs.values())):
        return json.loads((output / SUMMARY_FILE).read_text()), output  # only read: no replay, slowdown model
    return write_timeline_artifact(run.hardware, run.model, run.parallelism, keys, inputs, output), output
