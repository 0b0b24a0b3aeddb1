"""The collective model (hand-computable cases), its fit, the calibration stage and its accuracy on public data."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from trainsim.comm.calibration import (
    HELD_OUT_PRIORS,
    MEASUREMENT_COLUMNS,
    collect_measurements,
    read_calibration_file,
    write_calibration_artifact,
)
from trainsim.comm.fit import RelativeErrors, every_other_size, fit_alpha_beta, fit_collective, mape_pct, predict_table
from trainsim.comm.model import (
    CollectiveParams,
    CommModel,
    algorithm_protocol_seconds,
    candidate_pairs,
    choose,
    chunk_bytes,
    pair_parameters,
    predict_seconds,
    prior_params,
)
from trainsim.config import compose_run
from trainsim.config.choices import ALGORITHMS
from trainsim.config.data_path import DATA_DIR
from trainsim.config.schema import CalibrationFile
from trainsim.errors import ConfigError

DATA = DATA_DIR / "nccl-tests"
MIB = 1 << 20


def hardware(name: str):
    return compose_run([f"hardware={name}"], check="layout").hardware


def simple_ring(collective="all_reduce", channels=1, **values) -> CollectiveParams:
    base = {"alpha.ring": 10e-6, "delta": 0.0, "latency.intra.Simple": 2e-6, "bandwidth.intra.Simple": 10e9,
            "latency.inter.Simple": 20e-6, "bandwidth.inter.Simple": 1e9}
    return CollectiveParams(collective, ("ring",), ("Simple",), channels, 4 * MIB, {**base, **values})


def test_ring_all_reduce_matches_the_formula():
    params = simple_ring()
    chunk = chunk_bytes("Simple", 4 * MIB, ring=True)  # 4 MiB / 8 steps * 4 chunk steps = 2 MiB
    assert chunk == 2 * MIB
    n, size = 4, 16 * MIB  # 16 MiB / (4 ranks * 1 channel * 2 MiB) = 2 loops of 6 steps
    per_step = size / (n * 1 * 2)
    expected = 10e-6 + 2 * 6 * (2e-6 + per_step / 10e9)
    assert predict_seconds(params, [size], n, 1)[0] == pytest.approx(expected)


def test_more_loops_add_per_step_latency_not_bandwidth():
    params = simple_ring()
    below, above = predict_seconds(params, [8 * MIB, 8 * MIB + 4096], 4, 1)
    # one more loop: 2(N-1) more step latencies; the 4 KiB more add only their transfer, 2(N-1)/N of them
    assert above - below == pytest.approx(6 * 2e-6 + 6 * 4096 / 4 / 10e9)


def test_multi_node_ring_waits_for_the_slowest_link_and_delta_scales_with_size():
    params = simple_ring(delta=1e-11)
    one_node, two_nodes = predict_seconds(params, [64 * MIB], 8, 1)[0], predict_seconds(params, [64 * MIB], 8, 2)[0]
    assert two_nodes > 5 * one_node
    no_delta = predict_seconds(replace(params, values={**params.values, "delta": 0.0}), [64 * MIB], 8, 1)[0]
    assert one_node - no_delta == pytest.approx(1e-11 * 64 * MIB)


def test_tree_is_a_candidate_across_nodes_only():
    values = {**simple_ring().values, "alpha.tree": 1e-6}
    params = CollectiveParams("all_reduce", ("ring", "tree"), ("Simple",), 1, 4 * MIB, values)
    assert choose(params, 64 * MIB, 16, 1)[0] == "ring"
    assert choose(params, 64 * MIB, 16, 2) == ("tree", "Simple")  # 2 inter hops instead of 30 slow ring steps


def test_pipeline_collectives_and_p2p():
    params = simple_ring("send_recv")
    size = MIB  # pipeline chunk is 512 KiB for Simple: 2 chunks through one hop
    assert predict_seconds(params, [size], 2, 1)[0] == pytest.approx(10e-6 + 2 * (2e-6 + size / 2 / 10e9))
    model = CommModel(hardware("a100-80g-dgx"), {"send_recv": params}, source="test")
    assert model.p2p_seconds(size, same_node=False) > model.p2p_seconds(size, same_node=True)


def synthetic(params: CollectiveParams, ranks_nodes, sizes) -> pd.DataFrame:
    rows = [{"message_bytes": s, "num_ranks": n, "num_nodes": m, "source": "synthetic"}
            for n, m in ranks_nodes for s in sizes]
    table = pd.DataFrame(rows)
    return table.assign(time_s=predict_table(params, table))


def test_fit_recovers_a_known_model_and_extrapolates_in_ranks():
    hw = hardware("a100-80g-dgx")
    truth = prior_params(hw, "all_reduce", channels=8)
    truth.values.update({"latency.intra.LL128": 3e-6, "bandwidth.intra.Simple": 30e9, "delta": 2e-12})
    sizes = [2**k for k in range(12, 31)]
    train = synthetic(truth, [(2, 1), (4, 1)], sizes)
    fit = fit_collective(train, prior_params(hw, "all_reduce"), (8,))
    # noiseless times from the model's own family: the fit must find them to the optimiser's tolerance, not
    # to within a few per cent (today 0.02 % on the fitted ranks, 0.04 % extrapolated to 8)
    assert fit.train_mape_pct < 0.2
    test = synthetic(truth, [(8, 1)], sizes)
    assert mape_pct(predict_table(fit.params, test), test["time_s"].to_numpy()) < 0.5


@pytest.mark.parametrize("name", ["a100-80g-dgx", "h100-80g-p5", "a100-40g-oci", "local-cpu"])
def test_a_pair_reads_only_the_values_pair_parameters_names(name):
    """The fit recomputes a pair only when a value it reads moves: moving any other leaves its time as it was."""
    hw = hardware(name)
    sizes = np.array([2.0**k for k in range(3, 34, 3)])
    for collective in ALGORITHMS:
        params = prior_params(hw, collective, channels=4)
        params.values["latency.network"] = 30e-6
        for ranks, nodes in ((2, 1), (8, 1), (16, 2), (64, 8)):
            for pair in candidate_pairs(params, nodes):
                before = algorithm_protocol_seconds(params, *pair, sizes, ranks, nodes)
                for key in set(params.values) - pair_parameters(params, *pair):
                    moved = replace(params, values={**params.values, key: params.values[key] * 1.7})
                    after = algorithm_protocol_seconds(moved, *pair, sizes, ranks, nodes)
                    assert np.array_equal(before, after), (collective, pair, key)


def test_the_fit_reuses_unmoved_pairs_with_the_same_floats_as_a_full_evaluation():
    hw = hardware("h100-80g-p5")
    prior = prior_params(hw, "all_reduce", channels=8)
    truth = replace(prior, values={k: v * 1.3 for k, v in prior.values.items()})
    table = synthetic(truth, [(8, 1), (16, 2)], [2**k for k in range(8, 31, 2)])
    names = sorted(prior.values)
    x = np.log([prior.values[n] for n in names])
    incremental = RelativeErrors(prior, names, table)
    incremental(x)
    for i in range(len(names)):
        step = x.copy()
        step[i] += 1e-3
        assert np.array_equal(incremental(step), RelativeErrors(prior, names, table)(step)), names[i]


def test_a_group_with_fewer_ranks_per_node_gets_its_share_of_the_nodes_network():
    """Inter-node bandwidth is the node's, measured with all its devices in the collective; a data-parallel
    group with one rank per node (tensor parallelism fills the node) uses one device's share of it."""
    params = prior_params(hardware("a100-80g-dgx"), "all_reduce", channels=8)
    assert params.fabric.devices_per_node == 8
    assert (params.nic_share(16, 2), params.nic_share(8, 4), params.nic_share(4, 4)) == (1.0, 0.25, 0.125)
    unshared = replace(params, fabric=replace(params.fabric, devices_per_node=0))
    size = np.array([1 << 30])
    for ranks, nodes in ((16, 2), (8, 1)):  # the measured case and a single node: unchanged
        assert algorithm_protocol_seconds(params, "ring", "Simple", size, ranks, nodes) == pytest.approx(
            algorithm_protocol_seconds(unshared, "ring", "Simple", size, ranks, nodes))
    one_per_node = algorithm_protocol_seconds(params, "ring", "Simple", size, 4, 4)[0]
    alone = algorithm_protocol_seconds(unshared, "ring", "Simple", size, 4, 4)[0]
    assert 4 < one_per_node / alone <= 8.01  # bandwidth-bound: the inter-node term is 8x, latency is not
    # a stored fit (older ones lack the field) gets the configured node's devices
    model = CommModel(hardware("a100-80g-dgx"), {"all_reduce": unshared}, source="test")
    assert model.params("all_reduce").fabric.devices_per_node == 8
    shared = predict_seconds(params, size, 4, 4)[0]
    assert model.collective_seconds("all_reduce", 1 << 30, 4, 4) == pytest.approx(shared)
    assert shared > 4 * predict_seconds(unshared, size, 4, 4)[0]


