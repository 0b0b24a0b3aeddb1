"""The stage graph, once: names, the config groups that key each output, code it depends on.

The Snakefile builds its rules from this table and dvc.yaml is generated from it
(`trainsim dvc-yaml`; a test checks the committed file), so the two front ends cannot disagree.
Each output path has exactly one owning stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import yaml

from trainsim.config.schema import RunConfig

RUN_FIELDS = {field.name: field for field in dataclasses.fields(RunConfig)}
CHOSEN_SETTINGS = ("framework",)
"""Config group choices every stage composes with beside its keyed groups (conf/framework/<name>.yaml writes its
values into them): DVC passes the choice from params.yaml to every stage (`framework=${framework}`), so a change
re-runs what it changes."""


@dataclass(frozen=True)
class Stage:
    name: str
    keyed_by: tuple[str, ...]
    """Config groups whose choice (and values) decide the output; nothing else re-runs it."""
    output: str
    """Output directory template over `keyed_by`, relative to the project root."""
    script: str
    """Thin entry point: `python <script> --output DIR [--config-json JSON | overrides...]`."""
    code: tuple[str, ...]
    """Source paths whose change invalidates the output (DVC deps)."""
    summary: str
    inputs: tuple[str, ...] = ()
    """Upstream stages whose artifacts (for the same keys) this stage reads."""
    database: str | None = None
    """A shared, append-only store the stage adds to (never deleted before a run; DVC `persist`)."""
    measures: bool = False
    """Times things on this machine: Snakemake gives it every core, so no other job distorts its timings."""
    on_demand: bool = False
    """Built only when its output is asked for (never by `rule all`): a slow real run, not a prediction."""
    optional_inputs: tuple[str, ...] = ()
    """Upstream stages read when their artifact exists (Snakemake then re-runs on its change); never built for it."""
    fallback_inputs: tuple[str, ...] = ()
    """Inputs (among `inputs`) the stage can do without, a weaker stand-in taking their place (which its output
    says): `trainsim compose --quick` builds none of them (pipeline.py). Snakemake and DVC build them all."""
    dvc_files: tuple[str, ...] = ()
    """Files of the output listed one by one as DVC outs (needed when some are metrics or plots: DVC
    refuses a metrics file inside a directory out). Empty: the output directory is one out."""
    dvc_metrics: tuple[str, ...] = ()
    """Output files `dvc metrics show` reads (not cached, so they stay in git)."""
    dvc_plots: tuple[tuple[str, str, str], ...] = ()
    """(file, x column, y column) of the output's CSV tables for `dvc plots show`."""
    snakemake_report: str | None = None
    """Caption (reStructuredText) under which `snakemake --report` shows the output; None: not shown."""
    settings: tuple[str, ...] = ()
    """Root config nodes beyond `keyed_by` that the stage reads (e.g. 'train': the token budget of the
    report's training totals; 'framework': the software stack, whose fitted state sets the width of the step
    time's interval). They key no path: a change re-runs the stage in place, nothing upstream."""

    def path(self, keys: dict[str, str]) -> str:
        return self.output.format(**{k: keys[k] for k in self.keyed_by})

    def database_path(self, keys: dict[str, str]) -> str:
        assert self.database is not None
        return self.database.format(**keys)


