"""Layout search: enumeration, the pipeline played out, agreement with the full composer, the artifact."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pandas as pd
import pytest

from trainsim.config import compose_run
from trainsim.config.sweep import read_sweep_file
from trainsim.errors import ArtifactError, ConfigError
from trainsim.report.browser import broken_elements, render_report
from trainsim.search.estimate import estimate_layout, play_pipeline
from trainsim.search.layouts import SearchSpace, enumerate_layouts
from trainsim.search.output import SECTIONS, write_search_artifact
from trainsim.search.run import (
    STATUS_OK,
    cluster_for,
    cost_column,
    layout_overrides,
    load_slice_costs,
    pareto_front,
    search_layouts,
)
from trainsim.workloads.routing import RoutingHistogram

SMALL = ["hardware=a100-80g-dgx", "model=gpt-small", "parallelism=dp2", "parallelism.global_batch_size=16"]
SPACE = SearchSpace(micro_batch_sizes=(1, 2), recompute=("none", "full"))


def test_enumeration_is_valid_and_bounded():
    run = compose_run(SMALL, check="layout")
    hw = cluster_for(run.hardware, 16)
    layouts = enumerate_layouts(run.model, run.parallelism, hw, 16, SPACE)
    assert {p.world_size for p in layouts} == {16, 8}  # the budget and its halvings down to one node
    assert all(p.tp <= hw.devices_per_node and run.model.num_attention_heads % p.tp == 0 for p in layouts)
    assert all(run.model.num_layers % (p.pp * p.virtual_stages) == 0 for p in layouts)
    assert all(p.global_batch_size % (p.micro_batch_size * p.dp) == 0 for p in layouts)
    assert {p.schedule for p in layouts} == {"1f1b", "interleaved-1f1b"}
    assert len({p.name for p in layouts}) == len(layouts)


@pytest.mark.parametrize("space, field", [(dict(schedules=("zigzag",)), "schedules"),
                                          (dict(recompute=("most",)), "recompute"),
                                          (dict(micro_batch_sizes=(0,)), "micro-batch sizes")])
def test_bad_search_space_is_named(space, field):
    with pytest.raises(ConfigError, match=field):
        SearchSpace(**space)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_pipeline_played_out_matches_the_textbook_bubble(schedule, v):
    pp, m, f, b = 4, 8, 1.0, 2.0  # per stage and micro-batch, split evenly over v chunks
    forward = {(s, c): f / v for s in range(pp) for c in range(v)}
    backward = {(s, c): b / v for s in range(pp) for c in range(v)}
    ends, _, _ = play_pipeline(forward, backward, 0.0, pp, v, schedule, m)
    # Narayanan et al. 2021 sec. 2.2: (m + (p - 1) / v) (f + b) with equal stages and free P2P
    assert max(ends) == pytest.approx((m + (pp - 1) / v) * (f + b))


@pytest.mark.parametrize("schedule, v, pp", [("1f1b", 1, 2), ("1f1b", 1, 8), ("interleaved-1f1b", 2, 4),
                                             ("interleaved-1f1b", 3, 8)])
def test_long_pipelines_are_extrapolated_exactly(schedule, v, pp):
    from trainsim.search.estimate import play_schedule

    m = 12 * pp  # uneven stages and a P2P cost: the periodic steady state still holds
    forward = {(s, c): (1.0 + 0.3 * s) / v for s in range(pp) for c in range(v)}
    backward = {(s, c): (2.0 + 0.5 * (s == pp - 1)) / v for s in range(pp) for c in range(v)}
    fast = play_pipeline(forward, backward, 0.05, pp, v, schedule, m)
    exact = play_schedule(forward, backward, 0.05, pp, v, schedule, m)
    for got, want in zip(fast, exact, strict=True):
        assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("pp, schedule, v", [(1, "1f1b", 1), (4, "1f1b", 1), (4, "interleaved-1f1b", 2)])
def test_overlapped_all_to_alls_hide_under_the_paired_pass(pp, schedule, v):
    """moe_a2a_overlap: the extra warm-up costs no time (at most a P2P latency, as a combined pass receives both its
    inputs first; interleaved, the order it gives is even a little faster here); each combined pass is shorter by
    its halves' all-to-alls, as far as the other half's compute lasts; long pipelines are still extrapolated
    exactly."""
    from trainsim.search.estimate import play_schedule

    m = 12 * max(pp, 2)
    chunks = [(s, c) for s in range(pp) for c in range(v)]
    forward = {(s, c): (1.0 + 0.2 * s) / v for s, c in chunks}
    backward = {(s, c): 2.0 / v for s, c in chunks}
    plain = max(play_pipeline(forward, backward, 0.05, pp, v, schedule, m)[0])
    hidden = {(kind, s, c): 0.0 for kind in "FB" for s, c in chunks}
    reordered = max(play_pipeline(forward, backward, 0.05, pp, v, schedule, m, exchange_s=hidden)[0])
    assert plain * 0.98 < reordered <= plain + 0.05 + 1e-9
    exchange = {(kind, s, c): 0.3 / v for kind in "FB" for s, c in chunks}
    fast = play_pipeline(forward, backward, 0.05, pp, v, schedule, m, exchange_s=exchange)
    exact = play_schedule(forward, backward, 0.05, pp, v, schedule, m, exchange_s=exchange)
    for got, want in zip(fast, exact, strict=True):
        assert got == pytest.approx(want, rel=1e-9)
    pairs = m - 1 if pp == 1 else None  # (pp = 1: one pass per micro-batch, all but the first and last combined)
    if pairs:
        assert max(fast[0]) == pytest.approx(plain - pairs * 0.6, rel=1e-9)
    assert max(fast[0]) < plain


def _scratch_search(tmp_path_factory, overrides: list[str], space: SearchSpace, jobs: int):
    """One search on 16 GPUs in a scratch directory (its profile database and slice cache stay out of the
    checkout): (run, result, slice cache)."""
    run = compose_run(overrides, check="layout")
    workdir = tmp_path_factory.mktemp("search")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        yield run, search_layouts(run, 16, space, jobs=jobs, cache=workdir / "slices"), workdir / "slices"


@pytest.fixture(scope="module")
def small_search(tmp_path_factory):
    yield from _scratch_search(tmp_path_factory, SMALL, SPACE, jobs=2)


@pytest.mark.slow
def test_search_ranks_layouts_and_a_second_search_traces_nothing(small_search):
    run, result, cache = small_search
    table = result.table
    assert set(table["status"]) <= {STATUS_OK, "oom"} and (table["status"] == STATUS_OK).any()
    ok = table[table["status"] == STATUS_OK]
    assert (ok["step_time_s"] > 0).all() and (ok["mfu_pct"] > 0).all() and ok["pareto"].any()
    front = ok[ok["pareto"]].sort_values("step_time_s")
    assert front["cost_per_million_tokens_usd"].is_monotonic_decreasing  # a front trades time for cost
    with pytest.MonkeyPatch.context() as patch:  # "traces nothing": measuring a slice now fails the test
        patch.setattr("trainsim.search.run.measure_slice_costs", lambda *a, **k: pytest.fail("a slice was re-traced"))
        again = search_layouts(run, 16, SPACE, jobs=1, cache=cache)
    pd.testing.assert_frame_equal(again.table, table)  # parallel and serial give the same answer
    cached = sorted(cache.rglob("*.json"))[0]
    text = cached.read_text()
    cached.write_text(text[: len(text) // 2])  # a half-written cache file is reported, not silently redone
    with pytest.raises(ArtifactError, match=f"{cached.name} is corrupt"):
        search_layouts(run, 16, SPACE, jobs=1, cache=cache)
    cached.write_text(text)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2-tp2-pp2-mbs1-1f1b-v1-none", "dp1-tp2-pp4-mbs2-1f1b-v1-full",
                                    "dp4-tp1-pp2-mbs2-interleaved-1f1b-v2-none"])
def test_fast_path_agrees_with_the_full_composer(small_search, layout, tmp_path):
    run, result, cache = small_search
    row = result.table.set_index("layout").loc[layout]
    summary, memory = _compose_fully(SMALL + layout_overrides(row, cluster_for(run.hardware, 16).num_nodes), tmp_path)
    assert row["step_time_s"] == pytest.approx(summary["step_time_s"], rel=0.10)
    # the fast path takes a stage's transient bytes from its 1- and 2-layer slices (one replica)
    assert row["peak_memory_gib"] * 2**30 == pytest.approx(memory["peak_bytes"].max(), rel=0.02)
    assert summary["num_microbatches"] == row["num_microbatches"]


def _compose_fully(run_overrides: list[str], tmp_path):
    """Trace, profile and compose one layout as the pipeline does: (step summary, memory table)."""
    from trainsim.profile.stage import write_profile_artifact
    from trainsim.timeline.stage import write_timeline_artifact
    from trainsim.trace.stage import write_trace_artifact

    full = compose_run(run_overrides)
    write_trace_artifact(full.model, full.parallelism, full.keys, tmp_path / "trace")
    write_profile_artifact(full.hardware, full.keys, tmp_path / "trace", tmp_path / "db", tmp_path / "profile")
    summary = write_timeline_artifact(full.hardware, full.model, full.parallelism, full.keys,
                                      {"trace": tmp_path / "trace", "profile": tmp_path / "profile"}, tmp_path / "tl")
    return summary, pd.read_parquet(tmp_path / "trace/memory.parquet")


MOE_SMALL = ["hardware=a100-80g-dgx", "model=gpt-small", "model.num_layers=11", "model.num_experts=8",
             "model.moe_top_k=2", "model.moe_first_dense_layers=1", "parallelism=dp2",
             "parallelism.global_batch_size=16"]
MOE_SPACE = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), recompute=("none",), tp_sizes=(1, 2),
                        zero_stages=(0, 1, 3))


@pytest.fixture(scope="module")
def moe_search(tmp_path_factory):
    yield from _scratch_search(tmp_path_factory, MOE_SMALL, MOE_SPACE, jobs=1)


@pytest.mark.slow
def test_search_enumerates_expert_parallelism_with_its_memory(moe_search):
    """Every divisor of the expert count that folds into a stage is tried, each with expert tensor parallelism 1 and
    the layout's tp; tensor parallelism comes with sequence parallelism (Megatron-Core requires it with experts);
    splitting the experts, or each expert, frees their memory."""
    run, result, _ = moe_search
    table = result.table.set_index("layout")
    assert set(table["ep"]) == {1, 2, 4, 8} and table[table["tp"] > 1]["sequence_parallel"].all()
    assert set(table["etp"]) == {1, 2} and (table[table["etp"] > 1]["tp"] == 2).all()
    folded = table["ep"] * table["etp"]
    assert (table["dp"] * table["tp"] % folded == 0).all()
    split = table.loc["dp8-tp2-ep4-etp2-pp1-mbs1-1f1b-v1-none-zero0", "peak_memory_gib"]
    assert split < table.loc["dp8-tp2-ep4-pp1-mbs1-1f1b-v1-none-zero0", "peak_memory_gib"]
    memory = table.loc[[f"dp8-tp2{ep}-pp1-mbs1-1f1b-v1-none-zero0" for ep in ("", "-ep2", "-ep4", "-ep8")],
                       "peak_memory_gib"]
    assert memory.is_monotonic_decreasing and memory.iloc[-1] < 0.8 * memory.iloc[0]
    sharded = table.loc["dp8-tp2-ep4-pp1-mbs1-1f1b-v1-none-zero1", "peak_memory_gib"]
    assert sharded < table.loc["dp8-tp2-ep4-pp1-mbs1-1f1b-v1-none-zero0", "peak_memory_gib"]


def test_search_refuses_a_routing_histogram_file_and_says_what_it_takes(tmp_path):
    histogram = RoutingHistogram()
    for layer in range(1, 11):
        histogram.add(layer, 0, [5, 1, 1, 1, 1, 1, 1, 1])
    histogram.write(tmp_path / "routing.csv", "a test")
    run = compose_run([*MOE_SMALL, f"model.moe_routing={tmp_path / 'routing.csv'}"], check="layout")
    with pytest.raises(ConfigError, match="parametric model.moe_routing .*zipf:1.0"):
        search_layouts(run, 16, MOE_SPACE)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp4-tp1-ep4-pp2-last5-mbs1-1f1b-v1-none-zero0",
                                    "dp8-tp2-ep8-pp1-mbs1-1f1b-v1-none-zero1",
                                    "dp8-tp2-ep4-etp2-pp1-mbs1-1f1b-v1-none-zero1"])
def test_fast_path_agrees_with_the_full_composer_on_experts(moe_search, layout, tmp_path):
    """Token all-to-alls, grouped GEMMs at the layout's sizes, the dense first layer, expert gradients reduced
    over the expert replicas and their states sharded there, expert tensor parallelism, 11 layers as 6 + 5: the
    estimate follows the composed step."""
    run, result, _ = moe_search
    row = result.table.set_index("layout").loc[layout]
    summary, memory = _compose_fully(MOE_SMALL + layout_overrides(row, cluster_for(run.hardware, 16).num_nodes),
                                     tmp_path)
    assert row["step_time_s"] == pytest.approx(summary["step_time_s"], rel=0.10)
    assert row["peak_memory_gib"] * 2**30 == pytest.approx(memory["peak_bytes"].max(), rel=0.02)


@pytest.mark.slow
def test_fast_path_memory_with_fsdp_shards_experts_over_their_replicas(moe_search, tmp_path):
    """FSDP with experts: expert weights, gradients and states sharded over the expert replicas, the rest over dp,
    the root unit and two blocks gathered at once; the estimate's peak is the traced one. (Its step time hides
    FSDP's gathers more than the composer does: docs/search.md.)"""
    run, result, _ = moe_search
    row = result.table.set_index("layout").loc["dp16-tp1-ep4-pp1-mbs1-1f1b-v1-none-zero3"]
    _, memory = _compose_fully(MOE_SMALL + layout_overrides(row, cluster_for(run.hardware, 16).num_nodes), tmp_path)
    assert row["peak_memory_gib"] * 2**30 == pytest.approx(memory["peak_bytes"].max(), rel=0.02)


