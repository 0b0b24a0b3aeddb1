"""NIC contention: concurrent inter-node transfers of one rank share its network interface.

Unit tests of timeline/contention.py on hand-built intervals (expected durations worked out from
d = f D / (D - sum_k T_k beta (k - 1) / (1 + beta (k - 1)))), then whole steps composed with a
message-size-dependent communication cost on layouts that do and do not span nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from trainsim.config.schema import HardwareConfig, NetworkConfig, ParallelismConfig
from trainsim.parallel.layout import Layout
from trainsim.timeline import TableComm, compose_step
from trainsim.timeline.chrome import chrome_trace
from trainsim.timeline.contention import BOTH, EGRESS, INGRESS, bandwidth_part, contended_durations, contention_extra
from trainsim.timeline.engine import replay
from trainsim.timeline.outputs import CLASS_FIELDS, SUMMARY_FIELDS, breakdown, class_table, summary
from trainsim.timeline.program import RECV, SEND
from trainsim.trace.schema import GRAPH_SCHEMA


def _one_replay(cls, start, duration, fixed, bandwidth, group=None, direction=None):
    return contended_durations(np.asarray(cls), np.asarray(start, dtype=float), np.asarray(duration, dtype=float),
                               np.asarray(fixed, dtype=float), np.asarray(bandwidth, dtype=float),
                               None if group is None else np.asarray(group),
                               None if direction is None else np.asarray(direction))


# ---- contention.py on hand-built intervals ---------------------------------------------------------------

def test_two_fully_overlapping_bandwidth_bound_transfers_of_one_rank_each_take_twice_as_long():
    d = _one_replay([0, 0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0])
    np.testing.assert_allclose(d, [2.0, 2.0])
    # a fixed point: replayed with those durations they still overlap fully and keep them
    np.testing.assert_allclose(_one_replay([0, 0], [0.0, 0.0], d, [1.0, 1.0], [1.0, 1.0]), [2.0, 2.0])
    # three at once: a third of the NIC each
    np.testing.assert_allclose(_one_replay([0, 0, 0], [0.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 3), [3.0] * 3)


def test_partial_overlap_converges_to_the_fluid_fair_share_times():
    # A alone on [0, 0.5], shares with B until A has done its 1 s of work: A ends at 1.5, B (from 0.5) at 2.0
    d = _one_replay([0, 0], [0.0, 0.5], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0])
    np.testing.assert_allclose(d, [4 / 3, 4 / 3])  # half of each 1 s interval at k = 2: 1 / (1 - 0.5 / 2)
    for _ in range(30):
        d = _one_replay([0, 0], [0.0, 0.5], d, [1.0, 1.0], [1.0, 1.0])
    np.testing.assert_allclose(d, [1.5, 1.5], rtol=1e-9)


def test_latency_is_not_stretched():
    # f = 1 s of which b = 0.5 s bandwidth: two overlapping ones take f + b (latency once, bandwidth twice)
    np.testing.assert_allclose(_one_replay([0, 0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.5, 0.5]), [1.5, 1.5])
    # a latency-only transfer (b = 0) is neither stretched nor counted as a sharer
    np.testing.assert_allclose(_one_replay([0, 0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0]), [1.0, 1.0])


def test_no_overlap_or_another_rank_leaves_durations_alone():
    # back to back (touching is not overlapping)
    np.testing.assert_allclose(_one_replay([0, 0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]), [1.0, 1.0])
    # same time, different classes: different ranks, different NICs
    np.testing.assert_allclose(_one_replay([0, 1], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]), [1.0, 1.0])
    # one transfer, or none
    np.testing.assert_allclose(_one_replay([0], [0.0], [1.0], [1.0], [1.0]), [1.0])
    assert len(_one_replay([], [], [], [], [])) == 0


def test_the_nic_is_full_duplex():
    def pair(a, b):
        return _one_replay([0, 0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], direction=[a, b])

    np.testing.assert_allclose(pair(EGRESS, INGRESS), [1.0, 1.0])  # 1F1B: send forward while receiving backward
    np.testing.assert_allclose(pair(EGRESS, EGRESS), [2.0, 2.0])
    np.testing.assert_allclose(pair(EGRESS, BOTH), [2.0, 2.0])  # a send next to a DP all-reduce
    np.testing.assert_allclose(pair(INGRESS, BOTH), [2.0, 2.0])
    # an all-reduce next to a send and a receive: each direction is shared by two, the all-reduce by two
    d = _one_replay([0, 0, 0], [0.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 3, direction=[BOTH, EGRESS, INGRESS])
    np.testing.assert_allclose(d, [2.0, 2.0, 2.0])


def test_both_sides_of_a_transfer_end_together_with_the_slower_one():
    # class 0's send (group 7) overlaps class 0's all-reduce; class 1's matching recv overlaps nothing
    cls, start = [0, 0, 1], [0.0, 0.0, 0.0]
    d = _one_replay(cls, start, [1.0] * 3, [1.0] * 3, [1.0] * 3, group=[7, -1, 7])
    np.testing.assert_allclose(d, [2.0, 2.0, 2.0])
    extra = contention_extra(np.asarray(cls), np.asarray(start), np.ones(3), np.ones(3), np.ones(3))
    np.testing.assert_allclose(extra, [1.0, 1.0, 0.0])  # without the group, the recv keeps its time


def test_many_transfers_are_vectorised():
    rng = np.random.default_rng(0)
    n = 200_000
    cls = rng.integers(0, 16, n)
    start = np.sort(rng.uniform(0, 1000, n))
    fixed = rng.uniform(1e-3, 2e-2, n)
    d = contended_durations(cls, start, fixed, fixed, fixed * rng.uniform(0, 1, n))
    assert (d >= fixed - 1e-15).all() and (d > fixed).any()
    assert (d <= fixed * 1000).all()


def test_bandwidth_part_is_time_above_a_one_byte_message():
    assert bandwidth_part(1.5, 0.25) == pytest.approx(1.25)
    assert bandwidth_part(0.1, 0.25) == 0.0


# ---- whole steps -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkComm:
    """Latency plus bytes over the link rate: NVLink-like inside a node, a slow NIC between nodes."""

    latency_s: float = 1e-3
    inter_bytes_per_s: float = float(1 << 20)  # a 1 MiB message takes 1 s between nodes
    intra_bytes_per_s: float = float(1 << 26)
    name: str = "link"

    def collective_seconds(self, collective: str, message_bytes: int, num_ranks: int, num_nodes: int) -> float:
        if num_ranks < 2:
            return 0.0
        return self.latency_s + message_bytes / (self.inter_bytes_per_s if num_nodes > 1 else self.intra_bytes_per_s)

    def p2p_seconds(self, message_bytes: int, same_node: bool) -> float:
        return self.latency_s + message_bytes / (self.intra_bytes_per_s if same_node else self.inter_bytes_per_s)

    def sync_wait_s(self, segment_s: float, num_ranks: int) -> float:
        return 0.0


def _event(rank_class, i, phase, op, *, kind="compute", per_mb=True, collective=None, group_kind=None,
           group=None, peer=-1, deps=()):
    return {"rank_class": rank_class, "id": i, "phase": phase, "chunk": 0, "microbatch": 0, "per_microbatch": per_mb,
            "kind": kind, "stream": "compute" if kind == "compute" else f"comm.{group_kind}", "op": op,
            "input_shapes": "[]", "input_strides": "[]", "input_dtypes": "", "op_args": "{}", "signature": op,
            "no_kernel": False, "flops": 1, "bytes_moved": 1, "collective": collective, "group_kind": group_kind,
            "group_ranks": group, "message_bytes": 1 << 20, "comm_dtype": None, "peer": peer, "async_op": False,
            "deps": list(deps)}


def _stage_events(layout: Layout, s: int) -> list[dict]:
    """Stage s: forward recv, F, send; backward recv, B1 -> DP bucket 1, B2 -> DP bucket 2, send (after B2);
    optimizer after both buckets. The last backward's gradient send leaves with bucket 2, both 1 MiB."""
    rep = layout.stage_representative(s)
    dp, pp = layout.group_ranks(rep, "dp"), layout.group_ranks(rep, "pp")
    ev: list[dict] = []

    def add(phase, op, **kw):
        ev.append(_event(s, len(ev), phase, op, **kw))
        return len(ev) - 1

    def p2p(phase, direction, other, deps=()):
        return add(phase, direction, kind="p2p", collective=direction, group_kind="pp", group=pp, peer=pp[other],
                   deps=deps)

    r = p2p("forward", "recv", s - 1) if s > 0 else None
    f = add("forward", "F", deps=() if r is None else (r,))
    if s < layout.pp - 1:
        p2p("forward", "send", s + 1, deps=(f,))
    r = p2p("backward", "recv", s + 1) if s < layout.pp - 1 else None
    buckets, b = [], None
    for op in ("B1", "B2"):  # each bucket's all-reduce is issued right after its gradients, before B2
        b = add("backward", op, deps=(b,) if b is not None else () if r is None else (r,))
        div = add("backward", "div", per_mb=False, deps=(b,))
        buckets.append(add("backward", "ar", kind="collective", per_mb=False, collective="all_reduce",
                           group_kind="dp", group=dp, deps=(div,)))
    if s > 0:
        p2p("backward", "send", s - 1, deps=(b,))
    add("optimizer", "OPT", per_mb=False, deps=tuple(buckets))
    return ev


