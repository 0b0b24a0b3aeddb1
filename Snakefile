# trainsim workflow. Rules are built from the stage registry (src/trainsim/registry.py).
#   snakemake --cores 2                                    # default point (conf/config.yaml)
#   snakemake --cores 2 --config model=gpt-small parallelism=tp2
#   snakemake --cores 2 --config parallelism=tp2 overrides='[parallelism.recompute=full]'
#   snakemake --cores 2 --config model=gpt-tiny,gpt-small parallelism=dp2,pp2   # sweep: 4 points
#   snakemake --cores 2 --config sweep_file=sweeps/example.yaml sweep_name=grid   # a large grid from a file
# Every --config entry is a Hydra override (field-level ones under `overrides`) except sweep_file and
# sweep_name; see README. Every sweep ends in artifacts/sweeps/{name}/ (summary table and page).
import dataclasses
import json
import os
import sys

from trainsim.config.sweep import sweep_points
from trainsim.registry import STAGES, leaf_stages, stage_command

SWEEP_NAME, POINTS = sweep_points(config)
RUNS = [point.run for point in POINTS if point.run is not None]
for point in POINTS:
    if point.reason is not None:
        print(f"trainsim: invalid sweep point {list(point.overrides)}: {point.reason}", file=sys.stderr)
if not RUNS:
    raise ValueError("no valid point in this sweep: " + "; ".join(p.reason for p in POINTS))


def stage_config_json(stage, wildcards):
    """Plain JSON of the config groups (and settings) a stage depends on, for the run matching the wildcards.

    Params are plain strings so Snakemake re-runs the job when any of these values change.
    """
    for run in RUNS:
        if all(run.key(group) == wildcards[group] for group in stage.keyed_by):
            plain = {group: run.group(group) for group in stage.keyed_by}
            plain["keys"] = {group: run.key(group) for group in stage.keyed_by}
            plain |= {name: dataclasses.asdict(getattr(run, name)) for name in stage.settings}
            return json.dumps(plain, sort_keys=True)
    raise ValueError(f"no configured run matches {dict(wildcards)} for stage {stage.name}")


report: "report/workflow.rst"


rule all:
    input:
        [stage.path(run.keys) for stage in leaf_stages() for run in RUNS],
        f"artifacts/sweeps/{SWEEP_NAME}",


rule sweep_summary:
    """Every point of this sweep in one table and page; invalid points listed with their reason."""
    input:
        [STAGES["report"].path(run.keys) for run in RUNS],
    output:
        report(directory("artifacts/sweeps/{sweep}"), htmlindex="summary.html", caption="report/sweep.rst",
               category="Sweep summary", labels={"sweep": "{sweep}"}),
    params:
        points_json=json.dumps([point.as_dict() for point in POINTS]),
    log:
        "logs/sweeps/{sweep}.log",
    shell:
        "python stages/sweep_summary_stage.py --output {output:q} --name {wildcards.sweep:q} "
        "--points-json {params.points_json:q} > {log:q} 2>&1"


def stage_inputs(stage, wildcards):
    """Required upstream artifacts, plus optional ones (ground truth) when they already exist."""
    inputs = {name: STAGES[name].path(wildcards) for name in stage.inputs}
    optional = {name: STAGES[name].path(wildcards) for name in stage.optional_inputs}
    return inputs | {name: path for name, path in optional.items() if os.path.isdir(path)}


def stage_output(stage):
    """The output directory; with a caption, also shown by `snakemake --report` (its HTML page as index)."""
    if stage.snakemake_report is None:
        return directory(stage.output)
    return report(directory(stage.output), htmlindex="report.html", caption=stage.snakemake_report,
                  category="Step-time reports", labels={group: f"{{{group}}}" for group in stage.keyed_by})


def declare_rule(stage):
    """One rule per registry stage (a function, so each rule's shell command binds its own stage)."""
    command = stage_command(
        stage,
        output="{output:q}",
        inputs={name: f"{{input.{name}:q}}" for name in stage.inputs},
        database="{params.database:q}" if stage.database else None,
        config="--config-json {params.config_json:q}",
    )

    rule:
        name:
            stage.name
        input:
            unpack(lambda wildcards: stage_inputs(stage, wildcards)),
        output:
            stage_output(stage),
        params:
            config_json=lambda wildcards: stage_config_json(stage, wildcards),
            database=lambda wildcards: stage.database_path(wildcards) if stage.database else "",
        threads: workflow.cores if stage.measures else 1
        log:
            stage.output.replace("artifacts/", "logs/", 1) + ".log",
        shell:
            command + " > {log:q} 2>&1"


for stage in STAGES.values():
    declare_rule(stage)