@pytest.fixture(scope="module")
def skewed_moe_search(tmp_path_factory):
    space = dataclasses.replace(MOE_SPACE, tp_sizes=(1,), zero_stages=(0,), ep_sizes=(4,))
    yield from _scratch_search(tmp_path_factory, [*MOE_SMALL, "model.moe_routing=zipf:1.0"], space, jobs=1)


@pytest.mark.slow
def test_fast_path_takes_each_layer_at_its_busiest_expert_rank(skewed_moe_search, moe_search, tmp_path):
    """Zipf-skewed routing: every all-to-all waits for the rank whose experts got the most tokens, so the estimate
    prices each layer as that rank runs it, and follows the composed step (a rank class per ep rank there)."""
    run, result, _ = skewed_moe_search
    layout = "dp4-tp1-ep4-pp2-last5-mbs1-1f1b-v1-none-zero0"
    row = result.table.set_index("layout").loc[layout]
    # the busiest rank has more tokens, so the skewed step is slower; only a little at this size, whose expert GEMMs
    # are launch-bound (matmul_half_flops 6.3 GFLOP, fitted to single-GPU kernels)
    assert row["step_time_s"] > moe_search[1].table.set_index("layout").loc[layout, "step_time_s"]
    summary, memory = _compose_fully([*MOE_SMALL, "model.moe_routing=zipf:1.0"]
                                     + layout_overrides(row, cluster_for(run.hardware, 16).num_nodes), tmp_path)
    assert row["step_time_s"] == pytest.approx(summary["step_time_s"], rel=0.10)
    # memory: every layer at its busiest rank's activations, more than any one rank holds (hot experts move from
    # layer to layer): an upper bound, +10 % here
    assert memory["peak_bytes"].max() <= row["peak_memory_gib"] * 2**30 <= 1.15 * memory["peak_bytes"].max()