def _three_d_events(layout: Layout) -> list[dict]:
    return [e for s in range(layout.pp) for e in _stage_events(layout, s)]


def _rank_classes(layout: Layout) -> pd.DataFrame:
    pos = [layout.position(r) for r in range(layout.world_size)]
    return pd.DataFrame({"rank": [p.rank for p in pos], "rank_class": [p.pp_rank for p in pos],
                         "dp_rank": [p.dp_rank for p in pos], "tp_rank": [p.tp_rank for p in pos],
                         "pp_rank": [p.pp_rank for p in pos]})


def _step(devices_per_node: int, nic_contention: bool, microbatches: int = 4, comm=None, dp: int = 2, pp: int = 2,
          network: NetworkConfig | None = None):
    layout = Layout(dp, 1, pp)
    par = ParallelismConfig(name="test", dp=dp, tp=1, pp=pp, micro_batch_size=1,
                            global_batch_size=microbatches * dp, schedule="1f1b")
    hw = HardwareConfig(name="test", device_kind="cuda", devices_per_node=devices_per_node,
                        memory_capacity_bytes=1e9, network=network or NetworkConfig())
    graph = pd.DataFrame(_three_d_events(layout))[GRAPH_SCHEMA.names]
    times = {"F": 1.0, "B1": 1.0, "B2": 1.0, "div": 0.0, "OPT": 0.1}
    return compose_step(graph, _rank_classes(layout), par, hw, times, comm or LinkComm(),
                        nic_contention=nic_contention)


