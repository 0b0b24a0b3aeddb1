"""Python API: predict one training step from a notebook or a script, with the CLI's overrides.

    import trainsim
    p = trainsim.predict("model=gpt-175b", "parallelism=pp16-tp8-dp8", hardware="a100-80g-dgx")
    p.step_time_s, p.breakdown, p.memory, p.warnings
    p.efficiency["mfu_pct"]                   # with "train.tokens=3e11": p.efficiency["training_days"]
    p.step_time_interval_s                    # (low, high): 80 % of such predictions hold the real step time
    p.intervals["mfu_pct"], p.interval.describe(95)
    p.write_chrome_trace("step.json")        # open in https://ui.perfetto.dev

`trainsim compose` calls the same `predict`, so the two never disagree. Artifacts are cached under
artifacts/ of the working directory (as for the CLI and Snakemake): a second call with the same config
only composes, and a hardware change reuses the traces.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from trainsim.uncertainty.interval import PRINTED_LEVEL, StepInterval

GIB = 1024**3
BREAKDOWN_COLUMNS = ["rank_class", "ranks", "pp_rank", "compute_s", "slowdown_added_s", "exposed_tp_s",
                     "exposed_dp_s", "exposed_pp_s", "exposed_mp_s", "exposed_world_s", "exposed_other_s",
                     "pipeline_bubble_s", "idle_s", "optimizer_step_s", "contention_added_s", "end_s"]
MEMORY_COLUMNS = ["rank_class", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                  "peak_activation_bytes", "max_inflight_microbatches", "peak_bytes", "capacity_bytes", "oom"]


@dataclass(frozen=True)
class Prediction:
    """One composed training step: what it takes, where the time goes, and what it was predicted from."""

    step_time_s: float
    """Predicted wall time of one training step (slowest rank)."""
    breakdown: pd.DataFrame
    """Per rank class (seconds): compute, slowdown from overlap, exposed communication per group kind,
    pipeline bubble, idle, the optimizer step's part of them, and the communication time added by
    concurrent inter-node transfers sharing a NIC (BREAKDOWN_COLUMNS, and the exposed time of any other group
    kind where it is not zero: cp, ep, HSDP's dp_shard and dp_replicate, ...; meanings in
    summary['field_meanings'])."""
    memory: pd.DataFrame
    """Per rank class (bytes): weights, gradients, optimizer state, peak activations, peak, capacity, OOM
    (MEMORY_COLUMNS); rank classes of the trace, before stragglers split them."""
    critical_path: dict
    """The chain of nodes that decides the step time: time by category and by class, segments."""
    inputs: dict
    """Calibration, kernel timing and slowdown model used, with their errors (timeline/provenance.py)."""
    warnings: list[str]
    """Where a weaker input stood in (uncalibrated links, default kernel model, no slowdown model)."""
    efficiency: dict
    """The step in the field's numbers: tokens/s (and per GPU), model TFLOP/s per GPU, MFU, HFU, cost per
    step and per million tokens; with `train.tokens` the whole run: steps, days, GPU-hours, cost, energy
    (report/efficiency.py; None where the hardware config lacks a peak rate, price or power)."""
    interval: StepInterval
    """How far to trust step_time_s: central intervals at 50, 80 and 95 %, from each cost model's measured
    held-out error on this step's critical path (uncertainty/interval.py)."""
    intervals: dict
    """(low, high) at 80 % of the step time (`step_time_s`) and of every efficiency figure that moves with it
    (tokens/s, MFU, days, cost, ...)."""
    summary: dict
    """The whole summary.json of the timeline artifact."""
    artifact_dir: Path
    """The timeline artifact (summary.json, classes.parquet, timeline.parquet, trace.json)."""

    @property
    def step_time_interval_s(self) -> tuple[float, float]:
        """(low, high) seconds: the 80 % interval of the step time."""
        return self.interval.at(PRINTED_LEVEL)

    @property
    def oom(self) -> bool:
        """True when some rank class needs more memory than the device has."""
        return bool(self.summary["oom"])

    def write_chrome_trace(self, path: str | Path) -> Path:
        """Copy the Chrome / Perfetto trace of the step (one process per rank class) to `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.artifact_dir / "trace.json", path)
        return path


def overrides_from(args: tuple[str, ...], options: dict[str, object]) -> list[str]:
    """Hydra overrides from positional strings and keywords (`hardware="a100-80g-dgx"`; a dict splat
    for dotted keys: `**{"parallelism.tp": 8}`)."""
    out = list(args)
    for key, value in options.items():
        text = json.dumps(value) if isinstance(value, list | tuple | bool) else str(value)
        out.append(f"{key}={text}")
    return out


def predict(*overrides: str, build_missing: bool = True, output: str | Path | None = None,
            **options) -> Prediction:
    """Predict one training step of the composed config (the CLI's `trainsim compose`).

    Missing or outdated artifacts (trace, kernel profile, calibration, slowdown model) are built and cached
    first by the pipeline driver (pipeline.compose_point), so the default is the best prediction the project
    can make; `build_missing=False` builds only the
    trace and profile and says in `warnings` what stood in for the rest. Raises ConfigError for an
    invalid config, naming the field, the value and what is accepted.
    """
    from trainsim.artifacts import read_table
    from trainsim.config import compose_run
    from trainsim.pipeline import compose_point
    from trainsim.registry import STAGES
    from trainsim.report.efficiency import efficiency, efficiency_intervals
    from trainsim.timeline.stage import CLASSES_FILE
    from trainsim.trace.stage import MEMORY_FILE
    from trainsim.uncertainty import step_interval

    run = compose_run(overrides_from(overrides, options), check="layout")
    summary, out_dir = compose_point(run, Path(output) if output else None, build_missing=build_missing)
    classes = read_table(out_dir, CLASSES_FILE).to_pandas()
    trace_dir = Path(STAGES["trace"].path(run.keys))  # the trace the timeline was composed from
    memory = memory_table(read_table(trace_dir, MEMORY_FILE).to_pandas(), run.hardware.memory_capacity_bytes)
    step_time_s = float(summary["step_time_s"])
    groups = run.group("hardware"), run.group("model"), run.group("parallelism")
    figures = efficiency(step_time_s, *groups, train_tokens=run.train.tokens)
    interval = step_interval(summary, run.hardware.kernel_model.fitted_frameworks, run.framework.name)
    intervals = {"step_time_s": interval.at(PRINTED_LEVEL),
                 **efficiency_intervals(interval.at(PRINTED_LEVEL), *groups, train_tokens=run.train.tokens)}
    at = BREAKDOWN_COLUMNS.index("exposed_other_s") + 1
    others = [c for c in classes.columns
              if c.startswith("exposed_") and c not in BREAKDOWN_COLUMNS and classes[c].any()]
    columns = [*BREAKDOWN_COLUMNS[:at], *others, *BREAKDOWN_COLUMNS[at:]]
    return Prediction(step_time_s=step_time_s, breakdown=classes[columns],
                      memory=memory, critical_path=summary["critical_path"], inputs=summary["inputs"],
                      warnings=list(summary["inputs"]["warnings"]), efficiency=figures, interval=interval,
                      intervals=intervals, summary=summary,
                      artifact_dir=out_dir)


def memory_table(memory: pd.DataFrame, capacity_bytes: float) -> pd.DataFrame:
    """The trace's memory per rank class with the device capacity and the out-of-memory verdict."""
    from trainsim.trace.memory import oom_verdict

    out = memory.copy()
    out["capacity_bytes"] = capacity_bytes
    out["oom"] = [bool(oom_verdict(peak, capacity_bytes)) for peak in out["peak_bytes"]]
    return out[MEMORY_COLUMNS]