@pytest.mark.slow
def test_search_artifact_page_and_sweep_file(small_search, tmp_path, chromium):
    run, result, _ = small_search
    write_search_artifact(run, 16, SPACE, result, tmp_path / "search", top=3)
    name, points = read_sweep_file(tmp_path / "search/sweep.yaml")
    assert name == "search-gpt-small-a100-80g-dgx-16gpu" and len(points) >= 3
    for point in points:  # every chosen layout is a valid full-pipeline run
        assert compose_run(point).parallelism.world_size <= 16
    summary = json.loads((tmp_path / "search/summary.json").read_text())
    assert summary["layouts"] == len(result.table)
    assert len(pd.read_csv(tmp_path / "search/layouts.csv")) == len(result.table)
    rendered = render_report(tmp_path / "search/search.html", browser=chromium)
    assert broken_elements(rendered, SECTIONS) == []
    assert {"step-time-heatmap", "memory-heatmap", "pareto-figure"} <= {img["id"] for img in rendered["images"]}


def _layout_table() -> pd.DataFrame:
    """A search table on 16 GPUs as search_layouts writes it: every (tp, pp, dp) at two micro-batch sizes;
    tp1 pp1 does not fit, and the larger micro-batch is faster but needs more memory (tp2 pp1 mbs2 OOM)."""
    rows = []
    for tp, pp, dp, mbs in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2)):
        if tp * pp * dp > 16:
            continue
        memory = 90 / (tp * pp) * (1 + 0.9 * (mbs - 1))
        row = {"layout": f"dp{dp}-tp{tp}-pp{pp}-mbs{mbs}", "world_size": tp * pp * dp, "dp": dp, "tp": tp, "cp": 1,
               "pp": pp, "micro_batch_size": mbs, "peak_memory_gib": memory, "status": "oom" if memory > 80 else "ok"}
        if memory <= 80:
            step = (tp * pp * dp) ** -0.8 * (1.1 if mbs == 1 else 1.0) * (1.2 if pp > 1 else 1.0)
            row.update(step_time_s=step, gpu_seconds_per_step=step * tp * pp * dp,
                       cost_per_million_tokens_usd=step * tp * pp * dp / 3)
        rows.append(row)
    table = pd.DataFrame(rows)
    ok = table["status"] == STATUS_OK
    table["pareto"] = False
    table.loc[ok, "pareto"] = pareto_front(table[ok], "step_time_s", cost_column(table))
    return table