def _nic_overlap(t) -> float:
    """Seconds during which two inter-node transfers of one class run at once on the same direction of the
    NIC (a send with a receive does not count), durations as replayed."""
    kind = t.graph.table.kind[t.graph.tnode]
    nic = np.flatnonzero(((kind == 2) | (kind == SEND) | (kind == RECV)) & (t.graph.table.nic_s[t.graph.tnode] > 0))
    total = 0.0
    for c in np.unique(t.graph.cls[nic]):
        q = nic[t.graph.cls[nic] == c]
        s, e = t.replay.start_s[q], t.replay.start_s[q] + t.duration_s[q]
        over = np.minimum(e[:, None], e[None, :]) - np.maximum(s[:, None], s[None, :])
        k = kind[q]
        over[(k[:, None] == SEND) & (k[None, :] == RECV) | (k[:, None] == RECV) & (k[None, :] == SEND)] = 0.0
        total += float(np.triu(np.clip(over, 0, None), 1).sum())
    return total


def test_dp_all_reduce_sharing_the_nic_with_pipeline_sends_lengthens_a_multi_node_step():
    alone = _step(devices_per_node=1, nic_contention=False)  # every rank its own node: dp and pp cross nodes
    shared = _step(devices_per_node=1, nic_contention=True)
    assert _nic_overlap(alone) > 0.9  # the last gradient send runs with DP bucket 2 on stage 1
    assert shared.converged
    # both 1 MiB (1 ms latency + 1 s at the NIC's rate) leave stage 1 together and each take 1 s longer;
    # stage 1's optimizer waits for the bucket, stage 0's last backward for the gradient: the step grows 1 s
    assert shared.step_time_s == pytest.approx(alone.step_time_s + 1.0, abs=5e-3)
    assert alone.contention_s.sum() == 0 and breakdown(alone)["contention_added_s"].sum() == 0
    parts = breakdown(shared)
    assert parts["contention_added_s"].sum() > 0.5
    np.testing.assert_allclose(parts["contention_added_s"], [shared.contention_s[shared.graph.cls == c].sum()
                                                             for c in range(shared.classes.count)])
    # only inter-node communication was stretched, and communication only by contention
    kind = shared.graph.table.kind[shared.graph.tnode]
    stretched = shared.contention_s > 0
    assert set(kind[stretched].tolist()) <= {2, SEND, RECV}
    assert (shared.graph.table.nic_s[shared.graph.tnode][stretched] > 0).all()
    comm = np.isin(kind, (2, SEND, RECV))
    np.testing.assert_allclose(shared.duration_s[comm], shared.fixed_s[comm] + shared.contention_s[comm])
    # the parts still add up to the step (contention shows inside exposed communication, not on top)
    total = parts.drop(columns=["rank_class", "end_s", "optimizer_step_s", "contention_added_s"]).sum(axis=1)
    np.testing.assert_allclose(total, shared.step_time_s, rtol=1e-9)
    assert parts["exposed_dp_s"].sum() + parts["exposed_pp_s"].sum() > \
        breakdown(alone)["exposed_dp_s"].sum() + breakdown(alone)["exposed_pp_s"].sum()
    # the returned timeline is a fixed point of its durations
    assert replay(shared.graph, shared.duration_s).step_time_s == pytest.approx(shared.step_time_s)
    assert shared.models["nic_contention"] != alone.models["nic_contention"] == "off"