def a100_file(name: str) -> pd.DataFrame:
    return read_calibration_file(CalibrationFile(path=str(DATA / name)))


def test_reads_nccl_tests_logs_with_ranks_and_nodes_from_the_file():
    table = a100_file("a100-16gpu-2node-aws-p4de-efa400_allreduce.txt")
    assert list(table.columns) == MEASUREMENT_COLUMNS
    assert set(table["num_ranks"]) == {16} and set(table["num_nodes"]) == {2}
    assert len(table) == 29  # out-of-place only, 8 B .. 2 GiB


def test_bad_calibration_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"hardware.calibration.files\[\].path=.*missing.txt.*no such file"):
        read_calibration_file(CalibrationFile(path=str(tmp_path / "missing.txt")))
    log = tmp_path / "allreduce.txt"
    log.write_text("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"
                   "1024 256 float sum -1 10.0 0.1 0.1 0 10.0 0.1 0.1 0\n")
    with pytest.raises(ConfigError, match="num_ranks"):
        read_calibration_file(CalibrationFile(path=str(log)))
    table = read_calibration_file(CalibrationFile(path=str(log), num_ranks=8, num_nodes=1))
    assert table["num_ranks"].tolist() == [8]
    with pytest.raises(ConfigError, match="not a multiple"):
        read_calibration_file(CalibrationFile(path=str(log), num_ranks=6, num_nodes=4))
    truncated = tmp_path / "truncated_allreduce.txt"
    truncated.write_text(log.read_text() + "2048 512 float sum -1 11.0\n")
    table = read_calibration_file(CalibrationFile(path=str(truncated), num_ranks=8, num_nodes=1))
    assert len(table) == 1  # the cut-short row is left out and reported with its line, never dropped silently
    assert table.attrs["skipped_lines"] == {"truncated row": {"count": 1, "lines": [3]}}