def test_grid_cells_hold_the_fastest_layout_that_fits():
    from trainsim.report.layout_grid import grid_cells

    table = _layout_table()
    cells = grid_cells(table).set_index(["row", "dp"])
    assert len(cells) == len(table.groupby(["tp", "pp", "dp"]))
    ok = table[table["status"] == STATUS_OK]
    for (tp, pp, dp), part in ok.groupby(["tp", "pp", "dp"]):
        cell = cells.loc[(f"tp{tp} pp{pp}", dp)]
        assert cell["step_time_s"] == part["step_time_s"].min() and not cell["oom"]
    assert cells.loc[("tp2 pp1", 4), "layout"] == "dp4-tp2-pp1-mbs1"  # mbs2 is faster but does not fit
    assert cells.loc[("tp2 pp1", 4), "peak_memory_gib"] == 45  # the memory of the layout the cell shows
    tp1 = cells.loc["tp1 pp1"]
    assert tp1["oom"].all() and tp1["step_time_s"].isna().all() and (tp1["peak_memory_gib"] == 90).all()


def test_search_page_draws_the_grid_and_marks_the_fastest_and_cheapest(tmp_path, chromium):
    from trainsim.search.output import chosen_layouts, pareto_figure, render_search_page
    from trainsim.search.run import SearchResult

    table = _layout_table()
    chosen = chosen_layouts(table)
    ok = table[table["status"] == STATUS_OK]
    assert chosen["fastest"]["step_time_s"] == ok["step_time_s"].min()
    assert chosen["cheapest"]["cost_per_million_tokens_usd"] == ok["cost_per_million_tokens_usd"].min()
    ax = pareto_figure(table).axes[0]
    assert [t.get_text() for t in ax.texts] == ["fastest", "cheapest"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[2].startswith(f"fastest: {chosen['fastest']['layout']} (")
    assert legend[3].startswith(f"cheapest: {chosen['cheapest']['layout']} (")
    run = compose_run(SMALL)
    page = tmp_path / "search.html"
    page.write_text(render_search_page(run, 16, SearchResult(table, 0.0, 0.1, 1)))
    rendered = render_report(page, browser=chromium)
    assert broken_elements(rendered, SECTIONS) == []
    assert {"step-time-heatmap", "memory-heatmap", "pareto-figure"} <= {img["id"] for img in rendered["images"]}
    assert page.read_text().count("<figcaption") == 3 and "not measured" in page.read_text()


def test_pipeline_depths_that_do_not_divide_the_layers_get_lighter_end_stages():
    """DeepSeek-V3's 61 layers: its own 16 stages of 4 layers with 1 on the last are searched, as a run would
    configure them (first/last_stage_layers); interleaving needs an even split, so it is not tried there."""
    run = compose_run(["hardware=h800-dgx", "model=deepseek-v3", "parallelism=ep64-pp16-dp128"], check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), recompute=("none",), tp_sizes=(1,), ep_sizes=(64,),
                        min_world_size=2048)
    layouts = {p.name: p for p in enumerate_layouts(run.model, run.parallelism, cluster_for(run.hardware, 2048),
                                                    2048, space)}
    own = layouts["dp128-tp1-ep64-pp16-last1-mbs1-1f1b-v1-none"]
    assert (own.first_stage_layers, own.last_stage_layers) == (0, 1)
    # pp 1: 2,048 replicas do not divide the batch of 15,360; pp 32: 61 layers cannot be 2 per stage less 1 at each end
    assert {p.pp for p in layouts.values()} == {2, 4, 8, 16}
    assert not any(p.last_stage_layers and p.schedule == "interleaved-1f1b" for p in layouts.values())
    assert all(p.last_stage_layers for p in layouts.values() if p.pp > 1)  # 61 is prime