def test_single_node_layout_is_unchanged():
    alone = _step(devices_per_node=8, nic_contention=False)
    shared = _step(devices_per_node=8, nic_contention=True)
    assert not (shared.graph.table.nic_s > 0).any()  # nothing leaves the node
    assert shared.step_time_s == alone.step_time_s
    np.testing.assert_array_equal(shared.duration_s, alone.duration_s)
    assert breakdown(shared)["contention_added_s"].sum() == 0


def test_only_the_communication_that_crosses_nodes_uses_the_nic():
    # two ranks per node: each stage's DP group is inside a node, the pipeline crosses nodes
    t = _step(devices_per_node=2, nic_contention=True)
    table = t.graph.table
    crossing = table.nic_s > 0
    assert crossing.any()
    assert set(table.kind[crossing].tolist()) <= {SEND, RECV}
    # and in 1F1B a stage's concurrent sends and receives use opposite directions of the NIC
    assert t.contention_s.sum() == 0
    # message-independent costs (TableComm) have no bandwidth-bound part: nothing is contended
    flat = _step(devices_per_node=1, nic_contention=True, comm=TableComm({"all_reduce": 1.0}, p2p_s=1.0))
    assert flat.contention_s.sum() == 0 and not (flat.graph.table.nic_s > 0).any()


