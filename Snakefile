# trainsim workflow. Rules are built from the stage registry (src/trainsim/registry.py).
#   snakemake --cores 2                                    # default point (conf/config.yaml)
#   snakemake --cores 2 --config model=gpt-small parallelism=tp2
#   snakemake --cores 2 --config parallelism=tp2 overrides='[parallelism.recompute=full]'
#   snakemake --cores 2 --config model=gpt-tiny,gpt-small parallelism=dp2,pp2   # sweep: 4 points
# Every --config entry is a Hydra override (field-level ones under `overrides`); see README.
import json
import os

from trainsim.config import compose_run
from trainsim.config.sweep import expand_sweep
from trainsim.registry import STAGES, leaf_stages, stage_command

RUNS = [compose_run(overrides) for overrides in expand_sweep(config)]


def stage_config_json(stage, wildcards):
    """Plain JSON of the config groups a stage depends on, for the run matching the wildcards.

    Params are plain strings so Snakemake re-runs the job when any of these values change.
    """
    for run in RUNS:
        if all(run.key(group) == wildcards[group] for group in stage.keyed_by):
            plain = {group: run.group(group) for group in stage.keyed_by}
            plain["keys"] = {group: run.key(group) for group in stage.keyed_by}
            return json.dumps(plain, sort_keys=True)
    raise ValueError(f"no configured run matches {dict(wildcards)} for stage {stage.name}")


report: "report/workflow.rst"


rule all:
    input:
        [stage.path(run.keys) for stage in leaf_stages() for run in RUNS],


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