def test_uneven_end_stages_are_interleaved_where_megatron_splits_them():
    """Llama 3.1 405B on 16 stages: 8 layers each, 6 on the last, also as 2 virtual stages (6 and 8 divide by 2),
    not as 4 (6 does not); the base's own split (embedding and loss counted as layers) is not carried over."""
    run = compose_run(["hardware=h100-sxm-dgx", "model=llama3.1-405b", "parallelism=tp8-sp-pp16-vp4-dp128"],
                      check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), recompute=("full",), tp_sizes=(8,), virtual_stages=(2, 4),
                        min_world_size=16384)
    layouts = enumerate_layouts(run.model, run.parallelism, cluster_for(run.hardware, 16384), 16384, space)
    pp16 = {(p.schedule, p.virtual_stages, p.last_stage_layers) for p in layouts if p.pp == 16}
    assert pp16 == {("1f1b", 1, 6), ("interleaved-1f1b", 2, 6)}
    assert not any(p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
                   for p in layouts)


def test_oom_layouts_are_screened_before_timing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp16-tp8-dp8"], check="layout")
    layouts = [p for p in enumerate_layouts(run.model, run.parallelism, cluster_for(run.hardware, 8), 8,
                                            SearchSpace(micro_batch_sizes=(1,), recompute=("full",),
                                                        schedules=("1f1b",)))
               if p.tp == 8 and p.pp == 1]
    assert layouts  # 175B on one 8-GPU node cannot hold its weights
    costs, _ = load_slice_costs(run.model, layouts[:1], run.hardware, run.keys, cache=tmp_path / "slices")
    screen = estimate_layout(costs[next(iter(costs))], run.model, layouts[0], run.hardware, None, memory_only=True)
    assert screen.oom and screen.peak_memory_bytes > run.hardware.memory_capacity_bytes



