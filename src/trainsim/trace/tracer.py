"""Ex-situ tracing: every rank class's training step on one CPU, no cluster, no memory.

Echo's idea (arXiv 2412.12487, sec. 3): run each rank's own initialisation and step sequentially on
one device, with collectives recorded but not executed. Here the process group is torch's 'fake'
backend (a world of any size answering instantly) and every tensor is a FakeTensor (shapes and
dtypes only), so a 175B-parameter shard traces in well under a second.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainsim import processes
from trainsim.config.choices import fp8_weights_only
from trainsim.config.schema import ModelConfig, ParallelismConfig
from trainsim.errors import TraceError
from trainsim.parallel.layout import Layout
from trainsim.parallel.pipeline_split import PipelineSplit, split_of
from trainsim.parallel.schedules import combined_pairs, step_actions, trace_actions
from trainsim.trace import variants
from trainsim.trace.expand import rename_for_rank
from trainsim.trace.memory import MEMORY_SCHEMA, memory_row
from trainsim.trace.recorder import ExecutionRecorder, tensor_bytes
from trainsim.trace.schema import RANK_CLASS_SCHEMA, events_table
from trainsim.workloads.data_parallel import gradient
from trainsim.workloads.fp8 import cast_weight_bytes, fp8_weight_bytes
from trainsim.workloads.fully_sharded import gathered_weight_bytes, local
from trainsim.workloads.model import DTYPES
from trainsim.workloads.observe import observing
from trainsim.workloads.routing import PlannedCounts, RoutingPlan, model_routing_plan
from trainsim.workloads.train_step import build_rank_model, create_groups, layout_of, train_step


@dataclass
class TraceResult:
    graph: pa.Table
    rank_classes: pa.Table
    memory: pa.Table
    seconds_per_class: list[float]


def rank_class_table(layout: Layout, expert_class: list[int] | None = None) -> pa.Table:
    """rank -> class. All dp, cp and tp ranks of one pipeline stage run the same graph up to renaming (context-
    parallel ranks attend over different blocks of the sequence, of the same shapes and work), except in an MoE
    model whose routing sends different token counts from or to different ranks: expert_class[token source]
    (Layout.token_source) then splits each stage (class = pp_rank * classes per stage + expert class)."""
    expert_class = expert_class or [0] * (layout.ep * layout.etp)
    per_stage = max(expert_class) + 1
    positions = [layout.position(r) for r in range(layout.world_size)]
    return pa.table({
        "rank": [p.rank for p in positions],
        "rank_class": [p.pp_rank * per_stage + expert_class[layout.token_source(p.rank)] for p in positions],
        "dp_rank": [p.dp_rank for p in positions],
        "tp_rank": [p.tp_rank for p in positions],
        "pp_rank": [p.pp_rank for p in positions],
        "cp_rank": [p.cp_rank for p in positions],
    }, schema=RANK_CLASS_SCHEMA)


@dataclass
class _TracedStage:
    """What one traced rank yields: its events and the inputs of its memory estimate."""

    rank: int
    events: list[dict]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    saved_bytes_per_chunk: dict[int, int]
    transient_bytes: int
    changed_rows: list[int] | None = None
    """Derived from the traced step of `rank`: the rows of `events` whose values (variants.VALUE_FIELDS) differ
    from it; None: traced itself."""


@functools.cache
def _fake_kernels() -> torch.library.Library:
    """Meta kernels torch lacks for ops the workload issues. aten._scaled_mm has one, its out= variant (the FP8
    GEMMs of workloads/fp8.py that write into a buffer: the ring-overlapped tensor-parallel linears) has not,
    so under FakeTensorMode it would run the real CPU kernel on full-size tensors: seconds per GEMM. Shapes
    are checked, nothing is computed; the recorder sits above FakeTensorMode, so the trace is the same."""

    def scaled_mm_out(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                      use_fast_accum=False, *, out):
        torch._check(tuple(out.shape) == (self.shape[0], mat2.shape[1]),
                     lambda: f"_scaled_mm.out: out {tuple(out.shape)} for {tuple(self.shape)} @ {tuple(mat2.shape)}")
        return out

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_scaled_mm.out", scaled_mm_out, "Meta")
    except RuntimeError:  # a later torch registers its own
        pass
    return library


def trace_rank(model_cfg: ModelConfig, par: ParallelismConfig, rank: int,
                plan: RoutingPlan | None = None) -> _TracedStage:
    """Events and memory of one rank, traced on fake tensors inside a fake world of full size."""
    return _trace_ranks(model_cfg, par, rank, plan)[0]


def _trace_ranks(model_cfg: ModelConfig, par: ParallelismConfig, rank: int, plan: RoutingPlan | None = None,
                 others: tuple[int, ...] = ()) -> list[_TracedStage | None]:
    """Events and memory of one rank, traced on fake tensors inside a fake world of full size; then those of
    `others`, ranks of the same stage that differ from it only in their token counts, derived from its trace
    (trace/variants.py; None for one that cannot be: trace it in full)."""
    _fake_kernels()
    layout = layout_of(par)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        groups = create_groups(layout, rank, every_group=False, experts=plan is not None)
        kind = layout.token_group_kind
        routing = (PlannedCounts(plan, groups[kind], layout.token_source(rank), model_cfg.moe_force_routing, kind)
                   if plan is not None else None)
        with FakeTensorMode() as fake_mode:
            torch.manual_seed(0)
            rm = build_rank_model(model_cfg, par, rank, groups, routing)
            shape = (par.micro_batch_size, model_cfg.seq_length)
            tokens = torch.zeros(shape, dtype=torch.long)
            targets = torch.zeros(shape, dtype=torch.long)
            recorder = ExecutionRecorder(layout, rank)
            try:
                with observing(recorder), recorder:
                    actions = trace_actions(par.virtual_stages, par.moe_a2a_overlap,
                                            combined_pairs(par) if par.moe_a2a_overlap else None)
                    train_step(rm, actions, lambda microbatch: (tokens, targets))
            except (RuntimeError, ValueError, TypeError) as exc:
                raise TraceError(f"tracing the step of rank {rank} (pp_rank {layout.position(rank).pp_rank}) "
                                 f"of {model_cfg.name} with {par.name} failed: {exc}") from exc
            params = rm.parameters()
            # what the step holds beyond the micro-batch's saved activations (FSDP's gathered weights are resized
            # storages no op shows: counted from the units' sizes)
            gathered = gathered_weight_bytes(rm.chunks, par.zero_stage, DTYPES[par.precision], par.fp8_param_gather)
            traced = _TracedStage(
                rank=rank,
                events=recorder.events,
                # FP8 training keeps an FP8 copy (and its transpose) of each weight for the step; with MXFP8
                # parameters (fp8_param_gather under the distributed optimizer) the copies are the weights
                parameter_bytes=sum(tensor_bytes(local(p)) for p in params)
                + sum(fp8_weight_bytes(chunk) for chunk in rm.chunks)
                - (sum(cast_weight_bytes(chunk) for chunk in rm.chunks) if fp8_weights_only(par) else 0),
                gradient_bytes=sum(tensor_bytes(local(gradient(p))) for p in params if gradient(p) is not None),
                optimizer_state_bytes=rm.optimizer.state_bytes(),
                saved_bytes_per_chunk=dict(recorder.saved_activation_bytes),
                # what the step holds at its worst moment beyond the micro-batch's saved activations
                transient_bytes=max(recorder.allocations.peak_transient_bytes()
                                    - sum(recorder.saved_activation_bytes.values()), 0) + gathered,
            )
            if not others or plan is None:
                return [traced, *[None] * len(others)]
            tokens = int(plan.counts[0, 0].sum()) // model_cfg.moe_top_k  # a rank's tokens: each picks top-k
            # each class's exchanges have sizes of their own: caching fake ops by shape costs more than it finds
            fake_mode.cache_enabled = False
            return [traced, *_derive_others(rm, recorder, traced, others, layout, gathered, tokens)]
    finally:
        dist.destroy_process_group()


def _derive_others(rm, recorder: ExecutionRecorder, traced: _TracedStage, others: tuple[int, ...], layout: Layout,
                   gathered: int, tokens: int) -> list[_TracedStage | None]:
    """The stages of `others` from the traced one (trace/variants.py), each with the traced rank's groups; the
    MoE layers run alone on `tokens` tokens."""
    layers = variants.moe_layers(rm.chunks)
    if not any(moes for _, moes in layers) or rm.par.moe_token_dispatcher != "alltoall":
        return [None] * len(others)
    ep = next(moes[0].ep for _, moes in layers if moes)
    out: list[_TracedStage | None] = []
    try:
        base = variants.run_alone(layers, layout, traced.rank, tokens)
        for rank in others:
            with _routed_as(ep, layout, rank):
                change = variants.substitution(base, variants.run_alone(layers, layout, traced.rank, tokens))
            derived = variants.derive(recorder, change) if change is not None else None
            out.append(None if derived is None else dataclasses.replace(
                traced, events=derived.events, changed_rows=derived.changed_rows,
                saved_bytes_per_chunk=derived.saved_bytes_per_chunk,
                transient_bytes=max(derived.peak_transient_bytes - sum(derived.saved_bytes_per_chunk.values()), 0)
                + gathered))
    except (RuntimeError, ValueError, TypeError, AttributeError):  # a layer that will not run alone
        return [None] * len(others)
    return out


@contextlib.contextmanager
def _routed_as(ep, layout: Layout, rank: int):
    """The MoE layers route as `rank` does: its token source's counts, its experts."""
    previous = ep.rank, ep.etp_rank, ep.counts.source
    ep.rank, ep.etp_rank, ep.counts.source = layout.ep_rank(rank), layout.etp_rank(rank), layout.token_source(rank)
    try:
        yield
    finally:
        ep.rank, ep.etp_rank, ep.counts.source = previous