@pytest.mark.parametrize("name, limit_pct", [
    # 2026-11-28: 4.1 % (p4de) and 4.9 % (p5) from data-free priors (5.4 and 4.8 % from network_priors.yaml, which
    # saw the held-out sizes; 9.1 % on p4de before the EFA prior and NCCL's shorter LL128 tree chunks: 14 training
    # sizes leave the fit sensitive to its starting point)
    ("a100-16gpu-2node-aws-p4de-efa400_allreduce.txt", 10.0),
    ("h100-16gpu-2node-aws-p5-efa3200_allreduce.txt", 6.0),
])
def test_held_out_sizes_beat_alpha_beta_on_multi_node_logs(name, limit_pct):
    """Deterministic accuracy guard on public data (see benchmarks/comm_accuracy.py for all files), fitted from
    the priors of fit.json's held-out error, which never saw the held-out sizes."""
    table = a100_file(name)
    hw = hardware("h100-80g-p5" if name.startswith("h100") else "a100-80g-p4de")
    train = every_other_size(table)
    test = table[~train]
    fit = fit_collective(table[train], prior_params(hw, "all_reduce", **HELD_OUT_PRIORS))
    measured = test["time_s"].to_numpy()
    large = (test["message_bytes"] >= MIB).to_numpy()
    model = predict_table(fit.params, test)
    baseline = fit_alpha_beta(table[train], "all_reduce").predict(test)
    assert mape_pct(model[large], measured[large]) < limit_pct
    assert mape_pct(model, measured) < mape_pct(baseline, measured) / 2


def test_calibration_artifact_round_trips_into_the_comm_model(tmp_path):
    hw = hardware("h100-80g-p5")
    fit = write_calibration_artifact(hw, {"hardware": "h100-80g-p5"}, tmp_path / "cal")
    stored = json.loads((tmp_path / "cal" / "fit.json").read_text())
    assert stored["collectives"]["all_reduce"]["heldout"]["model_mape_pct_large"] < 6.0
    assert set(stored["sources"]) == {"data/nccl-tests/h100-16gpu-2node-aws-p5-efa3200_allreduce.txt"}
    model = CommModel.load(tmp_path / "cal", hw)
    measured = pd.read_parquet(tmp_path / "cal" / "measurements.parquet")
    row = measured[measured["message_bytes"] == 256 * MIB].iloc[0]
    assert model.collective_seconds("all_reduce", 256 * MIB, 16, 2) == pytest.approx(row["time_s"], rel=0.1)
    # collectives never measured borrow the fitted links: an all-gather moves half an all-reduce's bytes
    ag = model.collective_seconds("all_gather", 256 * MIB, 16, 2)
    # an all-reduce delivers at least what an all-gather does (ratio <= 1), and is at most a reduce-scatter
    # plus an all-gather of the same bytes per rank (ratio >= about 1/2, less the reduce-scatter's local
    # reduction work: 0.45); today 0.74 (the all-reduce uses NVLS inside the node)
    assert 0.45 < ag / model.collective_seconds("all_reduce", 256 * MIB, 16, 2) <= 1.0
    assert fit["hardware"] == "h100-80g-p5"


