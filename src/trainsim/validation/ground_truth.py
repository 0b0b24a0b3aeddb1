"""Ground truth: run the reference training step for real and keep robust step-time statistics.

One process per rank (gloo over loopback on CPU, one thread per process from
`hardware.threads_per_device`; NCCL with one GPU per rank for cuda hardware, each step synchronised
with the device at its start and end), `warmup` steps discarded, `steps` steps timed (Echo starts measuring
after warm-up and averages 5 steps; we keep the median and the spread), then one extra step under
torch.profiler for the per-op and per-collective tables (its overhead does not touch the timed steps).
The step time of a measured step is the slowest rank's wall time (every rank starts after a barrier).

Only hardware this machine is can be measured: device_kind cpu, or cuda when this machine has a GPU
per rank. Anything else (a GPU cluster config on a CPU machine, a layout wider than the GPUs here) gets a
"not measured" artifact with the reason, never a number. On a GPU the per-phase times are host-side
(kernels run asynchronously); the step time is the device's.

Artifact (artifacts/ground_truth/{hardware}/{model}/{parallelism}/):
  summary.json     status ("measured" / "not measured"), reason, step_time_median_s, step_time_spread_s
                   (interquartile range over measured steps), min/max, steps, warmup, step_times_s,
                   per-rank medians (step, compute, communication, phases); `field_meanings` inside
  ops.parquet      per rank and op name from the profiled step: calls, self CPU time, total CPU time,
                   self device time (GPU kernels; 0 on a CPU), kind (compute / collective)
  collectives.parquet   the collective rows of ops.parquet
  routing.csv      MoE models: tokens routed to each expert per layer and expert-parallel rank over the measured
                   steps (workloads/routing.py's histogram format: a model.moe_routing input)
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig

if TYPE_CHECKING:  # torch: imported where a step runs, not where its results are read
    from trainsim.workloads.routing import RoutingHistogram

WARMUP, STEPS = 2, 5
SUMMARY_FILE = "summary.json"
OPS_FILE = "ops.parquet"
COLLECTIVES_FILE = "collectives.parquet"
ROUTING_FILE = "routing.csv"
NOT_MEASURED = "not measured"
OPS_COLUMNS = ["rank", "name", "kind", "calls", "self_s", "total_s", "device_s"]
FIELD_MEANINGS = {
    "status": "'measured', or 'not measured' (see reason); a not-measured artifact has no step time",
    "step_time_median_s": "median over measured steps of the slowest rank's step wall time",
    "step_time_spread_s": "interquartile range (p75 - p25) of those step times",
    "step_time_min_s": "fastest measured step", "step_time_max_s": "slowest measured step",
    "steps": "steps measured (after warmup discarded steps)", "warmup": "steps discarded",
    "step_times_s": "each measured step's time (slowest rank)",
    "ranks": "per rank: median step, compute (forward+backward minus communication), communication and "
             "per-phase wall times, and on a GPU the allocator's peak memory over the measured steps",
}


class GroundTruthError(RuntimeError):
    """A real run failed; the message carries the failing ranks' error output."""


def measurable(hw: HardwareConfig, par: ParallelismConfig) -> str | None:
    """None when `hw` is this machine and `par` fits on it, else the reason it cannot be measured."""
    if hw.device_kind == "cpu":
        return None
    if hw.device_kind == "cuda":
        import torch

        from trainsim.workloads.launch import missing_gpus
        if not torch.cuda.is_available():
            return f"hardware '{hw.name}' is {hw.device_kind} ({hw.device_name}); no such device on this machine"
        return missing_gpus(par)
    return f"hardware '{hw.name}' has device kind {hw.device_kind!r}, which cannot be run here"


def _profile_tables(prof, rank: int) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        name = event.key
        collective = name.startswith(("c10d::", "gloo:", "nccl:")) or "record_param_comms" in name
        rows.append({"rank": rank, "name": name, "kind": "collective" if collective else "compute",
                     "calls": int(event.count), "self_s": event.self_cpu_time_total / 1e6,
                     "total_s": event.cpu_time_total / 1e6,
                     "device_s": getattr(event, "self_device_time_total", 0.0) / 1e6})
    return rows


def _measured_rank(rank: int, layout, model_cfg: ModelConfig, par: ParallelismConfig, steps: int, warmup: int,
                   profile: bool) -> tuple:
    """Timed steps, then (when `profile`) one extra step under torch.profiler; returns (RankRun, op rows)."""
    import torch.distributed as dist

    from trainsim.workloads.launch import synchronize, timed_steps
    from trainsim.workloads.train_step import train_step

    rm, actions, batches, result = timed_steps(model_cfg, par, layout, rank, steps, warmup)
    ops: list[dict] = []
    if profile:
        import torch
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        on_gpu = torch.get_default_device().type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        dist.barrier()
        with torch_profile(activities=activities) as prof:
            train_step(rm, actions, batches.__getitem__)
            synchronize()
        ops = _profile_tables(prof, rank)
    return result, ops


