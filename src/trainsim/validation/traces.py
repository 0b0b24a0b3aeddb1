"""The validation's one trace cache: ex-situ traces of published rows (vTrain's and the scaling tables'),
keyed by content, traced once and read once per process.

A published row is a config no conf/ file names, so its trace has no registry key (pipeline.py caches the
named points' traces at registry.STAGES' paths); it is keyed here by the row's model and layout (the global
batch aside: it only changes the number of micro-batches) and the tracer's code (trace.stage.tracer_code_digest),
so a row traced by other code is traced again. Each entry holds the trace stage's graph and rank-class tables.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.trace.stage import GRAPH_FILE, RANK_CLASSES_FILE, tracer_code_digest

TRACE_CACHE = Path("artifacts/validation/traces")
"""Where the rows' traces are cached, relative to the working directory (as artifacts/ is)."""


def trace_directory(model: ModelConfig, par: ParallelismConfig, cache: Path = TRACE_CACHE) -> Path:
    """The cache entry of one row's trace (traced or not): a hash of the model, the layout without its global
    batch, and the tracer's code."""
    key = json.dumps([dataclasses.asdict(model), dataclasses.asdict(dataclasses.replace(par, global_batch_size=0)),
                      tracer_code_digest()], sort_keys=True)
    return cache / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def trace_into(job: tuple[ModelConfig, ParallelismConfig, str]) -> str:
    """Trace one (model, layout, directory) job unless its directory holds the trace; returns the directory.
    The entry is written beside it and renamed into place, so a reader never sees half of one, and of two
    writers of one entry the first to finish is kept. (One tuple argument: the job a process pool maps.)"""
    from trainsim.trace import trace_layout  # torch: only where a trace is made

    model, par, out = job
    out = Path(out)
    if not (out / GRAPH_FILE).is_file():
        result = trace_layout(model, par)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # one per writer: two may trace the same row
        tmp.mkdir(parents=True, exist_ok=True)
        pq.write_table(result.graph, tmp / GRAPH_FILE)
        pq.write_table(result.rank_classes, tmp / RANK_CLASSES_FILE)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / GRAPH_FILE).is_file():
                raise
            shutil.rmtree(tmp)  # another writer published the same trace first
    return str(out)


def trace_jobs(jobs: list[tuple], cache: Path = TRACE_CACHE, workers: int = 2) -> None:
    """Trace each (model, parallelism, directory) job into `cache`, on `workers` processes when there are several."""
    if not jobs:
        return
    cache.mkdir(parents=True, exist_ok=True)
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(trace_into, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    else:
        for job in jobs:
            trace_into(job)


def traced(model: ModelConfig, par: ParallelismConfig, cache: Path = TRACE_CACHE) -> Path:
    """The cache entry of one row's trace, traced first when it is missing."""
    return Path(trace_into((model, par, str(trace_directory(model, par, cache)))))


def is_traced(directory: Path) -> bool:
    return (Path(directory) / GRAPH_FILE).is_file()


@functools.lru_cache(maxsize=256)
def trace_tables(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(graph, rank classes, distinct ops) of one cached trace, read once per process for all the fits'
    predictions (a fit covers ~115 traces; callers must not modify the frames)."""
    from trainsim.profile.stage import distinct_ops

    graph = pq.read_table(directory / GRAPH_FILE).to_pandas()
    return graph, pq.read_table(directory / RANK_CLASSES_FILE).to_pandas(), distinct_ops(graph)


def analytical_step(directory: Path, par: ParallelismConfig, hw: HardwareConfig, comm, slowdown):
    """The composed step of one cached trace with every kernel timed by the analytical model of `hw`, its
    collectives by `comm` and its overlap slowdown by `slowdown` (fitting.pipeline_slowdown: what a compose on
    that hardware applies; no default, so no caller scores another model than users run)."""
    from trainsim.profile.analytical import predict_rows as analytical
    from trainsim.timeline.compose import compose_step

    graph, rank_classes, ops = trace_tables(directory)
    times = dict(zip(ops["signature"], analytical(ops, hw)))
    return compose_step(graph, rank_classes, par, hw, times, comm, slowdown)
