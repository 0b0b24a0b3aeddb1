"""The trace stage: trace a layout and publish graph, rank classes and memory as one artifact."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from trainsim.artifacts import atomic_artifact
from trainsim.config.schema import ModelConfig, ParallelismConfig

if TYPE_CHECKING:
    from trainsim.trace.tracer import TraceResult

GRAPH_FILE = "graph.parquet"
RANK_CLASSES_FILE = "rank_classes.parquet"
MEMORY_FILE = "memory.parquet"


@functools.lru_cache(maxsize=1)
def tracer_code_digest() -> str:
    """Hash of the code a trace depends on (the reference workload, its layout and schedules, the tracer).
    Caches outside the pipeline (the layout search's slices, the vTrain validation's traces) key on it, so a
    trace made by other code is traced again rather than reused; the pipeline's stages depend on the source
    files."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for source in sorted(p for folder in ("workloads", "parallel", "trace") for p in (package / folder).glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def write_trace_artifact(model: ModelConfig, par: ParallelismConfig, keys: dict[str, str], output: Path,
                         progress=None) -> TraceResult:
    from trainsim.trace.tracer import trace_layout  # torch: only where a trace is made

    # the tracer's code is part of what the trace depends on: `trainsim compose` traces again after an upgrade
    config = {"model": dataclasses.asdict(model), "parallelism": dataclasses.asdict(par),
              "tracer_code": tracer_code_digest()}
    with atomic_artifact(output, stage="trace", config=config, config_keys=keys) as tmp:
        result = trace_layout(model, par, progress=progress)
        pq.write_table(result.graph, tmp / GRAPH_FILE)
        pq.write_table(result.rank_classes, tmp / RANK_CLASSES_FILE)
        pq.write_table(result.memory, tmp / MEMORY_FILE)
    return result
