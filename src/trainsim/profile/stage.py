"""The kernel-profile stage: every distinct compute op of the traces gets a solo time on the hardware.

Only signatures the database lacks for this hardware are measured (or computed analytically);
everything else is reused, unless `remeasure` asks for every signature to be timed again (the machine
changed: a driver or clock update, or a shared VM whose speed drifts and must be timed in the state the
prediction is compared in); the new rows supersede the old ones in the database. Ops that cannot be
replayed fall back to the analytical model, and the reason is kept in the row. New rows are appended
in batches, so an interrupted run keeps its work.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from trainsim.artifacts import atomic_artifact, read_table
from trainsim.config.choices import MEASURED_BACKENDS
from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError, ReplayError
from trainsim.profile.analytical import fit_rates, op_kind, predict, predict_rows
from trainsim.profile.database import PROFILE_SCHEMA, ProfileDatabase, now_utc, tool_versions_json
from trainsim.progress import tracked
from trainsim.trace.stage import GRAPH_FILE

OP_COLUMNS = ["signature", "op", "input_shapes", "input_strides", "input_dtypes", "op_args", "flops", "bytes_moved"]
PROFILE_FILE = "kernels.parquet"
SUMMARY_FILE = "summary.json"
# set: ops timed together
BATCH_SIZE = 50  # ops timed together (interleaved) and appended together


@dataclass
class ProfileSummary:
    backend: str
    distinct: int = 0
    reused: int = 0
    measured: int = 0
    analytical: int = 0
    fallback: list[dict] = field(default_factory=list)
    """Ops that could not be measured: {op, signature, reason}."""

    def as_dict(self) -> dict:
        return {**self.__dict__, "fallback_count": len(self.fallback)}


def distinct_ops(graph: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct signature of a compute op or copy (memcpy) that launches a kernel."""
    compute = graph[graph["kind"].isin(("compute", "memcpy")) & ~graph["no_kernel"]]
    return compute.drop_duplicates("signature")[OP_COLUMNS].reset_index(drop=True)


def local_device_kind() -> str:
    import torch  # seconds to import: only where ops are measured or a backend chosen by what is present

    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_backend(hw: HardwareConfig) -> str:
    """'cpu' or 'cuda' (measure here) or 'analytical', from hardware.profile_backend."""
    if hw.profile_backend == "analytical":
        return "analytical"
    local = local_device_kind()
    if hw.profile_backend == "measure":
        if hw.device_kind != local:
            raise ConfigError(f"hardware.profile_backend='measure' needs a {hw.device_kind} device, but this machine "
                              f"has {local} only; use profile_backend=analytical or import a database measured there")
        return local
    if hw.profile_backend == "auto":
        return local if hw.device_kind == local else "analytical"
    raise ConfigError(f"hardware.profile_backend={hw.profile_backend!r}; accepted: auto, measure, analytical")


def _row(op: pd.Series, hardware_key: str, backend: str, median_s: float, **extra) -> dict:
    row = {c: op[c] for c in OP_COLUMNS}
    row.update(hardware=hardware_key, backend=backend, median_s=float(median_s), spread=0.0, min_s=float(median_s),
               repeats=0, threads=0, kernels="[]", metrics="{}", fallback_reason=None, source="measured here",
               measured_at=now_utc(), tool_versions=tool_versions_json())
    row.update(extra)
    return row


def _measure_batch(ops: pd.DataFrame, hw: HardwareConfig, hardware_key: str, backend: str,
                   summary: ProfileSummary, progress: Callable[[float, float], None] | None = None) -> list[dict]:
    """Measure a batch of ops (CPU: interleaved rounds, co-located on the node's devices; GPU: one op at a
    time, its inputs freed before the next is built); unreplayable ones go to summary.fallback.
    `progress(done, total)` follows the timing loop (op timings done of all of the batch)."""
    import torch

    from trainsim.profile.measure import CacheFlush, time_cpu_colocated, time_cuda
    from trainsim.profile.replay import build_call

    def built(op) -> Callable[[], Any] | None:
        try:
            return build_call(op.to_dict(), device=backend)
        except ReplayError as exc:
            summary.fallback.append({"op": op["op"], "signature": op["signature"], "reason": str(exc)})
            return None

    metrics: dict = {}
    measurable, timings = [], []
    if backend == "cpu":
        calls = []
        for _, op in ops.iterrows():
            if (call := built(op)) is not None:
                calls.append(call)
                measurable.append(op)
        if not calls:
            return []
        devices = hw.devices_per_node if hw.colocated_profiling else 1
        metrics["colocated_devices"] = devices
        rows = [op[OP_COLUMNS].to_dict() for op in measurable]
        timings = time_cpu_colocated(rows, calls, devices, hw.threads_per_device, hw.cold_cache_profiling,
                                     progress=progress)
    else:
        flush = CacheFlush(backend, hw.cold_cache_profiling)
        for done, (_, op) in enumerate(ops.iterrows(), 1):
            if (call := built(op)) is not None:
                timings.append(time_cuda(call, flush=flush))
                measurable.append(op)
                del call  # its inputs go before the next op's are built
                torch.cuda.empty_cache()  # and their blocks: a large op later needs them contiguous
            if progress:
                progress(done, len(ops))
    metrics["cold_cache"] = hw.cold_cache_profiling
    return [_row(op, hardware_key, backend, t.median_s, spread=t.spread, min_s=t.min_s, repeats=t.repeats,
                 threads=hw.threads_per_device, kernels=json.dumps(t.kernels),
                 metrics=json.dumps({**metrics, **t.metrics}))
            for op, t in zip(measurable, timings)]


