"""Timeline composer: hand-computable steps, outputs a user opens, plug-ins, and a real trace end to end.

Hand-made graphs use kernels named after their duration key (signature = op name), a table of
collective times, and zero-cost or fixed P2P, so every expected step time below is worked out by hand.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from trainsim.config.schema import HardwareConfig, ParallelismConfig, StragglerConfig
from trainsim.parallel.layout import Layout
from trainsim.parallel.schedules import pipeline_actions
from trainsim.timeline import (
    ConstantSlowdown,
    TableComm,
    TimelineError,
    compose_step,
    register_dependency_rule,
    register_schedule,
)
from trainsim.timeline.chrome import chrome_trace
from trainsim.timeline.engine import replay, replay_batched
from trainsim.timeline.outputs import SUMMARY_FIELDS, breakdown, class_table, summary
from trainsim.trace.schema import GRAPH_SCHEMA
from trainsim.trace.stage import tracer_code_digest

HW = HardwareConfig(name="test", device_kind="cuda", devices_per_node=8, memory_capacity_bytes=1e9)


def _event(rank_class: int, i: int, phase: str, op: str, *, kind: str = "compute", per_mb: bool = True,
           collective: str | None = None, group_kind: str | None = None, group: list[int] | None = None,
           peer: int = -1, deps: tuple[int, ...] = (), chunk: int = 0) -> dict:
    return {"rank_class": rank_class, "id": i, "phase": phase, "chunk": chunk, "microbatch": 0,
            "per_microbatch": per_mb, "kind": kind, "stream": "compute" if kind == "compute" else f"comm.{group_kind}",
            "op": op, "input_shapes": "[]", "input_strides": "[]", "input_dtypes": "", "op_args": "{}",
            "signature": op, "no_kernel": False, "flops": 1, "bytes_moved": 1, "collective": collective,
            "group_kind": group_kind, "group_ranks": group, "message_bytes": 1 << 20, "comm_dtype": None,
            "peer": peer, "async_op": False, "deps": list(deps)}


def _graph(events: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(events)[GRAPH_SCHEMA.names]


def _rank_classes(layout: Layout) -> pd.DataFrame:
    pos = [layout.position(r) for r in range(layout.world_size)]
    return pd.DataFrame({"rank": [p.rank for p in pos], "rank_class": [p.pp_rank for p in pos],
                         "dp_rank": [p.dp_rank for p in pos], "tp_rank": [p.tp_rank for p in pos],
                         "pp_rank": [p.pp_rank for p in pos]})


def _par(dp=1, tp=1, pp=1, microbatches=1, schedule="1f1b") -> ParallelismConfig:
    return ParallelismConfig(name="test", dp=dp, tp=tp, pp=pp, micro_batch_size=1,
                             global_batch_size=microbatches * dp, schedule=schedule)


def _compose(events, par, hw=HW, times=None, comm=None, **kw):
    layout = Layout(par.dp, par.tp, par.pp)
    times = times or {"F": 1.0, "B": 2.0, "B1": 1.0, "B2": 1.0, "div": 0.0, "OPT": 0.1, "A": 1.0}
    return compose_step(_graph(events), _rank_classes(layout), par, hw, times,
                        comm or TableComm({"all_reduce": 0.5}), **kw)


def _data_parallel_events(dp: int) -> list[dict]:
    """F; backward B1 -> bucket 1 all-reduce, B2 -> bucket 2 all-reduce; optimizer waits for both."""
    group = list(range(dp))
    return [
        _event(0, 0, "forward", "F"),
        _event(0, 1, "backward", "B1"),
        _event(0, 2, "backward", "div", per_mb=False, deps=(1,)),
        _event(0, 3, "backward", "ar", kind="collective", per_mb=False, collective="all_reduce", group_kind="dp",
               group=group, deps=(2,)),
        _event(0, 4, "backward", "B2", deps=(1,)),
        _event(0, 5, "backward", "div", per_mb=False, deps=(4,)),
        _event(0, 6, "backward", "ar", kind="collective", per_mb=False, collective="all_reduce", group_kind="dp",
               group=group, deps=(5,)),
        _event(0, 7, "optimizer", "OPT", per_mb=False, deps=(3, 6)),
    ]


def _pipeline_events(pp: int) -> list[dict]:
    """Equal stages: forward F = 1 s, backward B = 2 s, activations and gradients sent between stages."""
    events = []
    for s in range(pp):
        group, i, ev = list(range(pp)), 0, []
        for phase, op, src, dst in (("forward", "F", s - 1, s + 1), ("backward", "B", s + 1, s - 1)):
            first = i
            if 0 <= src < pp:
                ev.append(_event(s, i, phase, "recv", kind="p2p", collective="recv", group_kind="pp", group=group,
                                 peer=src))
                i += 1
            ev.append(_event(s, i, phase, op, deps=(first,) if i > first else ()))
            i += 1
            if 0 <= dst < pp:
                ev.append(_event(s, i, phase, "send", kind="p2p", collective="send", group_kind="pp", group=group,
                                 peer=dst, deps=(i - 1,)))
                i += 1
        events += ev
    return events


def _assert_breakdown_adds_up(t) -> pd.DataFrame:
    parts = breakdown(t)
    # the last two: parts of the others (optimizer tail) or of communication time (NIC contention), not added
    total = parts.drop(columns=["rank_class", "end_s", "optimizer_step_s", "contention_added_s"]).sum(axis=1)
    np.testing.assert_allclose(total, t.step_time_s, rtol=1e-9, atol=1e-12)
    assert (parts["optimizer_step_s"] <= total + 1e-12).all()
    return parts


def test_pure_data_parallel_step_is_compute_plus_the_exposed_all_reduce_tail():
    t = _compose(_data_parallel_events(dp=2), _par(dp=2, microbatches=2))
    # two micro-batches: (F + B1 + B2) x 2 = 6 s compute, optimizer 0.1 s; bucket 1's all-reduce hides behind
    # B2 of the last backward, bucket 2's (0.5 s) is the exposed tail before the optimizer.
    assert t.step_time_s == pytest.approx(6.0 + 0.5 + 0.1)
    parts = _assert_breakdown_adds_up(t).iloc[0]
    assert parts["compute_s"] == pytest.approx(6.1)
    assert parts["exposed_dp_s"] == pytest.approx(0.5)
    assert parts["pipeline_bubble_s"] == pytest.approx(0.0) and parts["idle_s"] == pytest.approx(0.0)
    assert parts["optimizer_step_s"] == pytest.approx(0.5 + 0.1)  # the exposed bucket tail, then the update


def test_identical_ranks_wait_for_the_noise_of_the_compute_since_their_last_synchronisation():
    comm = TableComm({"all_reduce": 0.5}, wait_per_compute_s=0.2)
    t = _compose(_data_parallel_events(dp=2), _par(dp=2, microbatches=2), comm=comm)
    # each bucket follows 1 s of backward compute since the pass began or since the previous bucket:
    # 0.5 + 0.2 s each; bucket 2 ends at 6 + 0.7, then the optimizer
    assert t.step_time_s == pytest.approx(6.0 + 0.7 + 0.1)
    assert _compose(_data_parallel_events(dp=1), _par(dp=1, microbatches=2), comm=comm).step_time_s == \
        pytest.approx(6.1)  # one rank waits for nobody


def test_overlap_slowdown_stretches_only_the_overlapped_fraction_and_converges():
    t = _compose(_data_parallel_events(dp=2), _par(dp=2, microbatches=2), slowdown=ConstantSlowdown(0.5))
    # B2 of the last backward (t0 = 1 s) overlaps bucket 1's 0.5 s all-reduce: r = 0.5 / (1 * 1.5) = 1/3 of
    # its work runs at 1/1.5 speed, so t = (1 - r) t0 + r t0 (1 + s) = 2/3 + 1/3 * 1.5 = 7/6 s. Nothing else overlaps.
    assert t.step_time_s == pytest.approx(6.6 + 1 / 6)
    assert t.converged and t.iterations == 2
    assert breakdown(t).iloc[0]["slowdown_added_s"] == pytest.approx(1 / 6)
    # the returned timeline is a fixed point: replaying its durations gives the same step
    assert replay(t.graph, t.duration_s).step_time_s == pytest.approx(t.step_time_s)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_bubble_fraction_with_equal_stages(schedule):
    p, m = 4, 8
    t = _compose(_pipeline_events(p), _par(pp=p, microbatches=m, schedule=schedule), comm=TableComm({}, p2p_s=0.0))
    assert t.step_time_s == pytest.approx((m + p - 1) * 3.0)
    parts = _assert_breakdown_adds_up(t)
    np.testing.assert_allclose(parts["pipeline_bubble_s"] / t.step_time_s, (p - 1) / (m + p - 1))
    np.testing.assert_allclose(parts["compute_s"], m * 3.0)


def test_p2p_transfer_time_shows_as_exposed_pipeline_communication():
    p, m = 4, 8
    events = _pipeline_events(p)
    t = _compose(events, _par(pp=p, microbatches=m), comm=TableComm({}, p2p_s=0.01))
    assert t.step_time_s > (m + p - 1) * 3.0
    assert (breakdown(t)["exposed_pp_s"] > 0).all()


def test_a_collective_waits_for_its_slowest_member():
    events = [_event(0, 0, "forward", "A"),
              _event(0, 1, "forward", "ar", kind="collective", collective="all_reduce", group_kind="tp",
                     group=[0, 1], deps=(0,)),
              _event(0, 2, "forward", "A", deps=(1,))]
    fast = _compose(events, _par(tp=2))
    assert fast.step_time_s == pytest.approx(2.5) and fast.classes.count == 1
    hw = HardwareConfig(name="test", device_kind="cuda", devices_per_node=8, memory_capacity_bytes=1e9,
                        stragglers=[StragglerConfig(ranks=[1], factor=2.0)])
    t = _compose(events, _par(tp=2), hw=hw)
    assert t.classes.count == 2 and list(t.classes.class_of_rank) == [0, 1]
    collective = t.graph.table.kind[t.graph.tnode] == 2
    # rank 0 arrives at 1 s, rank 1 at 2 s: both start the all-reduce at 2 s
    np.testing.assert_allclose(t.replay.start_s[collective], 2.0)
    assert t.step_time_s == pytest.approx(2 + 0.5 + 2)
    assert breakdown(t).set_index("rank_class").loc[0, "end_s"] == pytest.approx(3.5)


def test_a_straggler_delays_its_whole_data_parallel_group():
    events = [_event(0, 0, "forward", "F"), _event(0, 1, "backward", "B"),
              _event(0, 2, "backward", "div", per_mb=False, deps=(1,)),
              _event(0, 3, "backward", "ar", kind="collective", per_mb=False, collective="all_reduce",
                     group_kind="dp", group=[0, 1, 2, 3], deps=(2,)),
              _event(0, 4, "optimizer", "OPT", per_mb=False, deps=(3,))]
    comm = TableComm({"all_reduce": 0.3})
    assert _compose(events, _par(dp=4), comm=comm).step_time_s == pytest.approx(3.4)
    hw = HardwareConfig(name="test", device_kind="cuda", devices_per_node=8, memory_capacity_bytes=1e9,
                        stragglers=[StragglerConfig(ranks=[2], factor=1.5)])
    t = _compose(events, _par(dp=4), hw=hw, comm=comm)
    assert t.classes.count == 2 and list(t.classes.size) == [3, 1]
    ends = breakdown(t).set_index("rank_class")["end_s"]
    assert ends[0] == pytest.approx(4.5 + 0.3 + 0.1)  # healthy ranks wait for rank 2's backward
    assert ends[1] == pytest.approx(4.5 + 0.3 + 0.15)
    parts = _assert_breakdown_adds_up(t).set_index("rank_class")
    assert parts.loc[0, "pipeline_bubble_s"] == pytest.approx(1.5)  # waiting inside the pipeline phase


def test_a_straggler_node_splits_classes_only_where_timing_differs():
    from trainsim.timeline.classes import straggler_factors, timeline_classes

    layout = Layout(dp=4, tp=2, pp=2)
    hw = HardwareConfig(name="t", devices_per_node=2, stragglers=[StragglerConfig(node=0, factor=1.3)])
    classes = timeline_classes(_rank_classes(layout), layout, straggler_factors(hw, layout.world_size))
    # node 0 = ranks 0, 1 (stage 0, dp 0): per stage the slow dp replica, the rest of stage 0, the
    # pipeline peers of the slow node in stage 1, and the rest of stage 1
    assert classes.count == 4
    assert sorted(classes.size.tolist()) == [2, 2, 6, 6]
    with pytest.raises(ValueError, match="outside"):
        straggler_factors(HardwareConfig(name="t", devices_per_node=2, stragglers=[StragglerConfig(ranks=[99])]),
                          16)


def test_plug_in_schedule_and_dependency_rule():
    register_schedule("test-gpipe-copy", lambda pp, rank, m, v: pipeline_actions("gpipe", pp, rank, m, v))
    p, m = 4, 8
    t = _compose(_pipeline_events(p), _par(pp=p, microbatches=m), comm=TableComm({}), schedule="test-gpipe-copy")
    assert t.step_time_s == pytest.approx((m + p - 1) * 3.0)
    with pytest.raises(ValueError, match="test-gpipe-copy"):
        _compose(_pipeline_events(p), _par(pp=p, microbatches=m), schedule="no-such-schedule")

    def synchronous_dp(ops: pd.DataFrame) -> np.ndarray:
        """Every compute op waits for the DP all-reduces issued before it (no overlap at all)."""
        dp = np.flatnonzero((ops["group_kind"] == "dp").to_numpy())
        compute = np.flatnonzero((ops["kind"] == "compute").to_numpy())
        return np.asarray([(a, c) for a in dp for c in compute if c > a], dtype=np.int64).reshape(-1, 2)

    register_dependency_rule("test-synchronous-dp", synchronous_dp)
    t = _compose(_data_parallel_events(dp=2), _par(dp=2, microbatches=2),
                 rules=("data", "call_point", "blocking_comm", "test-synchronous-dp"))
    assert t.step_time_s == pytest.approx(6.0 + 0.5 + 0.5 + 0.1)


@pytest.mark.parametrize("parallelism", ["dp2", "pp2", "pp2-interleaved"])
def test_batched_replay_gives_the_heap_replay_times(tiny_traces, parallelism):
    """Graphs of many classes are replayed in rounds of ready nodes (engine.replay_batched): same starts and
    ends as node by node, with host dispatch, stragglers (cross-class waits) and pipeline P2P."""
    from trainsim.comm.model import CommModel
    from trainsim.timeline.compose import host_issue

    run, graph, rank_classes = tiny_traces[parallelism]
    hw = dataclasses.replace(run.hardware, stragglers=[StragglerConfig(ranks=[1], factor=1.3)],
                             host_dispatch_s=2e-5)  # a host issue time, which a100-80g-dgx no longer sets
    t = compose_step(graph, rank_classes, run.parallelism, hw, _flop_times, CommModel.from_hardware(hw))
    host = host_issue(t.graph, hw.host_dispatch_s)
    heap, batched = replay(t.graph, t.duration_s, host=host), replay_batched(t.graph, t.duration_s, host=host)
    assert t.classes.count > 1 and host is not None
    np.testing.assert_array_equal(heap.start_s, batched.start_s)
    np.testing.assert_array_equal(heap.end_s, batched.end_s)
    assert (heap.cause == batched.cause).mean() > 0.99  # ties between predecessors may name the other one


def test_batched_replay_reports_a_cyclic_wait():
    events = [_event(0, 0, "forward", "F"),
              _event(0, 1, "forward", "ar", kind="collective", collective="all_reduce", group_kind="dp",
                     group=[0, 1], deps=(0,))]
    hw = HardwareConfig(name="test", device_kind="cuda", devices_per_node=8, memory_capacity_bytes=1e9,
                        stragglers=[StragglerConfig(ranks=[1], factor=1.5)])
    t = _compose(events, _par(dp=2), hw=hw)
    assert len(t.graph.group_size)
    graph = dataclasses.replace(t.graph, group_size=t.graph.group_size + 1)  # a member that never comes
    with pytest.raises(TimelineError, match="cyclic wait"):
        replay_batched(graph, t.duration_s)


def test_unmatched_communication_is_reported_with_the_classes():
    events = [e for e in _pipeline_events(2) if not (e["rank_class"] == 1 and e["op"] == "send")]
    with pytest.raises(TimelineError, match="unmatched communication"):
        _compose(events, _par(pp=2, microbatches=2), comm=TableComm({}))


def test_summary_chrome_trace_and_oom_verdict():
    t = _compose(_pipeline_events(2), _par(pp=2, microbatches=4), comm=TableComm({}, p2p_s=0.01))
    memory = pd.DataFrame({"rank_class": [0, 1], "peak_bytes": [2e9, 5e8]})
    classes = class_table(t, memory, HW.memory_capacity_bytes)
    assert classes["oom"].tolist() == [True, False]
    result = json.loads(json.dumps(summary(t, classes, world_size=2, num_microbatches=4)))
    assert set(SUMMARY_FIELDS) <= set(result) and result["oom"] is True
    assert result["step_time_s"] == pytest.approx(t.step_time_s)
    assert result["critical_path"]["duration_s"] == pytest.approx(t.step_time_s)
    assert sum(result["critical_path"]["by_category"].values()) == pytest.approx(t.step_time_s)
    assert {"compute_s", "exposed_comm_s", "pipeline_bubble_s", "oom"} <= set(result["classes"][0])

    trace = json.loads(json.dumps(chrome_trace(t)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in spans} == tracks
    assert {pid for pid, _ in tracks} == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "comm.pp.send", "comm.pp.recv"} <= names
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(t.step_time_s * 1e6)


@pytest.fixture(scope="module")
def tiny_traces():
    from trainsim.config import compose_run
    from trainsim.trace import trace_layout

    out = {}
    for parallelism in ("dp2", "pp2", "pp2-interleaved"):
        run = compose_run(["model=gpt-tiny", f"parallelism={parallelism}", "hardware=a100-80g-dgx"], check="layout")
        result = trace_layout(run.model, run.parallelism)
        out[parallelism] = (run, result.graph.to_pandas(), result.rank_classes.to_pandas())
    return out


def _flop_times(ops: pd.DataFrame) -> np.ndarray:
    return 1e-6 + ops["flops"].to_numpy() / 1e12


@pytest.mark.parametrize("parallelism", ["dp2", "pp2", "pp2-interleaved"])
def test_collapsing_serial_runs_does_not_change_the_step(tiny_traces, parallelism):
    from trainsim.comm.model import CommModel

    run, graph, rank_classes = tiny_traces[parallelism]
    with_host = dataclasses.replace(run.hardware, host_dispatch_s=2e-5)  # 20 us per op: the host model on
    # exact without a host model; with one, a collapsed run's last kernel counts as of average length
    for hw, rel in ((dataclasses.replace(run.hardware, host_dispatch_s=0.0), 1e-12), (with_host, 1e-4)):
        steps = [compose_step(graph, rank_classes, run.parallelism, hw, _flop_times, CommModel.from_hardware(hw),
                              collapse=collapse) for collapse in (True, False)]
        assert steps[0].step_time_s == pytest.approx(steps[1].step_time_s, rel=rel)
        assert steps[0].graph.num_nodes < steps[1].graph.num_nodes


def test_step_expansion_runs_the_ops_expand_step_gives(tiny_traces):
    from trainsim.comm.model import CommModel
    from trainsim.trace.expand import expand_step

    run, graph, rank_classes = tiny_traces["pp2-interleaved"]
    par = run.parallelism
    t = compose_step(graph, rank_classes, par, run.hardware, _flop_times, CommModel.from_hardware(run.hardware),
                     collapse=False)
    for c in range(t.classes.count):
        nodes = t.graph.tnode[t.graph.cls == c]
        ours = [int(t.info.source[n][0].ops["id"].iat[t.info.source[n][2]]) for n in nodes]
        actions = pipeline_actions(par.schedule, par.pp, c, par.num_microbatches, par.virtual_stages)
        expected = expand_step(graph[graph["rank_class"] == c], actions)
        assert ours == expected.loc[~expected["no_kernel"], "id"].tolist()


def test_compose_stage_end_to_end_on_real_traces(tmp_path, tiny_traces):
    from trainsim.artifacts import read_manifest
    from trainsim.profile.stage import write_profile_artifact
    from trainsim.timeline.stage import CHROME_FILE, write_timeline_artifact
    from trainsim.trace.stage import write_trace_artifact

    for parallelism in ("dp2", "pp2"):
        run = tiny_traces[parallelism][0]
        keys = run.keys
        trace_dir, profile_dir = tmp_path / parallelism / "trace", tmp_path / parallelism / "profile"
        write_trace_artifact(run.model, run.parallelism, keys, trace_dir)
        write_profile_artifact(run.hardware, keys, trace_dir, tmp_path / "db", profile_dir)
        out = tmp_path / parallelism / "timeline"
        result = write_timeline_artifact(run.hardware, run.model, run.parallelism, keys,
                                         {"trace": trace_dir, "profile": profile_dir}, out)
        assert read_manifest(out)["stage"] == "compose"
        assert result["step_time_s"] > 0 and result["oom"] is False
        assert result["num_rank_classes"] == run.parallelism.pp
        for row in result["classes"]:
            parts = (row["compute_s"] + row["slowdown_added_s"] + sum(row["exposed_comm_s"].values())
                     + row["pipeline_bubble_s"] + row["idle_s"])
            assert parts == pytest.approx(result["step_time_s"])
            assert row["compute_s"] > 0
        trace = json.loads((out / CHROME_FILE).read_text())
        assert any(e["ph"] == "X" for e in trace["traceEvents"])
        if parallelism == "dp2":
            assert result["classes"][0]["exposed_comm_s"]["dp"] > 0
        else:
            assert all(row["pipeline_bubble_s"] > 0 for row in result["classes"])


@pytest.mark.slow
def test_predict_builds_every_input_by_default_and_says_what_it_used(tmp_path, monkeypatch):
    """`trainsim.predict` (and `trainsim compose`): the whole pipeline's prediction from an empty artifact
    tree; `build_missing=False` leaves calibration and slowdown out and warns about both."""
    import trainsim

    monkeypatch.chdir(tmp_path)
    overrides = ["parallelism=dp2", "hardware.calibration.sweep_ranks=[2]",
                 "hardware.calibration.sweep_collectives=[all_reduce]",
                 "hardware.calibration.sweep_max_bytes=8192", "hardware.slowdown.collectives=[all_reduce]",
                 "hardware.slowdown.message_bytes=[262144]", "hardware.slowdown.matmul_sizes=[64,96]",
                 "hardware.slowdown.memory_bound_ops=[add]", "hardware.slowdown.memory_bound_elements=[16384]",
                 "hardware.slowdown.solo_calls=3", "hardware.slowdown.max_calls_per_window=8"]
    quick = trainsim.predict(*overrides, build_missing=False, output=tmp_path / "quick")
    assert quick.summary["models"]["slowdown"] == "none" and "uncalibrated" in quick.summary["models"]["comm"]
    assert not quick.inputs["calibration"]["calibrated"] and not quick.inputs["slowdown"]["modelled"]
    assert any(w.startswith("collectives: no calibration") for w in quick.warnings)
    assert any(w.startswith("slowdown: no overlap-slowdown model") for w in quick.warnings)

    trace = next(tmp_path.glob("artifacts/traces/*/*/manifest.json"))
    made_by_old_code = json.loads(trace.read_text())
    made_by_old_code["config"]["tracer_code"] = "an older tracer"
    trace.write_text(json.dumps(made_by_old_code))
    full = trainsim.predict(*overrides)  # traces again rather than reuse a trace of other code
    assert json.loads(trace.read_text())["config"]["tracer_code"] == tracer_code_digest()
    assert "calibrated: artifacts/calibration/" in full.summary["models"]["comm"]
    # auto: the model where it beats no slowdown on unseen kernel groups of this machine's data, else none; either way
    # the summary says which and why
    applied = full.inputs["slowdown"]["modelled"]
    assert full.summary["models"]["slowdown"] == ("xgboost" if applied else "none")
    assert full.inputs["slowdown"]["choice"].startswith(f"overlap slowdown: {'XGBoost model' if applied else 'none'} "
                                                        "(auto: XGBoost ")
    assert full.warnings == [] and full.inputs == full.summary["inputs"]
    assert full.inputs["calibration"]["sources"] == ["local gloo sweep on this machine"]
    assert full.inputs["calibration"]["collectives"]["all_reduce"]["rows"] > 0
    assert full.inputs["kernels"]["backends"] == {"cpu": full.inputs["kernels"]["measured_ops"]}
    assert full.inputs["slowdown"]["rows"] > 0 and full.inputs["slowdown"]["cv_duration_mape_pct"] is not None
    for stage in ("calibration", "slowdown", "models"):
        assert list((tmp_path / "artifacts" / stage).glob("*/manifest.json")), stage
    # the typed result: breakdown and memory per rank class, critical path, the Chrome trace
    assert full.step_time_s == pytest.approx(full.breakdown["end_s"].max())
    assert list(full.memory["rank_class"]) == [0] and not full.oom
    assert (full.memory["peak_bytes"] > full.memory["parameter_bytes"]).all()
    assert full.critical_path["segments"]
    trace = json.loads(full.write_chrome_trace(tmp_path / "out" / "step.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])


@pytest.mark.parametrize("collapse", [True, False])
def test_host_dispatch_bounds_the_step_when_kernels_are_short(collapse):
    """Kernels of 1 s; the host issues an op every h s (the view between F and F2 costs dispatch too)."""
    events = [_event(0, 0, "forward", "F"), {**_event(0, 1, "forward", "view", deps=(0,)), "no_kernel": True},
              _event(0, 2, "forward", "F2", deps=(1,)), _event(0, 3, "backward", "B", deps=(2,))]
    times = {"F": 1.0, "F2": 1.0, "B": 1.0}
    device_bound = _compose(events, _par(), hw=dataclasses.replace(HW, host_dispatch_s=0.5), times=times,
                            collapse=collapse)
    # F issued at 0.5, F2 at 1.5 (after the view), B at 2.0: the device is the bottleneck after the first issue
    assert device_bound.step_time_s == pytest.approx(3.5)
    host_bound = _compose(events, _par(), hw=dataclasses.replace(HW, host_dispatch_s=2.0), times=times,
                          collapse=collapse)
    # B leaves the host at 4 x 2 s and runs 1 s
    assert host_bound.step_time_s == pytest.approx(9.0)
    parts = _assert_breakdown_adds_up(host_bound).iloc[0]  # waiting for the host is idle time, not slowdown
    assert parts["compute_s"] == pytest.approx(3.0) and parts["slowdown_added_s"] == pytest.approx(0.0)
    path = summary(host_bound, class_table(host_bound, None, 1e9), world_size=1, num_microbatches=1)["critical_path"]
    assert path["by_category"]["host"] > 0
    assert sum(path["by_category"].values()) == pytest.approx(9.0)
    assert _compose(events, _par(), times=times, collapse=collapse).step_time_s == pytest.approx(3.0)


def test_host_dispatch_must_be_small_and_non_negative():
    from trainsim.config.validate import validate_hardware
    from trainsim.errors import ConfigError

    with pytest.raises(ConfigError, match="hardware.host_dispatch_s=-1"):
        validate_hardware(dataclasses.replace(HW, host_dispatch_s=-1e-6))


def test_a_straggler_splits_its_expert_parallel_peers_from_the_rest():
    from trainsim.timeline.classes import timeline_classes

    layout = Layout(dp=4, tp=1, pp=1, ep=2)  # ep groups {0, 1}, {2, 3}; one dp group of all four
    classes = timeline_classes(_rank_classes(layout), layout, np.array([1.5, 1.0, 1.0, 1.0]))
    # rank 0, its all-to-all partner 1 (waits for it every layer), and the other expert-parallel group
    assert classes.class_of_rank.tolist() == [0, 1, 2, 2]


def test_a_replaced_builtin_schedule_or_rule_is_seen(monkeypatch):
    """A cached timeline is reused only while the built-in schedules and rules compose (timeline/stage.py)."""
    from trainsim.timeline import plugins

    monkeypatch.setattr(plugins, "_SCHEDULES", {})  # the registries as imported, restored after the test
    monkeypatch.setattr(plugins, "_RULES", dict(plugins.BUILTIN_RULES))
    assert not plugins.replaced_builtins()
    register_schedule("my-schedule", lambda pp, rank, m, v: pipeline_actions("gpipe", pp, rank, m, v))
    register_dependency_rule("mine", plugins.data_rule)
    assert not plugins.replaced_builtins()  # new names change nothing until a composition names them
    register_dependency_rule("data", lambda ops: plugins.data_rule(ops)[:0])
    assert plugins.replaced_builtins()
    register_dependency_rule("data", plugins.data_rule)
    assert not plugins.replaced_builtins()
    register_schedule("1f1b", lambda pp, rank, m, v: pipeline_actions("gpipe", pp, rank, m, v))
    assert plugins.replaced_builtins()