def test_summary_reports_contention_per_class():
    t = _step(devices_per_node=1, nic_contention=True)
    assert t.contention_s.sum() > 0
    classes = class_table(t, None, 1e9)
    result = summary(t, classes, world_size=4, num_microbatches=4)
    assert "contention_added_s" in CLASS_FIELDS and "nic_contention" in result["models"]
    assert set(SUMMARY_FIELDS) <= set(result)
    assert sum(row["contention_added_s"] for row in result["classes"]) == pytest.approx(t.contention_s.sum())
    spans = [e for e in chrome_trace(t)["traceEvents"] if e["ph"] == "X"]
    assert sum(e["args"].get("contention_added_us", 0.0) for e in spans) == pytest.approx(t.contention_s.sum() * 1e6)
    assert all(abs(e["args"]["slowdown_added_us"]) < 1e-3 for e in spans)  # no overlap slowdown model here


def test_real_trace_multi_node_step_gets_contention_and_stays_consistent():
    """gpt-tiny on dp2 x pp2 with the NCCL model, one device per node: the DP all-reduces of the last
    backward run while pipeline gradients travel."""
    from trainsim.comm.model import CommModel
    from trainsim.config import compose_run
    from trainsim.trace import trace_layout

    run = compose_run(["model=gpt-tiny", "parallelism=pp2", "parallelism.dp=2", "parallelism.global_batch_size=8",
                       "hardware=a100-80g-dgx"], check="layout")
    result = trace_layout(run.model, run.parallelism)
    graph, rank_classes = result.graph.to_pandas(), result.rank_classes.to_pandas()
    hw = dataclasses.replace(run.hardware, devices_per_node=1, host_dispatch_s=0.0)
    comm = CommModel.from_hardware(hw)

    def times(ops: pd.DataFrame) -> np.ndarray:
        return 1e-6 + ops["flops"].to_numpy() / 1e12

    steps = {flag: compose_step(graph, rank_classes, run.parallelism, hw, times, comm, nic_contention=flag)
             for flag in (False, True)}
    assert steps[True].contention_s.sum() > 0
    assert steps[True].step_time_s >= steps[False].step_time_s
    assert (breakdown(steps[True])["contention_added_s"] >= 0).all()
    single = dataclasses.replace(run.hardware, host_dispatch_s=0.0)  # 8 devices per node: one node
    on_one_node = [compose_step(graph, rank_classes, run.parallelism, single, times, CommModel.from_hardware(single),
                                nic_contention=flag) for flag in (False, True)]
    assert on_one_node[0].step_time_s == on_one_node[1].step_time_s
    assert on_one_node[1].contention_s.sum() == 0


def test_the_job_placement_decides_which_groups_cross_the_network():
    """8 ranks (pp 2 x dp 4) on trays of 2 in NVLink domains of 3 trays: the job needs 2 domains. Balanced puts 2
    trays in each, so each stage's dp group stays on NVLink; packed fills the first domain (ranks 0-5), so stage
    1's dp group (ranks 4-7) spans both domains and its gradient all-reduce goes over the slow network."""
    def step(placement):
        return _step(devices_per_node=2, nic_contention=False, dp=4,
                     network=NetworkConfig(nvlink_domain_size=6, placement=placement))

    def gradient_all_reduce_s(t, stage):
        kind = t.graph.table.kind[t.graph.tnode]
        return float(t.duration_s[(kind == 2) & (t.graph.cls == stage)].max())

    balanced, packed = step("balanced"), step("packed")
    # a 1 MiB all-reduce: 1 s over the network, 1/64 s over NVLink
    assert gradient_all_reduce_s(balanced, 1) < 0.1 < 1.0 < gradient_all_reduce_s(packed, 1)
    assert gradient_all_reduce_s(packed, 0) < 0.1  # stage 0 (ranks 0-3) stays in the first domain either way