def _analytical_times(ops: pd.DataFrame, hw: HardwareConfig, measured: pd.DataFrame) -> np.ndarray:
    """Roofline times from the hardware's rates, or, where it has none (a CPU), from rates fitted to
    the ops measured on it."""
    try:
        return predict_rows(ops, hw)
    except ConfigError as missing_rates:
        if len(measured) < 6:
            raise ConfigError(f"{missing_rates}; with fewer than 6 measured ops on this hardware nothing to fit "
                              "instead") from missing_rates
        rates = fit_rates(measured)
        return predict(rates, ops["flops"], ops["bytes_moved"], ops["op"].map(op_kind))


def profile_ops(ops: pd.DataFrame, hw: HardwareConfig, hardware_key: str, db: ProfileDatabase,
                progress=None, remeasure: bool = False) -> tuple[pd.DataFrame, ProfileSummary]:
    """Fill `db` for the signatures of `ops` it lacks (all of them with `remeasure`); return the rows
    of all of them and a summary."""
    backend = choose_backend(hw)
    known = db.read()
    known = known[known["hardware"] == hardware_key]
    if remeasure:
        known = known[~known["signature"].isin(set(ops["signature"]))]
    missing = ops[~ops["signature"].isin(set(known["signature"]))].reset_index(drop=True)
    summary = ProfileSummary(backend=backend, distinct=len(ops), reused=len(ops) - len(missing))

    new_rows: list[dict] = []
    if backend in MEASURED_BACKENDS:
        import torch

        torch.set_num_threads(hw.threads_per_device)
        with tracked(f"timing {len(missing)} op(s) on {hardware_key} ({backend})", len(missing)) as bar:
            for start in range(0, len(missing), BATCH_SIZE):  # each batch is appended as soon as it is timed
                batch = missing.iloc[start:start + BATCH_SIZE]
                n = len(batch)
                rows = _measure_batch(batch, hw, hardware_key, backend, summary,
                                      lambda done, total, start=start, n=n: bar(start + n * done / total))
                db.append(pd.DataFrame(rows))
                new_rows += rows
                bar(start + n)
                if progress:
                    progress(min(start + BATCH_SIZE, len(missing)), len(missing))
        summary.measured = len(new_rows)
        model_ops = missing[missing["signature"].isin({f["signature"] for f in summary.fallback})]
    else:
        model_ops = missing

    if len(model_ops):
        measured = pd.concat([known, pd.DataFrame(new_rows, columns=PROFILE_SCHEMA.names)], ignore_index=True)
        measured = measured[measured["backend"].isin(MEASURED_BACKENDS)]
        times = _analytical_times(model_ops, hw, measured)
        reasons = {f["signature"]: f["reason"] for f in summary.fallback}
        rows = [_row(op, hardware_key, "analytical", t, fallback_reason=reasons.get(op["signature"]))
                for (_, op), t in zip(model_ops.iterrows(), times)]
        db.append(pd.DataFrame(rows))
        new_rows += rows
        summary.analytical = len(rows)

    rows = pd.concat([known, pd.DataFrame(new_rows, columns=PROFILE_SCHEMA.names)], ignore_index=True)
    rows = rows[rows["signature"].isin(set(ops["signature"]))]
    return rows.reset_index(drop=True)[PROFILE_SCHEMA.names], summary


def write_profile_artifact(hw: HardwareConfig, keys: dict[str, str], trace_dir: Path, database: Path,
                           output: Path, progress=None, remeasure: bool = False) -> ProfileSummary:
    """Profile the ops of one trace artifact into `database` and publish this run's rows."""
    graph = read_table(trace_dir, GRAPH_FILE).to_pandas()
    config = {"hardware": dataclasses.asdict(hw)}
    with atomic_artifact(output, stage="profile", config=config, config_keys=keys, inputs=[trace_dir]) as tmp:
        rows, summary = profile_ops(distinct_ops(graph), hw, keys["hardware"], ProfileDatabase(database), progress,
                                    remeasure)
        pq.write_table(pa.Table.from_pandas(rows, schema=PROFILE_SCHEMA, preserve_index=False), tmp / PROFILE_FILE)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    return summary