def test_copy_only_collectives_do_a_third_of_a_reductions_local_work():
    """A reduction reads two operands and writes one; an all-gather or all-to-all only writes what arrived.
    Fitted or borrowed, a copy's local work is a third of the reduction's, so on one node of A100s (NVLink
    well ahead of the memory) an all-gather takes about half an all-reduce of the same size, not more."""
    hw = hardware("a100-80g-selene")
    uncalibrated = CommModel.from_hardware(hw)
    all_reduce = uncalibrated.params("all_reduce")
    reduction = all_reduce.values["delta"]
    for copy in ("all_gather", "all_to_all", "broadcast", "send_recv"):
        assert uncalibrated.params(copy).values["delta"] == pytest.approx(reduction / 3)
    assert uncalibrated.params("reduce_scatter").values["delta"] == pytest.approx(reduction)
    fitted = replace(all_reduce, values={**all_reduce.values, "delta": 2 * reduction})
    borrowing = CommModel(hw, {"all_reduce": fitted}, source="test")
    assert borrowing.params("all_gather").values["delta"] == pytest.approx(2 * reduction / 3)
    ratio = uncalibrated.collective_seconds("all_gather", 1 << 30, 8, 1) / uncalibrated.collective_seconds(
        "all_reduce", 1 << 30, 8, 1)
    assert 0.4 < ratio < 0.55


def test_uncalibrated_model_and_bad_queries():
    model = CommModel.from_hardware(hardware("h800-dgx"))
    times = [model.collective_seconds("all_reduce", s, 64, 8) for s in (MIB, 16 * MIB, 256 * MIB)]
    assert all(np.diff(times) > 0) and times[0] > 5e-6
    assert model.collective_seconds("barrier", 0, 8, 1) > 0
    with pytest.raises(ValueError, match="unknown collective 'allreduce_fancy'"):
        model.collective_seconds("allreduce_fancy", MIB, 8, 1)
    with pytest.raises(ValueError, match="multiple of num_nodes"):
        model.collective_seconds("all_reduce", MIB, 6, 4)


def test_no_measurements_gives_an_empty_calibration(tmp_path):
    hw = hardware("h800-dgx")
    assert collect_measurements(hw).empty
    fit = write_calibration_artifact(hw, {"hardware": "h800-dgx"}, tmp_path / "cal")
    assert fit["collectives"] == {}
    assert CommModel.load(tmp_path / "cal", hw).collective_seconds("all_reduce", MIB, 8, 1) > 0


@pytest.mark.slow
def test_local_gloo_calibration(tmp_path):
    hw = hardware("local-cpu")
    cal = hw.calibration
    cal.sweep_ranks, cal.sweep_collectives, cal.sweep_max_bytes, cal.sweep_repeats = [2], ["all_reduce"], 65536, 1
    fit = write_calibration_artifact(hw, {"hardware": "local-cpu"}, tmp_path / "cal")
    entry = fit["collectives"]["all_reduce"]
    assert entry["rows"] == 7 and entry["params"]["channels"] == 1
    model = CommModel.load(tmp_path / "cal", hw)
    assert model.collective_seconds("all_reduce", 65536, 2, 1) > 0


HEADER = "#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"


def test_rows_with_wrong_results_are_skipped_and_counted(tmp_path):
    log = tmp_path / "all_reduce_perf.txt"
    log.write_text(HEADER + "1048576 262144 float sum -1 100.0 10.49 18.35 0 100.0 10.49 18.35 0\n"
                            "2097152 524288 float sum -1 150.0 13.98 24.47 3 150.0 13.98 24.47 0\n")
    table = read_calibration_file(CalibrationFile(path=str(log), num_ranks=8, num_nodes=1))
    assert table["message_bytes"].tolist() == [1048576]  # out-of-place row with 3 wrong results left out
    assert table.attrs["skipped_wrong"] == 1
    hw = hardware("h800-dgx")
    hw.calibration.files = [CalibrationFile(path=str(log), num_ranks=8, num_nodes=1)]
    assert collect_measurements(hw).attrs["skipped_wrong"] == {str(log): 1}