def test_slice_cache_is_not_reused_after_the_hardware_or_tracer_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-tiny", "parallelism=single"], check="layout")
    cache = tmp_path / "slices"

    def cached_after(hw) -> int:
        load_slice_costs(run.model, [run.parallelism], hw, run.keys, cache=cache)
        return len(list(cache.rglob("*.json")))

    assert cached_after(run.hardware) == 1
    assert cached_after(cluster_for(run.hardware, 64)) == 1  # the node count does not change a slice
    assert cached_after(dataclasses.replace(run.hardware, host_dispatch_s=1e-5)) == 2  # an edited config file
    monkeypatch.setattr("trainsim.search.run.tracer_code_digest", lambda: "edited workload")
    assert cached_after(run.hardware) == 3


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_in_flight_activations_peak_within_four_rounds(schedule, v):
    from trainsim.parallel.schedules import pipeline_actions
    from trainsim.trace.memory import peak_inflight_activation_bytes

    pp, saved = 8, {c: 100 + 7 * c for c in range(v)}
    for stage in range(pp):
        full = peak_inflight_activation_bytes(pipeline_actions(schedule, pp, stage, 40 * pp, v), saved)
        capped = peak_inflight_activation_bytes(pipeline_actions(schedule, pp, stage, 4 * pp, v), saved)
        assert capped == full