def _trace_group(model_cfg: ModelConfig, par: ParallelismConfig, ranks: list[int],
                 plan: RoutingPlan | None) -> list[_TracedStage]:
    """The stages of `ranks` (one stage, different token counts): the first traced, the others derived from it
    where they can be, else traced."""
    stages = _trace_ranks(model_cfg, par, ranks[0], plan, tuple(ranks[1:]) if DERIVE_CLASSES else ())
    stages += [None] * (len(ranks) - len(stages))
    return [stage or trace_rank(model_cfg, par, rank, plan) for stage, rank in zip(stages, ranks)]


def layer_kind(model_cfg: ModelConfig, layer: int) -> str:
    """What a layer builds, as far as its ops go: its hybrid kind (model.hybrid_layer_pattern), whether it has
    experts, and its attention window."""
    pattern = model_cfg.hybrid_layer_pattern
    return (pattern[layer] if pattern else "") + ("e" if model_cfg.has_experts(layer) else "") + \
        f"w{model_cfg.window_of(layer)}"


def _stage_shape(model_cfg: ModelConfig, split: PipelineSplit, pp_rank: int) -> tuple:
    """Stages with the same shape build the same layers up to their indices: whether they hold the embedding and
    the loss, and per chunk the kind of each of its layers (an uneven or explicit split gives middle stages
    different chunks; a hybrid model or a mixture of experts' first dense layers, different layers)."""
    chunks = [split.layers(pp_rank, c) for c in range(split.virtual_stages)]
    return (split.holds_embedding(pp_rank, 0), split.holds_loss(pp_rank, split.virtual_stages - 1),
            tuple(tuple(layer_kind(model_cfg, layer) for layer in layers) for layers in chunks))