def run_ranks(model: ModelConfig, par: ParallelismConfig, *, steps: int = STEPS, warmup: int = WARMUP,
              threads: int = 1, profile: bool = True, device_kind: str = "cpu") -> tuple[list, pd.DataFrame]:
    """Run the real steps; returns per-rank RankRun and the profiled-step op table. Raises
    GroundTruthError with each failing rank's traceback when a rank fails."""
    from trainsim.workloads.launch import RankFailure, spawn_ranks

    try:
        results = spawn_ranks(_measured_rank, par, model, par, steps, warmup, profile, threads=threads,
                              device_kind=device_kind)
    except RankFailure as exc:
        raise GroundTruthError(f"real run of {model.name} / {par.name} failed:\n{exc}") from exc
    runs = [r for r, _ in results]
    ops = pd.DataFrame([row for _, rows in results for row in rows], columns=OPS_COLUMNS)
    return runs, ops


def measure(hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig, *, steps: int = STEPS,
            warmup: int = WARMUP, profile: bool = True, routing: RoutingHistogram | None = None
            ) -> tuple[dict, pd.DataFrame]:
    """The summary (see FIELD_MEANINGS) and op table of a real run, or a not-measured summary. An MoE model's
    routing over the measured steps is added to `routing` when given."""
    from trainsim.workloads.launch import BACKENDS

    reason = measurable(hw, par)
    base = {"hardware": hw.name, "model": model.name, "parallelism": par.name, "field_meanings": FIELD_MEANINGS}
    if reason:
        return {"status": NOT_MEASURED, "reason": reason, **base}, pd.DataFrame(columns=OPS_COLUMNS)
    runs, ops = run_ranks(model, par, steps=steps, warmup=warmup, threads=hw.threads_per_device, profile=profile,
                          device_kind=hw.device_kind)
    for run in runs if routing is not None else ():
        if run.routing is not None:
            routing.merge(run.routing)
    step_times = [max(run.step_seconds[i] for run in runs) for i in range(steps)]
    q25, q75 = np.percentile(step_times, [25, 75])
    ranks = []
    for run in runs:
        phases = sorted({p for step in run.phase_seconds for p in step})
        ranks.append({
            "rank": run.rank,
            "step_median_s": statistics.median(run.step_seconds),
            "compute_median_s": statistics.median(run.compute_seconds(i) for i in range(steps)),
            "communication_median_s": statistics.median(sum(c.values()) for c in run.communication_seconds),
            "phase_median_s": {p: statistics.median(s.get(p, 0.0) for s in run.phase_seconds) for p in phases},
            "peak_memory_bytes": run.peak_memory_bytes,
        })
    summary = {
        "status": "measured", **base,
        "step_time_median_s": statistics.median(step_times), "step_time_spread_s": float(q75 - q25),
        "step_time_min_s": min(step_times), "step_time_max_s": max(step_times),
        "steps": steps, "warmup": warmup, "step_times_s": step_times,
        "world_size": par.world_size, "threads_per_rank": hw.threads_per_device,
        "backend": BACKENDS[hw.device_kind], "ranks": ranks,
    }
    return summary, ops


def write_ground_truth_artifact(hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig,
                                keys: dict[str, str], output: Path, **kwargs) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainsim.artifacts import atomic_artifact
    from trainsim.workloads.routing import RoutingHistogram

    config = {name: dataclasses.asdict(cfg) for name, cfg in (("hardware", hw), ("model", model), ("parallelism", par))}
    routing = RoutingHistogram()
    summary, ops = measure(hw, model, par, routing=routing, **kwargs)
    with atomic_artifact(Path(output), stage="ground_truth", config=config, config_keys=keys) as tmp:
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if routing.tokens:  # an MoE model: what the router did, a model.moe_routing input
            routing.write(tmp / ROUTING_FILE, f"real run of {model.name} / {par.name} on {hw.name}, "
                                              f"{summary.get('steps')} measured steps")
        ops = ops.astype({"rank": "int32", "calls": "int64", "self_s": "float64", "total_s": "float64",
                          "device_s": "float64"})
        pq.write_table(pa.Table.from_pandas(ops, preserve_index=False), tmp / OPS_FILE)
        pq.write_table(pa.Table.from_pandas(ops[ops["kind"] == "collective"], preserve_index=False),
                       tmp / COLLECTIVES_FILE)
    return summary


def read_ground_truth(path: Path) -> dict:
    """The summary of a ground-truth artifact, or a not-measured one when there is none."""
    file = Path(path) / SUMMARY_FILE
    if not file.is_file():
        return {"status": NOT_MEASURED, "reason": f"no ground-truth artifact at {path}"}
    return json.loads(file.read_text())


def error_pct(predicted_s: float, ground_truth: dict) -> float | None:
    """Signed error of a prediction, or None when the configuration was not measured (never 0)."""
    if ground_truth.get("status") != "measured":
        return None
    return 100 * (predicted_s / ground_truth["step_time_median_s"] - 1)