def test_time_unit_that_contradicts_the_header_is_refused(tmp_path):
    log = tmp_path / "all_reduce_perf.txt"  # times in ms under a header that says us (algbw disagrees)
    log.write_text(HEADER + "1048576 262144 float sum -1 0.100 10.49 18.35 0 0.100 10.49 18.35 0\n")
    with pytest.raises(ConfigError, match="time unit mismatch"):
        read_calibration_file(CalibrationFile(path=str(log), num_ranks=8, num_nodes=1))


def test_mixed_collectives_in_one_file_are_refused(tmp_path):
    log = tmp_path / "sweep.txt"
    row = "1048576 262144 float sum -1 100.0 10.49 18.35 0 100.0 10.49 18.35 0\n"
    log.write_text("# ./build/all_reduce_perf -b 1M -e 1M -g 8\n" + HEADER + row
                   + "# ./build/all_gather_perf -b 1M -e 1M -g 8\n" + HEADER + row)
    with pytest.raises(ConfigError, match="mixed collectives"):
        read_calibration_file(CalibrationFile(path=str(log), num_ranks=8, num_nodes=1))


def test_all_to_all_across_nodes_loads_the_nics_as_moe_dispatch_does():
    """Every rank of an all-to-all sends (N-K)/N of its buffer off its node: on 2 x 8 GPUs 4.3x a ring's network
    bytes. NCCL's all-to-all on 2 x 8 A100 (mscclpp summary: 26.6 ms at 1 GiB, 106.5 ms at 4 GiB) is predicted
    within 20 % by a config never fitted to an all-to-all (-80 % when it was priced as a ring)."""
    from trainsim.timeline.stage import comm_model

    hw = compose_run(["hardware=a100-80g-selene", "hardware.num_nodes=2"], check="layout").hardware
    model = comm_model(hw, None)
    size = 1 << 30
    ratio = model.collective_seconds("all_to_all", size, 16, 2) / model.collective_seconds("all_gather", size, 16, 2)
    assert ratio == pytest.approx(8 * 8 / 15, rel=0.1)
    # one node: the same bytes over each GPU's NVLink as a ring (nccl-tests: 254.7 vs 253.6 GB/s bus bandwidth)
    assert model.collective_seconds("all_to_all", size, 8, 1) == pytest.approx(
        model.collective_seconds("all_gather", size, 8, 1), rel=0.05)
    rows = read_calibration_file(CalibrationFile(path=str(DATA_DIR / "nccl-tests/a100-ndmv4-azure-1node-2node_summary_"
                                                      "mscclpp.txt"), collective="all_to_all", num_ranks=16))
    large = rows[rows["message_bytes"] >= size]
    assert len(large) == 2
    for r in large.itertuples():
        assert model.collective_seconds("all_to_all", r.message_bytes, 16, 2) == pytest.approx(r.time_s, rel=0.2)


def test_nccl_all_to_all_is_grouped_send_recv_and_gloo_pairwise_rounds():
    """NCCL's all-to-all sends to every peer at once: a small one pays one step's latency, not a ring's N-1
    (1 x 8 A100, 1 KiB: 9.3 us against the all-gather's 12.5 us), and across nodes it runs the Simple protocol
    (the network's p2p connections have no LL buffers: 2 x 1, 1 KiB: 29.8 us against 16.1 us). gloo exchanges
    with one peer per round, a ring's structure."""
    from trainsim.timeline.stage import comm_model

    hw = compose_run(["hardware=a100-80g-selene", "hardware.num_nodes=2"], check="layout").hardware
    model = comm_model(hw, None)
    assert model.params("all_to_all").algorithms == ("p2p",)
    assert model.collective_seconds("all_to_all", 1024, 8, 1) < model.collective_seconds("all_gather", 1024, 8, 1)
    assert model.collective_seconds("all_to_all", 1024, 2, 2) > model.collective_seconds("all_gather", 1024, 2, 2)
    latency = {n: model.collective_seconds("all_to_all", 1024 * n, n, 1) for n in (2, 8)}
    assert latency[8] == pytest.approx(latency[2], rel=0.1)  # peers in parallel: no growth with N
    local = compose_run(["hardware=local-cpu"], check="layout").hardware
    assert prior_params(local, "all_to_all").algorithms == ("ring",)