def expert_classes(plan: RoutingPlan | None, ep: int, etp: int = 1) -> list[int]:
    """Class within a stage of each token source (Layout.token_source): ranks that send and receive the same
    token counts share one (all of them under balanced routing)."""
    if plan is None:
        return [0] * (ep * etp)
    seen: dict[bytes, int] = {}
    return [seen.setdefault(plan.rank_signature(r, ep, etp), len(seen)) for r in range(ep * etp)]


DERIVE_CLASSES = True
"""Classes of one stage that differ only in their token counts are derived from one traced step (trace/variants.py);
False traces each of them in full (what the derivation is checked against)."""

PARALLEL_MIN_TRACES = 16
"""From this many distinct traces on (a skewed MoE routing: one per stage and expert-parallel rank), they run in
worker processes: their fork server (trainsim/processes.py) first imports torch for seconds, which fewer traces
do not repay."""


def _start_traces(model_cfg: ModelConfig, par: ParallelismConfig, plan: RoutingPlan | None,
                  todo: dict[tuple, int], jobs: int):
    """shape -> a zero-argument function giving its _TracedStage. The shapes of one stage (the same first
    element: they differ only in their token counts) are traced together (_trace_group), in `jobs` spawned
    processes where there are many, else when asked."""
    groups: dict = collections.defaultdict(list)
    for shape, rep in todo.items():
        groups[shape[0]].append((shape, rep))
    jobs = min(jobs or os.cpu_count() or 1, len(groups))
    pool = None
    if jobs >= 2 and len(todo) >= PARALLEL_MIN_TRACES:
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=processes.context())
    calls = {}
    for members in groups.values():
        ranks = [rep for _, rep in members]
        if pool is not None:
            result = pool.submit(_trace_group, model_cfg, par, ranks, plan).result
        else:
            result = functools.cache(functools.partial(_trace_group, model_cfg, par, ranks, plan))
        for index, (shape, _) in enumerate(members):
            calls[shape] = functools.partial(lambda result, index: result()[index], result, index)
    return calls, pool


def _with_rows(table: pa.Table, rows: list[int], columns: dict[str, list]) -> pa.Table:
    """`table` with `columns`' values at `rows` (in order) in place of its own."""
    if not rows:
        return table
    at = np.arange(table.num_rows)
    at[rows] = table.num_rows + np.arange(len(rows))
    at = pa.array(at)
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        column = table.column(i).combine_chunks()
        table = table.set_column(i, table.field(i),
                                 pa.concat_arrays([column, pa.array(values, type=column.type)]).take(at))
    return table


