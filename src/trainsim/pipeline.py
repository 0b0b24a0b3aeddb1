"""The one pipeline driver: build whatever artifact a point is missing, in the stage graph's order.

`trainsim compose`, `trainsim.predict`, the layout search and plan, and the validation benchmarks all get
their artifacts here, so they cache in the same places (registry.STAGES' paths) and rebuild for the same
reasons. The order is derived from each stage's declared inputs (registry.Stage.inputs), never written out.

A stage of the target's input closure is built when it is needed and stale:
  * stale: its artifact is missing (no manifest.json) or outdated (made by other tracer or workload code, or a
    slowdown model of an older feature schema or without its unseen-kernel-group score: rebuilt after an
    upgrade, not refused), or one of its inputs is built in this call;
  * needed: it is the target, or a stage built in this call reads it. A present, current artifact is used as
    it is, so its own inputs are not looked at (a slowdown model whose dataset was deleted is still used).
`build_missing=False` (`--quick`) ignores the target's `fallback_inputs` (registry.Stage): a compose then
builds only the trace and the kernel profile, and summary.json's `inputs` warns of what stood in for the rest.
Snakemake and DVC drive the same stages through stages/*.py (their own make logic, same paths).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainsim.artifacts.store import MANIFEST
from trainsim.registry import STAGES, Stage


def stage_order(stages: dict[str, Stage] = STAGES) -> list[str]:
    """Stage names so that every stage comes after the stages it reads (inputs and optional inputs); ties
    keep the registry's order. Raises ValueError on an unknown input or a cycle."""
    upstream = {name: [*stage.inputs, *stage.optional_inputs] for name, stage in stages.items()}
    for name, names in upstream.items():
        unknown = [u for u in names if u not in stages]
        if unknown:
            raise ValueError(f"registry stage '{name}' reads unknown stage(s) {unknown}; known: {list(stages)}")
    order: list[str] = []
    while len(order) < len(stages):
        ready = [n for n in stages if n not in order and all(u in order for u in upstream[n])]
        if not ready:
            raise ValueError(f"registry stages {[n for n in stages if n not in order]} read each other in a cycle")
        order.append(ready[0])
    return order


def artifact_paths(keys: dict[str, str]) -> dict[str, Path]:
    """Every stage's artifact directory for one point's config keys (relative to the working directory)."""
    return {name: Path(stage.path(keys)) for name, stage in STAGES.items()}


def exists(directory: Path) -> bool:
    """An artifact is there once its manifest is (artifacts are published atomically, manifest included)."""
    return (Path(directory) / MANIFEST).is_file()


def trace_outdated(paths: dict[str, Path]) -> bool:
    """A trace made by other tracer or workload code (before an upgrade) is traced again, not reused."""
    from trainsim.trace.stage import tracer_code_digest

    manifest = json.loads((paths["trace"] / MANIFEST).read_text())
    return manifest["config"].get("tracer_code") != tracer_code_digest()


def slowdown_outdated(paths: dict[str, Path]) -> bool:
    """A slowdown model of an older feature schema is rebuilt, and so is the dataset it was trained on (its
    rows carry the old features)."""
    schema = paths["slowdown_model"] / "schema.json"
    if not schema.is_file():
        return False
    from trainsim.slowdown.train import SCHEMA_VERSION  # only where a model is there to check

    return json.loads(schema.read_text()).get("schema_version") != SCHEMA_VERSION


def slowdown_model_outdated(paths: dict[str, Path]) -> bool:
    """As slowdown_outdated, and a model trained before its score on unseen kernel groups was recorded is
    retrained (hardware.slowdown.use=auto decides on that score; the dataset stays)."""
    if slowdown_outdated(paths):
        return True
    metrics = paths["slowdown_model"] / "metrics.json"
    if not metrics.is_file():
        return False
    from trainsim.slowdown.train import HELD_OUT_GROUPS

    return HELD_OUT_GROUPS not in json.loads(metrics.read_text())


OUTDATED: dict[str, Callable[[dict[str, Path]], bool]] = {
    "trace": trace_outdated,
    "slowdown_dataset": slowdown_outdated,
    "slowdown_model": slowdown_model_outdated,
}
"""Stage -> check whether its present artifact was made by code the current one no longer reads."""


