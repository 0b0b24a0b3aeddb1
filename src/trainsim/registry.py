"""The stage graph, once: names, the config groups that key each output, code it depends on.

The Snakefile builds its rules from this table and dvc.yaml is generated from it
(`trainsim dvc-yaml`; a test checks the committed file), so the two front ends cannot disagree.
Each output path has exactly one owning stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml


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

    def path(self, keys: dict[str, str]) -> str:
        return self.output.format(**{k: keys[k] for k in self.keyed_by})


STAGES: dict[str, Stage] = {
    "trace": Stage(
        name="trace",
        keyed_by=("model", "parallelism"),
        output="artifacts/traces/{model}/{parallelism}",
        script="stages/trace.py",
        code=("stages/trace.py", "src/trainsim/trace", "src/trainsim/workloads", "src/trainsim/config"),
        summary="ex-situ per-rank-class execution graphs, rank -> class map, memory per class",
    ),
}


def render_dvc_yaml() -> str:
    """dvc.yaml for `dvc repro` / `dvc exp run -S model=...`: config choices come from params.yaml."""
    stages = {}
    for stage in STAGES.values():
        keys = {group: f"${{{group}}}" for group in stage.keyed_by}
        output = stage.path(keys)
        choices = " ".join(f"{group}=${{{group}}}" for group in stage.keyed_by)
        stages[stage.name] = {
            "desc": stage.summary,
            "cmd": f"python {stage.script} --output {output} {choices}",
            "deps": [*stage.code, *(f"conf/{group}/${{{group}}}.yaml" for group in stage.keyed_by)],
            "params": list(stage.keyed_by),
            "outs": [output],
        }
    header = "# Generated from src/trainsim/registry.py by `trainsim dvc-yaml > dvc.yaml`; do not edit.\n"
    return header + yaml.safe_dump({"stages": stages}, sort_keys=False)