def _class_table(stage: _TracedStage, tables: dict[int, pa.Table], layout: Layout, representative: int,
                 class_id: int) -> pa.Table:
    """The graph rows of class `class_id` (represented by `representative`) from `stage`: a derived stage's are
    the table of its traced step (`tables`, by rank: kept there) with its changed rows, not a table of its own
    events (a thousand classes' worth of DataFrames); then renamed to the representative's groups and peers."""
    table = tables.get(stage.rank) if stage.changed_rows is not None else None
    if table is None:
        table = events_table(pd.DataFrame(stage.events), rank_class=class_id)
        if stage.changed_rows is None:
            tables[stage.rank] = table
    else:
        rows = stage.changed_rows
        table = _with_rows(table, rows, {field: [stage.events[row][field] for row in rows]
                                         for field in variants.VALUE_FIELDS})
    if stage.rank != representative:
        rows = np.flatnonzero(table["group_kind"].is_valid().to_numpy(zero_copy_only=False)).tolist()
        comm = table.select(["group_kind", "group_ranks", "peer"]).take(rows).to_pandas()
        renamed = rename_for_rank(comm, layout, stage.rank, representative)
        table = _with_rows(table, rows, {"group_ranks": list(renamed["group_ranks"]), "peer": list(renamed["peer"])})
    return table.set_column(0, "rank_class", pa.array(np.full(table.num_rows, class_id, dtype=np.int32)))


def trace_layout(model_cfg: ModelConfig, par: ParallelismConfig, progress=None, jobs: int = 0) -> TraceResult:
    """Trace one representative rank per class; `progress(done, total)` is called after each class.

    Classes are pipeline stages (their schedules differ), split by expert-parallel rank where an MoE model's
    routing plan gives ranks different token counts. Middle stages build identical layers, so one of them is
    traced and the others get its events with groups and peers renamed. The expert classes of a stage run the
    same ops on other sizes: one is traced, the others are derived from it (trace/variants.py). Many distinct
    traces run in `jobs` processes (0: one per core; see PARALLEL_MIN_TRACES).
    """
    if dist.is_initialized():
        raise TraceError("ex-situ tracing needs its own (fake) process group; call it in a process where "
                         "torch.distributed is not initialised")
    layout = layout_of(par)
    plan = model_routing_plan(model_cfg, par)
    expert_class = expert_classes(plan, par.ep, par.etp)
    per_stage = max(expert_class) + 1
    same_layers = plan is None or bool((plan.counts == plan.counts[:1]).all())
    split = split_of(model_cfg, par)
    classes = [(pp_rank, cls, layout.stage_representative(pp_rank) + expert_class.index(cls),
                # stages hold different layers: with a routing that varies by layer, no middle stage is another's
                # nor with a hybrid model's layer kinds that differ between them
                (_stage_shape(model_cfg, split, pp_rank) if same_layers else pp_rank, cls))
               for pp_rank in range(par.pp) for cls in range(per_stage)]
    todo: dict[tuple, int] = {}
    for _, _, representative, shape in classes:
        todo.setdefault(shape, representative)
    traces, pool = _start_traces(model_cfg, par, plan, todo, jobs)
    uses = collections.Counter(shape for *_, shape in classes)
    traced: dict[tuple, _TracedStage] = {}
    tables: dict[int, pa.Table] = {}  # rank -> the table of its traced step
    graphs, memories, seconds = [], [], []
    try:
        for pp_rank, cls, representative, shape in classes:
            start = time.perf_counter()
            stage = traced.get(shape) or traces.pop(shape)()  # (a stage's traces go with its last call)
            uses[shape] -= 1
            if uses[shape]:  # kept for the classes that reuse it
                traced[shape] = stage
            else:
                traced.pop(shape, None)
            class_id = pp_rank * per_stage + cls
            graphs.append(_class_table(stage, tables, layout, representative, class_id))
            memories.append(memory_row(
                class_id,
                parameter_bytes=stage.parameter_bytes,
                gradient_bytes=stage.gradient_bytes,
                optimizer_state_bytes=stage.optimizer_state_bytes,
                saved_bytes_per_chunk=stage.saved_bytes_per_chunk,
                actions=step_actions(par, pp_rank),
                transient_bytes=stage.transient_bytes,
            ))
            seconds.append(time.perf_counter() - start)
            if progress:
                progress(class_id + 1, par.pp * per_stage)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return TraceResult(
        graph=pa.concat_tables(graphs),
        rank_classes=rank_class_table(layout, expert_class),
        memory=pa.Table.from_pylist(memories, schema=MEMORY_SCHEMA),
        seconds_per_class=seconds,
    )