@pytest.mark.slow
def test_search_command_writes_the_artifact(tmp_path, monkeypatch, capsys):
    from trainsim.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["search", "hardware=a100-80g-dgx", "model=gpt-tiny", "--gpus", "8", "--micro-batch-sizes", "1",
            "--schedules", "1f1b", "--recompute", "none", "--jobs", "1", "--top", "2"]
    assert main(args) == 0
    out = tmp_path / "artifacts/search/a100-80g-dgx/gpt-tiny/8gpu"
    assert {"layouts.parquet", "layouts.csv", "search.html", "sweep.yaml", "summary.json", "manifest.json"} <= {
        p.name for p in out.iterdir()}
    printed = capsys.readouterr().out
    assert "layouts/s" in printed and "calibration: data/nccl-tests/" in printed  # built, used and named
    inputs = json.loads((out / "summary.json").read_text())["inputs"]
    assert inputs["calibration"]["calibrated"] and not inputs["slowdown"]["modelled"]
    assert main([*args[:-6], "--schedules", "zigzag"]) == 2  # a bad search space is an error, not a crash


def test_fast_path_bounds_each_pass_by_host_dispatch():
    from trainsim.comm.model import CommModel
    from trainsim.search.slices import PartCost, SliceCosts

    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-tiny", "parallelism=single"], check="layout")
    model, par = run.model, run.parallelism
    layer = PartCost(forward_s=1.0, backward_s=2.0, optimizer_s=0.1,
                     host_ops={"forward": 10, "backward": 20, "optimizer": 5})
    costs = SliceCosts(layer=layer, first=PartCost(), last=PartCost(), p2p_message_bytes=0,
                       first_transient_bytes=[0, 0], last_transient_bytes=[0, 0])
    hw = dataclasses.replace(run.hardware, memory_capacity_bytes=0)
    m, layers = par.num_microbatches, model.num_layers
    device_bound = estimate_layout(costs, model, par, hw, CommModel.from_hardware(hw))
    assert device_bound.step_time_s == pytest.approx(m * layers * 3.0 + layers * 0.1)
    host = dataclasses.replace(hw, host_dispatch_s=1.0)  # every pass and the optimizer wait for the host
    host_bound = estimate_layout(costs, model, par, host, CommModel.from_hardware(host))
    assert host_bound.step_time_s == pytest.approx(m * layers * 30.0 + layers * 5.0)
    # the host runs ahead of the device: a forward the host binds (2 s to issue, 1 s to run) lets the device
    # catch up with the backward's issue (1 s) while that runs (3 s), so a micro-batch takes 4 s a layer, not 5
    mixed = dataclasses.replace(costs, layer=dataclasses.replace(
        layer, forward_s=1.0, backward_s=3.0, host_ops={"forward": 20, "backward": 10, "optimizer": 5}))
    host = dataclasses.replace(hw, host_dispatch_s=0.1)
    run_ahead = estimate_layout(mixed, model, par, host, CommModel.from_hardware(host))
    assert run_ahead.step_time_s == pytest.approx((4 * m + 1) * layers + layers * 0.5)


