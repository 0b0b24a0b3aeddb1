"""Layout search: enumerate, screen memory, estimate the rest in parallel, rank by time and by cost.

Slice costs (two small traces per tensor-parallel degree, micro-batch size and recompute mode) are
cached under artifacts/search/slices/, the profile database is the profile stage's, and the calibrated
NCCL model is used when its artifact exists, so a second search on the same model and hardware traces
and times nothing. The best layouts go into a sweep file, to be simulated with the full pipeline
(trace, profile, compose, report) by Snakemake, locally or on a cluster through its executor plugins.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from trainsim.comm.model import CommModel
from trainsim.config.compose import Run, stable_hash
from trainsim.config.framework import apply_framework
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.errors import ArtifactError, ConfigError
from trainsim.pipeline import exists
from trainsim.progress import progress
from trainsim.registry import STAGES
from trainsim.report.efficiency import TRAINING_TOTALS, efficiency, training_totals
from trainsim.search.estimate import estimate_layout
from trainsim.search.layouts import SearchSpace, enumerate_layouts
from trainsim.search.slices import SliceCosts, measure_slice_costs, slice_key
from trainsim.timeline.provenance import search_inputs
from trainsim.timeline.stage import comm_model
from trainsim.trace.stage import tracer_code_digest
from trainsim.workloads.routing import PARAMETRIC

SLICE_CACHE = Path("artifacts/search/slices")
STATUS_OK, STATUS_OOM = "ok", "oom"


@dataclass
class SearchResult:
    table: pd.DataFrame
    """one row per layout: layout fields, status, estimate, efficiency, pareto flag"""
    slices_s: float
    """wall time spent tracing and profiling slices (0 when all were cached)"""
    estimate_s: float
    """wall time of the memory screen and the estimates"""
    jobs: int
    inputs: dict = dataclasses.field(default_factory=dict)
    """what the estimates were made from, with warnings (timeline/provenance.py)"""


def cluster_for(hw: HardwareConfig, budget: int) -> HardwareConfig:
    """The hardware with enough nodes for the budget (the search's what-if node count)."""
    return dataclasses.replace(hw, num_nodes=max(hw.num_nodes, math.ceil(budget / hw.devices_per_node)))


def load_slice_costs(model: ModelConfig, layouts: list[ParallelismConfig], hw: HardwareConfig, keys: dict[str, str],
                     cache: Path = SLICE_CACHE) -> tuple[dict[str, SliceCosts], float]:
    """Slice costs for every distinct slice key of `layouts`: from the cache, else traced and profiled.

    The cache is per hardware key and model, and per content: the hardware's fields but the node count
    (an edited config file keeps its key) and the tracer's code; slices made under others are not reused."""
    started, costs = time.perf_counter(), {}
    node = dataclasses.asdict(dataclasses.replace(hw, num_nodes=1))
    content = stable_hash([node, dataclasses.asdict(model), tracer_code_digest(), SliceCosts.format_digest()])
    directory = Path(cache) / keys["hardware"] / keys["model"] / content
    database = Path(STAGES["profile"].database_path(keys))  # the profile stage's: nothing is timed twice
    first: dict[str, ParallelismConfig] = {}  # the first layout of each slice key measures it
    for par in layouts:
        first.setdefault(slice_key(par), par)
    for key, par in progress(first.items(), len(first), f"tracing and profiling {len(first)} slice(s)"):
        path = directory / f"{key}.json"
        if path.is_file():
            try:
                costs[key] = SliceCosts.from_json(path.read_text())
            except (ValueError, KeyError, TypeError) as exc:
                raise ArtifactError(f"{path} is corrupt ({exc}); delete it and the search traces the slice "
                                    "again") from exc
            continue
        costs[key] = measure_slice_costs(model, par, hw, keys["hardware"], database)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(costs[key].to_json())
        os.replace(tmp, path)  # atomic: a concurrent search reads the old or the new file, never half
    return costs, time.perf_counter() - started


_WORKER: dict = {}


def _init_worker(costs, model, hw, comm) -> None:
    _WORKER.update(costs=costs, model=model, hw=hw, comm=comm,
                   plain_hw=dataclasses.asdict(hw), plain_model=dataclasses.asdict(model))


def _evaluate(par: ParallelismConfig) -> dict:
    """One layout's row: memory screen and, when it fits, the step estimate and efficiency figures."""
    w = _WORKER
    est = estimate_layout(w["costs"][slice_key(par)], w["model"], par, w["hw"], w["comm"])
    row = {"layout": par.name, "world_size": par.world_size, "dp": par.dp, "tp": par.tp, "cp": par.cp, "pp": par.pp,
           "ep": par.ep, "etp": par.etp, "sequence_parallel": par.sequence_parallel, "zero_stage": par.zero_stage,
           "first_stage_layers": par.first_stage_layers, "last_stage_layers": par.last_stage_layers,
           "micro_batch_size": par.micro_batch_size, "num_microbatches": par.num_microbatches,
           "schedule": par.schedule, "virtual_stages": par.virtual_stages, "recompute": par.recompute,
           "peak_memory_gib": est.peak_memory_bytes / 2**30}
    if est.oom:
        return {**row, "status": STATUS_OOM}
    return {**row, "status": STATUS_OK, "step_time_s": est.step_time_s, "pipeline_s": est.pipeline_s,
            "exposed_dp_s": est.exposed_dp_s, "optimizer_s": est.optimizer_s, "tp_comm_s": est.tp_comm_s,
            "gpu_seconds_per_step": est.step_time_s * par.world_size,
            **efficiency(est.step_time_s, w["plain_hw"], w["plain_model"], dataclasses.asdict(par))}


def cost_column(table: pd.DataFrame) -> str:
    """Dollars per million tokens when the hardware has a price, else GPU-seconds per step."""
    ok = table[table["status"] == STATUS_OK]
    return "cost_per_million_tokens_usd" if ok["cost_per_million_tokens_usd"].notna().all() else \
        "gpu_seconds_per_step"


def pareto_front(table: pd.DataFrame, x: str, y: str) -> pd.Series:
    """True for rows no other row beats on both x and y (both minimised)."""
    flags = pd.Series(False, index=table.index)
    best_y = math.inf
    for index, row in table.sort_values([x, y]).iterrows():
        if row[y] < best_y:
            flags[index], best_y = True, row[y]
    return flags


def evaluate_layouts(layouts: list[ParallelismConfig], costs: dict[str, SliceCosts], model: ModelConfig,
                     hw: HardwareConfig, comm: CommModel, jobs: int = 1) -> pd.DataFrame:
    """Screen and estimate every layout, in `jobs` processes (chunks of layouts per process)."""
    description = f"estimating {len(layouts)} layouts"
    if jobs <= 1 or len(layouts) < 2 * jobs:
        _init_worker(costs, model, hw, comm)
        rows = list(progress(map(_evaluate, layouts), len(layouts), description))
    else:
        chunk = max(1, len(layouts) // (4 * jobs))
        with concurrent.futures.ProcessPoolExecutor(jobs, initializer=_init_worker,
                                                    initargs=(costs, model, hw, comm)) as pool:
            rows = list(progress(pool.map(_evaluate, layouts, chunksize=chunk), len(layouts), description))
    return pd.DataFrame(rows)


def search_layouts(run: Run, budget: int, space: SearchSpace | None = None, *, jobs: int = 1,
                   calibration_dir: Path | None = None, cache: Path = SLICE_CACHE) -> SearchResult:
    """The whole search for `run`'s model on `run`'s hardware with `budget` GPUs."""
    routing = run.model.moe_routing
    if run.model.num_experts and routing.split(":")[0] not in PARAMETRIC:  # a slice has not the file's layers
        raise ConfigError(f"the layout search takes a parametric model.moe_routing ({', '.join(PARAMETRIC)}), not "
                          f"the histogram file '{routing}': search with the skew closest to it (e.g. 'zipf:1.0'), "
                          "then compose the chosen layouts with the file (`snakemake --config sweep_file=...`)")
    space = space or SearchSpace()
    hw = cluster_for(run.hardware, budget)
    layouts = [apply_framework(run.framework, hw, run.model, par, run.explicit_fields)[2]  # e.g. buckets per dp
               for par in enumerate_layouts(run.model, run.parallelism, hw, budget, space)]
    if not layouts:
        raise ConfigError(f"no layout of {run.model.name} fits the constraints on {budget} GPUs "
                          f"(search space {space})")
    costs, slices_s = load_slice_costs(run.model, layouts, hw, run.keys, cache)
    calibrated = calibration_dir is not None and exists(calibration_dir)  # pipeline.build_point builds it
    comm = comm_model(hw, calibration_dir if calibrated else None)  # a corrupt calibration is an error
    started = time.perf_counter()
    table = evaluate_layouts(layouts, costs, run.model, hw, comm, jobs)
    estimate_s = time.perf_counter() - started
    ok = table["status"] == STATUS_OK
    table["pareto"] = False
    if ok.any():
        table.loc[ok, "pareto"] = pareto_front(table[ok], "step_time_s", cost_column(table))
        if run.train.tokens:  # the whole run at each layout's step: days, GPU-hours, cost, energy
            plain_hw = dataclasses.asdict(hw)
            totals = [training_totals(r.step_time_s, r.tokens_per_step, r.world_size, plain_hw, run.train.tokens)
                      for r in table[ok].itertuples()]
            table.loc[ok, list(TRAINING_TOTALS)] = pd.DataFrame(totals, index=table.index[ok])
    return SearchResult(table=table, slices_s=slices_s, estimate_s=estimate_s, jobs=jobs,
                        inputs=search_inputs(hw, calibration_dir if calibrated else None, budget, run.model))


def layout_overrides(row: pd.Series, num_nodes: int) -> list[str]:
    """Hydra overrides that reproduce one searched layout in the full pipeline."""
    return [f"parallelism.dp={row.dp}", f"parallelism.tp={row.tp}", f"parallelism.cp={row.cp}",
            f"parallelism.pp={row.pp}", f"parallelism.ep={row.ep}", f"parallelism.etp={row.etp}",
            f"parallelism.sequence_parallel={str(bool(row.sequence_parallel)).lower()}",
            f"parallelism.zero_stage={row.zero_stage}", f"parallelism.first_stage_layers={row.first_stage_layers}",
            f"parallelism.last_stage_layers={row.last_stage_layers}",
            "parallelism.account_for_embedding_in_pipeline_split=false",
            "parallelism.account_for_loss_in_pipeline_split=false", "parallelism.pipeline_layout=''",
            f"parallelism.micro_batch_size={row.micro_batch_size}", f"parallelism.schedule={row.schedule}",
            f"parallelism.virtual_stages={row.virtual_stages}", f"parallelism.recompute={row.recompute}",
            f"hardware.num_nodes={num_nodes}"]


def point_overrides(row: pd.Series, run: Run, budget: int) -> list[str]:
    """The whole override list of one searched layout: the run's config choices, its other overrides
    (e.g. model.moe_routing, train.tokens) and the layout's fields."""
    layout = layout_overrides(row, cluster_for(run.hardware, budget).num_nodes)
    set_here = {o.split("=")[0] for o in layout} | {"hardware", "model", "parallelism"}
    base = [f"{group}={run.choices[group]}" for group in ("hardware", "model", "parallelism")]
    return base + [o for o in run.overrides if o.split("=")[0] not in set_here] + layout


def sweep_file_text(result: SearchResult, run: Run, budget: int, top: int) -> str:
    """A sweep file (config/sweep.py format) with the `top` fastest layouts and the Pareto front."""
    ok = result.table[result.table["status"] == STATUS_OK]
    chosen = pd.concat([ok.nsmallest(top, "step_time_s"), ok[ok["pareto"]]]).drop_duplicates("layout")
    points = []
    for _, row in chosen.iterrows():
        points.append(point_overrides(row, run, budget))
    data = {"name": f"search-{run.keys['model']}-{run.keys['hardware']}-{budget}gpu", "points": points}
    return "# Layouts chosen by `trainsim search`; simulate them fully with\n" \
           f"#   snakemake --cores all --config sweep_file=<this file>\n{yaml.safe_dump(data, sort_keys=False)}"


def summary_json(result: SearchResult, budget: int) -> str:
    t = result.table
    counts = t["status"].value_counts().to_dict()
    return json.dumps({"budget_gpus": budget, "layouts": len(t), "status_counts": counts, "jobs": result.jobs,
                       "slices_s": result.slices_s, "estimate_s": result.estimate_s,
                       "layouts_per_s": len(t) / result.estimate_s if result.estimate_s else None,
                       "inputs": result.inputs}, indent=2)