def _build_trace(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.trace.stage import write_trace_artifact

    return write_trace_artifact(run.model, run.parallelism, run.keys, output)


def _build_profile(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.profile.stage import write_profile_artifact

    database = Path(STAGES["profile"].database_path(run.keys))
    return write_profile_artifact(run.hardware, run.keys, inputs["trace"], database, output)


def _build_calibration(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.comm.calibration import write_calibration_artifact

    return write_calibration_artifact(run.hardware, run.keys, output)


def _build_slowdown_dataset(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.slowdown.stage import write_dataset_artifact

    return write_dataset_artifact(run.hardware, run.keys, output)


def _build_slowdown_model(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.slowdown.stage import write_model_artifact

    return write_model_artifact(run.hardware, run.keys, inputs["slowdown_dataset"], output)


def _build_compose(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.timeline.stage import write_timeline_artifact

    return write_timeline_artifact(run.hardware, run.model, run.parallelism, run.keys, inputs, output)


def _build_report(run, inputs: dict[str, Path], output: Path) -> Any:
    from trainsim.report.stage import write_report_artifact

    truth = inputs.get("ground_truth", Path(STAGES["ground_truth"].path(run.keys)))
    return write_report_artifact(run.keys, inputs, output, truth, train=run.train, framework=run.framework)


BUILDERS: dict[str, Callable[[Any, dict[str, Path], Path], Any]] = {
    "trace": _build_trace,
    "profile": _build_profile,
    "calibration": _build_calibration,
    "slowdown_dataset": _build_slowdown_dataset,
    "slowdown_model": _build_slowdown_model,
    "compose": _build_compose,
    "report": _build_report,
}
"""Stage -> its write function called with (run, the input artifacts that exist, output directory). The
on-demand ground truth (a real run) has none: the driver never builds it, and the report reads it if there."""


@dataclass
class Built:
    """What one call of the driver did and where the point's artifacts are."""

    paths: dict[str, Path]
    """Every stage's artifact directory for the point (the target's at `output` when one was given)."""
    built: list[str] = field(default_factory=list)
    """Stages built in this call, in the order they were built."""
    results: dict[str, Any] = field(default_factory=dict)
    """Stage -> what its write function returned (e.g. compose: the summary)."""

    def available(self, names) -> dict[str, Path]:
        """The artifacts of `names` that exist now."""
        return {name: self.paths[name] for name in names if exists(self.paths[name])}


def upstream_of(target: str, build_missing: bool = True) -> set[str]:
    """The stages `target` reads, directly or not (its fallback inputs left out when not `build_missing`)."""
    seen: set[str] = set()
    todo = [target]
    while todo:
        stage = STAGES[todo.pop()]
        skipped = () if build_missing or stage.name != target else stage.fallback_inputs
        for name in stage.inputs:
            if name not in seen and name not in skipped:
                seen.add(name)
                todo.append(name)
    return seen


def plan_builds(paths: dict[str, Path], target: str, build_missing: bool = True,
                force_target: bool = False) -> list[str]:
    """The stages to build, in stage order, so that `target` is current (module docstring: needed and stale).
    `force_target` builds the target even when its artifact is current (a compose always composes)."""
    if target not in BUILDERS:
        raise ValueError(f"the pipeline cannot build stage '{target}'; it builds {sorted(BUILDERS)}")
    order = [name for name in stage_order() if name == target or name in upstream_of(target, build_missing)]
    reads = {name: [u for u in STAGES[name].inputs if u in order] for name in order}
    if not build_missing:
        reads[target] = [u for u in reads[target] if u not in STAGES[target].fallback_inputs]
    stale_alone = {name: not exists(paths[name]) or (name in OUTDATED and OUTDATED[name](paths)) for name in order}
    built = {target} if force_target else set()
    changed = True
    while changed:  # the least set closed under "needed and stale": a few passes over a handful of stages
        changed = False
        for name in order:
            needed = name == target or any(name in reads[d] for d in built)
            stale = stale_alone[name] or any(u in built for u in reads[name])
            if name not in built and needed and stale:
                built.add(name)
                changed = True
    return [name for name in order if name in built]


def build_point(run, target: str = "compose", build_missing: bool = True, output: Path | None = None,
                force_target: bool = False) -> Built:
    """Build what `run`'s point lacks for `target` (plan_builds), each with its stage's write function, the
    artifacts cached at the registry's paths for the next call; `output` puts the target elsewhere."""
    paths = artifact_paths(run.keys)
    if output is not None:
        paths[target] = Path(output)
    result = Built(paths)
    for name in plan_builds(paths, target, build_missing, force_target):
        stage = STAGES[name]
        inputs = result.available((*stage.inputs, *stage.optional_inputs))
        result.results[name] = BUILDERS[name](run, inputs, paths[name])
        result.built.append(name)
    return result


def timeline_is_current(run, paths: dict[str, Path]) -> bool:
    """The point's timeline is what composing again would write: same config, keys, input contents, tools and
    code (artifacts.is_current), and no built-in schedule or dependency rule replaced by a plugin since. Then
    a compose only reads it (no replay, no slowdown model loaded): a repeated prediction takes a fraction of
    a second. Inputs that a compose would rebuild are caught by plan_builds, which rebuilds the timeline too."""
    from trainsim.artifacts import is_current
    from trainsim.timeline.plugins import replaced_builtins
    from trainsim.timeline.stage import timeline_config

    stage = STAGES["compose"]
    inputs = [paths[name] for name in (*stage.inputs, *stage.optional_inputs) if exists(paths[name])]
    return not replaced_builtins() and is_current(paths["compose"], stage="compose", config_keys=run.keys,
                                                  config=timeline_config(run.hardware, run.model, run.parallelism),
                                                  inputs=inputs)


def compose_point(run, output: Path | None = None, build_missing: bool = True) -> tuple[dict, Path]:
    """What `trainsim compose` does: compose a run from the artifacts at the registry's paths, first building
    those that are missing or outdated, so that the default is the whole pipeline's prediction. With
    `build_missing=False` only the trace and kernel profile are built; a missing calibration or slowdown
    model is left out, and summary.json's `inputs` warns of it. A current timeline is read, not composed
    again (timeline_is_current). Returns the summary and the timeline directory."""
    paths = artifact_paths(run.keys)
    if output is not None:
        paths["compose"] = Path(output)
    reuse = timeline_is_current(run, paths)
    built = build_point(run, "compose", build_missing, output, force_target=not reuse)
    if "compose" in built.results:
        return built.results["compose"], built.paths["compose"]
    from trainsim.timeline.stage import SUMMARY_FILE

    return json.loads((built.paths["compose"] / SUMMARY_FILE).read_text()), built.paths["compose"]
