"""Memory that can be trusted: traced activations per layer against Korthikanti et al. 2022 (arXiv 2205.05198,
Table 2), and a layout search that drops layouts whose peak memory exceeds the device's."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from trainsim.config import compose_run
from trainsim.validation.activation_memory import (
    TABLE2_CASES,
    Case,
    LayerShape,
    korthikanti_bytes_per_layer,
    traced_bytes_per_layer,
)

# a s / h = 4 and s b / h = 1: the scores term (5 a s / h = 20) weighs as in a large model; tracing ~0.5 s a case
SHAPE = LayerShape(s=256, b=1, h=256, a=4)
SBH = SHAPE.s * SHAPE.b * SHAPE.h

@functools.cache
def _traced(tp: int, sequence_parallel: bool, recompute: str) -> int:
    return traced_bytes_per_layer(SHAPE, Case("test", tp, sequence_parallel, recompute))


def _formula(tp: int, sequence_parallel: bool, recompute: str) -> float:
    return korthikanti_bytes_per_layer(SHAPE, tp, sequence_parallel, recompute)


def test_formula_is_table_2():
    s, b, h, a = SHAPE.s, SHAPE.b, SHAPE.h, SHAPE.a
    assert _formula(1, False, "none") == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 4, 8):
        assert _formula(t, False, "none") == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert _formula(t, True, "none") == pytest.approx(_formula(1, False, "none") / t)
        assert _formula(t, False, "selective") == pytest.approx(s * b * h * (10 + 24 / t))
        assert _formula(t, True, "selective") == pytest.approx(34 * s * b * h / t)
    assert _formula(1, True, "none") == _formula(1, False, "none")  # sequence parallelism needs t > 1
    assert _formula(1, False, "full") == 2 * s * b * h


def test_full_recomputation_keeps_only_the_layer_input():
    assert _traced(1, False, "full") == 2 * SBH
    assert _traced(4, True, "full") == 2 * SBH / 4  # the sequence shard of the input


def test_selective_recomputation_removes_exactly_the_attention_scores():
    """Softmax output, its dropout mask and the dropped probabilities: 5 a s^2 b bytes over t ranks."""
    for sequence_parallel in (False, True):
        removed = _traced(4, sequence_parallel, "none") - _traced(4, sequence_parallel, "selective")
        assert removed == 5 * SHAPE.a * SHAPE.s ** 2 * SHAPE.b / 4


def test_sequence_parallelism_divides_the_replicated_part_by_t():
    """Norm inputs and the dropout masks after attention and MLP (10 sbh) are split over the t ranks; LayerNorm
    statistics (bf16 mean and rstd per token, left out by the paper) are too."""
    saved = _traced(4, False, "none") - _traced(4, True, "none")
    assert saved == pytest.approx(10 * SBH * (1 - 1 / 4), rel=0.01)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.label.replace(" ", "-"))
                                  for c in TABLE2_CASES if c.tp != 2])
def test_traced_activations_match_korthikanti_within_2_pct(case):
    traced = _traced(case.tp, case.sequence_parallel, case.recompute)
    formula = _formula(case.tp, case.sequence_parallel, case.recompute)
    assert abs(traced - formula) / formula <= 0.02, f"traced {traced / SBH:.3f} sbh, Table 2 {formula / SBH:.3f} sbh"


def test_search_drops_and_counts_layouts_that_do_not_fit(tmp_path, monkeypatch):
    """Llama 3 70B without tensor or pipeline parallelism needs ~1.1 TB of model states per GPU (bf16 weights and
    gradients, fp32 master weights and Adam moments): the search marks it out of memory, gives it no time, keeps
    it out of the Pareto front and the sweep file, and counts it in the summary."""
    from trainsim.config.sweep import read_sweep_file
    from trainsim.search.layouts import SearchSpace
    from trainsim.search.output import write_search_artifact
    from trainsim.search.run import STATUS_OK, STATUS_OOM, search_layouts, summary_json

    monkeypatch.chdir(tmp_path)
    run = compose_run(["hardware=h100-sxm-dgx", "model=llama3-70b", "parallelism=single",
                       "parallelism.precision=bf16", "parallelism.global_batch_size=64"], check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), recompute=("full",), tp_sizes=(1, 8),
                        min_world_size=64)
    result = search_layouts(run, 64, space, jobs=1, cache=tmp_path / "slices")
    table = result.table.set_index("layout")
    capacity_gib = run.hardware.memory_capacity_bytes / 2**30
    alone = table.loc["dp64-tp1-pp1-mbs1-1f1b-v1-full"]
    assert alone["status"] == STATUS_OOM and alone["peak_memory_gib"] > capacity_gib
    assert math.isnan(alone["step_time_s"]) and not alone["pareto"]
    oom = table[table["status"] == STATUS_OOM]
    assert (oom["peak_memory_gib"] > capacity_gib).all() and oom["step_time_s"].isna().all()
    ok = table[table["status"] == STATUS_OK]
    assert len(ok) and (ok["peak_memory_gib"] <= capacity_gib).all() and (ok["step_time_s"] > 0).all()
    counts = json.loads(summary_json(result, 64))["status_counts"]
    assert counts == {STATUS_OK: len(ok), STATUS_OOM: len(oom)}
    write_search_artifact(run, 64, space, result, tmp_path / "search", top=len(table))
    _, points = read_sweep_file(tmp_path / "search/sweep.yaml")
    chosen = {tuple(o for o in point if o.startswith(("parallelism.tp=", "parallelism.pp="))) for point in points}
    assert chosen and ("parallelism.tp=1", "parallelism.pp=1") not in chosen  # only layouts that fit


def test_step_allocations_follow_storages_until_their_last_tensor_goes():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from trainsim.trace.recorder import StepAllocations

    allocations = StepAllocations()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            keys = {t.untyped_storage()._cdata for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
            allocations.note([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)], lambda: keys)
            return out

    weight = torch.ones(250)  # made before the step: not the step's
    with Watch():
        a = weight * 2  # 1,000 bytes
        b = a + 1  # 2,000 alive
        view = b.view(25, 10)
        del a, b  # the view keeps b's storage: 1,000 alive
        kept = view.sum(0) * 0  # alive when the step ends (a state): left out
        c = view + 1  # 2,000 alive
        del view, c
        weight.mul_(1)  # in place on a storage the step did not create
    assert allocations.peak_transient_bytes() == 2000
    assert kept.numel() == 10


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallelism=pp2", "parallelism=cp2"])
def test_traced_peak_matches_the_real_run(layout):
    from trainsim.trace import trace_layout
    from trainsim.workloads.launch import measure_peak_memory
    from trainsim.workloads.train_step import layout_of

    run = compose_run(["model=gpt-small", "model.num_layers=2", layout], check="layout")
    traced = trace_layout(run.model, run.parallelism).memory.to_pandas().set_index("rank_class")["peak_bytes"]
    layout_ = layout_of(run.parallelism)
    for rank, measured in enumerate(measure_peak_memory(run.model, run.parallelism)):
        assert traced.loc[layout_.position(rank).pp_rank] == pytest.approx(measured, rel=0.03)


def test_peak_of_a_memory_record_takes_out_storages_whose_free_it_missed():
    """torch.profiler misses some frees gloo's threads perform: a storage reallocated at a live address was freed,
    so it no longer counts; a late free of it changes nothing; a free of a storage from before the record does."""
    from trainsim.workloads.launch import peak_of_memory_record

    def event(ts, addr, size, total):
        return {"ts": ts, "args": {"Addr": addr, "Bytes": size, "Total Allocated": total}}

    record = [event(0, 1, 100, 150), event(1, 2, 300, 450),  # 50 bytes held before the record
              event(2, 2, 300, 750),  # address 2 again: its first storage was freed unseen
              event(3, 9, -50, 700),  # a storage from before the record
              event(4, 2, -300, 400), event(5, 2, -300, 100),  # the late free of the first is ignored
              event(6, 3, 200, 300)]
    assert peak_of_memory_record(record) == 450  # the profiler's running total says 750
    assert peak_of_memory_record([]) == 0