def test_fast_path_adds_the_noise_wait_before_each_tensor_parallel_collective():
    from trainsim.search.estimate import pass_collective_seconds

    class Comm:  # 1 ms per collective; the last rank arrives 10 % of a segment late
        def collective_seconds(self, collective, message_bytes, num_ranks, num_nodes):
            return 1e-3

        def sync_wait_s(self, segment_s, num_ranks):
            return 0.1 * segment_s

    # 4 collectives after 0.5 s of compute each
    assert pass_collective_seconds({"all_reduce:1024": 3, "all_gather:64": 1}, Comm(), 2, 1, 2.0) == \
        pytest.approx(4e-3 + 4 * 0.05)


def test_plan_says_what_to_change_when_no_layout_fits(tmp_path, monkeypatch):
    from trainsim.search.plan import make_plan

    monkeypatch.chdir(tmp_path)
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp16-tp8-dp8"], check="layout")
    space = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), recompute=("full",))
    with pytest.raises(ConfigError, match=r"none of the \d+ layouts of gpt-175b fits in memory on 8 x a100-80g-dgx "
                                          r"\(least peak \d+ GiB per GPU\); try more GPUs than --gpus 8, "
                                          r"--zero-stages 0 1 3$"):
        make_plan(run, 8, space)


def test_plan_takes_the_cheapest_layout_that_meets_the_deadline():
    from trainsim.search.plan import choose

    table = _layout_table()
    ok = table["status"] == STATUS_OK
    table.loc[ok, "training_days"] = table.loc[ok, "step_time_s"] * 10.0  # days grow with the step
    fastest, cheapest = choose(table, "time"), choose(table, "cost")
    assert fastest["step_time_s"] == table.loc[ok, "step_time_s"].min()
    assert cheapest["cost_per_million_tokens_usd"] == table.loc[ok, "cost_per_million_tokens_usd"].min()
    deadline = (fastest["training_days"] + cheapest["training_days"]) / 2  # the cheapest is too slow for it
    assert cheapest["training_days"] > deadline
    chosen = choose(table, "cost", deadline)
    meets = table[ok & (table["training_days"] <= deadline)]
    assert chosen["layout"] == meets.loc[meets["cost_per_million_tokens_usd"].idxmin(), "layout"]
    assert choose(table, "time", deadline)["layout"] == fastest["layout"]
    assert fastest["training_days"] > 0.5
    with pytest.raises(ConfigError, match=rf"trains within 0.5 days: the fastest, {fastest['layout']}, takes "):
        choose(table, "cost", 0.5)


def test_a_confidence_of_meeting_the_deadline_takes_a_layout_with_room_to_spare():
    from trainsim.search.plan import choose

    table = _layout_table()
    ok = table["status"] == STATUS_OK
    table.loc[ok, "training_days"] = table.loc[ok, "step_time_s"] * 10.0
    cheapest = choose(table, "cost")
    deadline = cheapest["training_days"] * 1.1  # the cheapest meets it by its estimate, not with 20 % to spare
    assert choose(table, "cost", deadline)["layout"] == cheapest["layout"]
    sure = choose(table, "cost", deadline, days_factor=1.2)
    assert sure["layout"] != cheapest["layout"] and sure["training_days"] * 1.2 <= deadline
    with pytest.raises(ConfigError, match=r"x1.20 for the confidence asked"):
        choose(table, "cost", table.loc[ok, "training_days"].min() * 1.1, days_factor=1.2)