STAGES: dict[str, Stage] = {
    "trace": Stage(
        name="trace",
        keyed_by=("model", "parallelism"),
        output="artifacts/traces/{model}/{parallelism}",
        script="stages/trace_stage.py",
        code=("stages/trace_stage.py", "src/trainsim/trace", "src/trainsim/workloads", "src/trainsim/parallel",
              "src/trainsim/config"),
        summary="ex-situ per-rank-class execution graphs, rank -> class map, memory per class",
    ),
    "profile": Stage(
        name="profile",
        keyed_by=("hardware", "model", "parallelism"),
        output="artifacts/profiles/{hardware}/runs/{model}/{parallelism}",
        script="stages/profile_stage.py",
        code=("stages/profile_stage.py", "src/trainsim/profile"),
        summary="solo time of every distinct compute op of the trace (measured, reused or analytical)",
        inputs=("trace",),
        database="artifacts/profiles/{hardware}/kernels.parquet",
        measures=True,
    ),
    "calibration": Stage(
        name="calibration",
        keyed_by=("hardware",),
        output="artifacts/calibration/{hardware}",
        script="stages/calibration_stage.py",
        code=("stages/calibration_stage.py", "src/trainsim/comm"),
        summary="collective measurements (local sweep, nccl-tests logs) and the fitted NCCL model with held-out error",
        measures=True,
    ),
    "slowdown_dataset": Stage(
        name="slowdown_dataset",
        keyed_by=("hardware",),
        output="artifacts/slowdown/{hardware}",
        script="stages/slowdown_dataset_stage.py",
        code=("stages/slowdown_dataset_stage.py", "src/trainsim/slowdown/stage.py", "src/trainsim/slowdown/dataset.py",
              "src/trainsim/slowdown/collect.py", "src/trainsim/slowdown/a100_import.py",
              "src/trainsim/slowdown/features.py"),
        summary="compute ops timed solo and overlapped with collectives (measured here or imported)",
        measures=True,
    ),
    "slowdown_model": Stage(
        name="slowdown_model",
        keyed_by=("hardware",),
        output="artifacts/models/{hardware}",
        script="stages/slowdown_model_stage.py",
        code=("stages/slowdown_model_stage.py", "src/trainsim/slowdown/stage.py", "src/trainsim/slowdown/features.py",
              "src/trainsim/slowdown/train.py", "src/trainsim/slowdown/predictor.py"),
        summary="XGBoost overlap-slowdown model with cross-validated and hold-out metrics against the baseline",
        inputs=("slowdown_dataset",),
    ),
    "compose": Stage(
        name="compose",
        keyed_by=("hardware", "model", "parallelism"),
        output="artifacts/timelines/{hardware}/{model}/{parallelism}",
        script="stages/compose_stage.py",
        code=("stages/compose_stage.py", "src/trainsim/timeline", "src/trainsim/parallel"),
        summary="event-driven timeline of one step: step time, breakdown per rank class, critical path, "
                "memory verdict, Chrome trace",
        inputs=("trace", "profile", "calibration", "slowdown_model"),
        fallback_inputs=("calibration", "slowdown_model"),
    ),
    "ground_truth": Stage(
        name="ground_truth",
        keyed_by=("hardware", "model", "parallelism"),
        output="artifacts/ground_truth/{hardware}/{model}/{parallelism}",
        script="stages/ground_truth_stage.py",
        code=("stages/ground_truth_stage.py", "src/trainsim/validation/ground_truth.py", "src/trainsim/workloads",
              "src/trainsim/parallel"),
        summary="the reference step run for real (median and spread of measured steps, per-op and "
                "per-collective profiler tables), or 'not measured' with the reason",
        measures=True,
        on_demand=True,
    ),
    "report": Stage(
        name="report",
        keyed_by=("hardware", "model", "parallelism"),
        output="artifacts/reports/{hardware}/{model}/{parallelism}",
        script="stages/report_stage.py",
        code=("stages/report_stage.py", "src/trainsim/report", "src/trainsim/validation/ground_truth.py"),
        summary="self-contained HTML page (setup, predicted vs measured, breakdown, timeline, communication and "
                "slowdown model accuracy, simulation cost, provenance), metrics.json and plot tables",
        inputs=("trace", "profile", "calibration", "slowdown_model", "compose"),
        optional_inputs=("ground_truth",),
        dvc_files=("report.html", "manifest.json"),
        dvc_metrics=("metrics.json",),
        dvc_plots=(("plots/comm_error.csv", "message_bytes", "model_error_pct"),
                   ("plots/breakdown.csv", "part", "seconds"),
                   ("plots/importances.csv", "feature", "gain_share")),
        snakemake_report="report/caption.rst",
        settings=("train", "framework"),
    ),
}


def leaf_stages() -> list[Stage]:
    """Stages no other stage reads: what `rule all` / a full run asks for (on-demand stages excepted)."""
    used = {name for stage in STAGES.values() for name in stage.inputs}
    return [stage for name, stage in STAGES.items() if name not in used and not stage.on_demand]


def stage_command(stage: Stage, output: str, inputs: dict[str, str], database: str | None, config: str) -> str:
    """The shell command of a stage; `config` is '--config-json ...' or Hydra overrides."""
    parts = [f"python {stage.script} --output {output}"]
    parts += [f"--input {name}={path}" for name, path in inputs.items()]
    if database:
        parts.append(f"--database {database}")
    return " ".join([*parts, config])


def render_dvc_yaml() -> str:
    """dvc.yaml for `dvc repro` / `dvc exp run -S model=...`: config choices come from params.yaml."""
    stages = {}
    keys = {group: f"${{{group}}}" for group in ("hardware", "model", "parallelism")}
    for stage in STAGES.values():
        output = stage.path(keys)
        # `dvc repro` builds every stage, on-demand ones included, so optional inputs are plain deps here
        inputs = {name: STAGES[name].path(keys) for name in (*stage.inputs, *stage.optional_inputs)}
        database = stage.database_path(keys) if stage.database else None
        settings = [*CHOSEN_SETTINGS, *(f"{name}.{field.name}" for name in stage.settings if name not in CHOSEN_SETTINGS
                                        for field in dataclasses.fields(RUN_FIELDS[name].default_factory()))]
        choices = " ".join(f"{key}=${{{key}}}" for key in (*stage.keyed_by, *settings))
        outs: list = [f"{output}/{name}" for name in stage.dvc_files] or [output]
        if database:
            outs.append({database: {"persist": True}})
        stages[stage.name] = {
            "desc": stage.summary,
            "cmd": stage_command(stage, output, inputs, database, choices),
            "deps": [*inputs.values(), *stage.code, *(f"conf/{group}/${{{group}}}.yaml" for group in stage.keyed_by)],
            "params": [*stage.keyed_by, *settings],
            "outs": outs,
        }
        if stage.dvc_metrics:
            stages[stage.name]["metrics"] = [{f"{output}/{name}": {"cache": False}} for name in stage.dvc_metrics]
        if stage.dvc_plots:
            stages[stage.name]["plots"] = [{f"{output}/{name}": {"x": x, "y": y, "cache": False}}
                                           for name, x, y in stage.dvc_plots]
    header = "# Generated from src/trainsim/registry.py by `trainsim dvc-yaml > dvc.yaml`; do not edit.\n"
    return header + yaml.safe_dump({"stages": stages}, sort_keys=False)
