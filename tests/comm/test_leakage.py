"""Held-out collective figures (benchmarks/comm_accuracy.py) never fit what they hold out (issue 52).

Each test poisons measured times (x5) as every reader hands them out (calibration files: nccl-tests logs,
author tables, the mscclpp summary), then reruns the figure's own code: poisoning the held-out part must leave
the fits and the predictions of the held-out rows where they were, poisoning a training part must move them (so a
leak would show). Clusters are the cheap ones of network_fit.CLUSTERS (no single-node fit to redo).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainsim.comm import calibration, network_fit, nvlink_fit
from trainsim.comm.fit import every_other_size
from trainsim.comm.network_fit import CLUSTERS, load_clusters

pytestmark = pytest.mark.leakage

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "nccl-tests"
P5 = "h100-16gpu-2node-aws-p5-efa3200_allreduce.txt"
COREWEAVE = "h100-64gpu-8node-coreweave-ndr-ib-sharp_allreduce.txt"
AZURE = "a100-ndmv4-azure-1node-2node_summary_mscclpp.txt"
HYPERPOD = "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_{}.txt"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("comm_accuracy", REPO / "benchmarks" / "comm_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources(*names: str, overrides: tuple[str, ...] = ()) -> tuple:
    return tuple(dataclasses.replace(s, overrides=s.overrides + overrides) for s in CLUSTERS if s.name in names)


def h100_clusters():
    """AWS p5 and CoreWeave: neither has a single-node file, so loading them fits nothing."""
    return load_clusters(sources("aws-p5-efa", "coreweave-h100-ib-ndr"))


def poison(monkeypatch, bench, file_name: str, rows="all") -> list[int]:
    """Every reader returns `file_name`'s rows ('all'; 'held_out': the sizes every_other_size leaves out of
    training; or a function of the table giving a mask) with five times their measured time. Returns the count of
    rows poisoned so far (one entry)."""
    poisoned = [0]

    def wrap(read):
        def reader(*args, **kwargs):
            table = read(*args, **kwargs).copy()
            mine = table["source"].map(lambda s: Path(s).name == file_name).to_numpy(bool, copy=True)
            if rows == "held_out":
                mine &= ~every_other_size(table)
            elif callable(rows):
                mine &= rows(table)
            table.loc[mine, "time_s"] *= 5
            poisoned[0] += int(mine.sum())
            return table
        return reader

    for module, name in ((calibration, "read_calibration_file"), (network_fit, "read_calibration_file"),
                         (nvlink_fit, "read_calibration_file"), (bench, "read_calibration_file")):
        monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    return poisoned


def same(a, b) -> bool:
    return np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-9, atol=0)


def assert_held_out(run, monkeypatch, bench, held_out: tuple, trained: tuple) -> None:
    """`run`'s figure inputs do not move when the held-out data (poison's arguments `held_out`) are poisoned,
    some rows being hit, and do move when training data (`trained`) are: the check can fail."""
    clean = run()
    with monkeypatch.context() as m:
        hits = poison(m, bench, *held_out)
        assert same(run(), clean) and hits[0] > 0
    with monkeypatch.context() as m:
        poison(m, bench, *trained)
        assert not same(run(), clean)


def params_and_predictions(result: dict) -> np.ndarray:
    values = result["params"].values
    return np.concatenate([[values[k] for k in sorted(values)], result["predicted"]])


def test_held_out_sizes_of_a_file_never_reach_its_fit_or_its_network_priors(bench, monkeypatch):
    """comm_mape_pct_large_all / small_all: the p5 log fitted on every other size, from network priors learned
    without it (here CoreWeave's). Its held-out sizes must not move the fit; CoreWeave's log must."""
    def run():
        return params_and_predictions(bench.held_out_sizes(DATA / P5, h100_clusters()))

    assert_held_out(run, monkeypatch, bench, held_out=(P5, "held_out"), trained=(COREWEAVE,))


def test_vtrain_8gpu_table_never_reaches_the_scale_fit(bench, monkeypatch):
    """comm_mape_pct_scale_vtrain8: fitted on vTrain's 2- and 4-GPU tables, from priors learned without the
    8-GPU one (which is also an NVLink-efficiency source); the 8-GPU table must not move it. One channel count
    instead of the search over six (which reads the same rows), to fit 1,024 rows faster."""
    monkeypatch.setattr(bench, "channel_choices", lambda hw: (2,))

    def run():
        return params_and_predictions(bench.vtrain_scale(DATA, h100_clusters()))

    assert_held_out(run, monkeypatch, bench, held_out=("a100-8gpu-nvlink_allreduce_vtrain-lut.csv",),
                    trained=("a100-2gpu-nvlink_allreduce_vtrain-lut.csv",))


def test_held_out_cluster_never_reaches_its_network_prior_or_the_baseline(bench, monkeypatch):
    """comm_mape_pct_cross_cluster (and its alpha-beta baseline): p5 predicted from priors learned on the other
    cluster; p5's own log must not move them, CoreWeave's must."""
    def run():
        clusters = h100_clusters()
        model = bench.cross_cluster(clusters).set_index("cluster").loc["aws-p5-efa"]
        baseline = bench.alpha_beta_cross_cluster(clusters).set_index("case").loc["aws-p5-efa"]
        return [*model[["efficiency", "hop_latency_us"]], *baseline[["latency_us", "ratio"]]]

    assert_held_out(run, monkeypatch, bench, held_out=(P5,), trained=(COREWEAVE,))


def test_azure_file_never_reaches_the_all_to_all_predictions(bench, monkeypatch):
    """comm_mape_pct_alltoall, its as-ring baseline and alltoall_structure's ratio: the Azure all-to-all priced
    with priors learned without Azure's file (its all-reduce included). Azure is loaded without its
    single-node files (nothing to fit); the file itself is what must be left out."""
    def run():
        clusters = [*load_clusters(sources("azure-ndmv4-ib-hdr", overrides=("hardware.calibration.files=[]",))),
                    *h100_clusters()]
        rows = bench.all_to_all_public(clusters)
        return pd.concat([rows["predicted_ms"], rows["ring_ms"]]).to_numpy()

    assert_held_out(run, monkeypatch, bench, held_out=(AZURE,), trained=(COREWEAVE,))


def test_node_scaling_sees_two_nodes_of_its_cluster_only(bench, monkeypatch):
    """comm_mape_pct_node_scaling: the p5 HyperPod all-gather fitted on its 2-node rows, from priors learned
    without its cluster. Its 4-32 node rows, and the same cluster's all-reduce table (a cluster of the network
    priors), must not move the fit or its predictions; its 2-node rows must. One table and one channel count to
    keep it fast."""
    monkeypatch.setattr(bench, "P5_TABLES", ("data/nccl-tests/" + HYPERPOD.format("all_gather"),))
    monkeypatch.setattr(bench, "channel_choices", lambda hw: (16,))
    clusters = load_clusters(sources("aws-p5-efa", "aws-p5-hyperpod-efa"))

    scored = bench.fit_and_score

    def run():
        fits = []
        monkeypatch.setattr(bench, "fit_and_score", lambda *args: fits.append(scored(*args)) or fits[-1])
        bench.node_scaling(load_clusters(sources("aws-p5-efa", "aws-p5-hyperpod-efa")))
        return params_and_predictions(fits[0])

    assert clusters[1].name == bench.P5_HYPERPOD
    clean = run()
    for name, rows in ((HYPERPOD.format("all_gather"), lambda t: (t["num_nodes"] > 2).to_numpy()),
                       (HYPERPOD.format("all_reduce"), lambda t: np.ones(len(t), bool))):
        with monkeypatch.context() as m:
            hits = poison(m, bench, name, rows)
            assert same(run(), clean) and hits[0] > 0
    with monkeypatch.context() as m:
        poison(m, bench, HYPERPOD.format("all_gather"), lambda t: (t["num_nodes"] == 2).to_numpy())
        assert not same(run(), clean)


def synthetic_gloo_sweep() -> pd.DataFrame:
    """A gloo sweep's table (2-4 ranks, all-reduce and all-to-all) with times a ring model gives, so the test
    needs no processes: what matters is which rows the fits read."""
    rows = []
    for collective, scale in (("all_reduce", 1.0), ("all_to_all", 1.3)):
        for ranks in (2, 3, 4):
            for size in 1 << np.arange(10, 22, 2):
                seconds = scale * (40e-6 * ranks + 2 * (ranks - 1) / ranks * size / 2e9)
                rows.append({"collective": collective, "algorithm": "gloo", "protocol": "gloo", "num_ranks": ranks,
                             "num_nodes": 1, "message_bytes": int(size), "time_s": seconds,
                             "source": "local sweep (gloo)"})
    return pd.DataFrame(rows)


def test_gloo_fits_never_read_their_held_out_ranks_or_sizes(bench, monkeypatch):
    """comm_mape_pct_scale_gloo / alltoall_gloo (fit on 2 ranks, predict 3 and 4) and
    alltoall_gloo_heldout_sizes (the all-to-all fit on every other size): poisoning what each predicts leaves it
    where it was, poisoning 2 ranks moves both."""
    sweep = synthetic_gloo_sweep()

    def run(poisoned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        table = sweep.copy()
        table.loc[poisoned, "time_s"] *= 5
        monkeypatch.setattr(bench, "local_sweep", lambda hw: table)
        scale, sizes = bench.gloo_scale()
        return np.concatenate(scale.apply(params_and_predictions, axis=1).tolist()), params_and_predictions(sizes)

    clean_scale, clean_sizes = run(np.zeros(len(sweep), bool))
    alltoall = (sweep["collective"] == "all_to_all").to_numpy()
    held_sizes = np.zeros(len(sweep), bool)
    held_sizes[np.flatnonzero(alltoall)[~every_other_size(sweep[alltoall].reset_index(drop=True))]] = True
    assert same(run((sweep["num_ranks"] > 2).to_numpy())[0], clean_scale)
    assert same(run(held_sizes)[1], clean_sizes)
    moved_scale, moved_sizes = run((sweep["num_ranks"] == 2).to_numpy())
    assert not same(moved_scale, clean_scale) and not same(moved_sizes, clean_sizes)


def test_calibration_held_out_error_starts_from_no_learned_prior(monkeypatch):
    """fit.json's held-out error (reports, provenance): fitted on every other size of the p5 log, it must not
    start from the learned priors, which saw every size. Learned priors as if learned on poisoned rows must
    leave it where it was; poisoning its training sizes must move it."""
    from trainsim.comm import model
    from trainsim.comm.calibration import heldout_errors, read_calibration_file
    from trainsim.comm.network import NetworkPrior
    from trainsim.config import compose_run
    from trainsim.config.schema import CalibrationFile

    hw = compose_run(["hardware=h100-80g-p5"], check="layout").hardware
    table = read_calibration_file(CalibrationFile(path=str(DATA / P5)))
    clean = heldout_errors(table, hw, "all_reduce")
    learned = model.network_prior
    poisoned = NetworkPrior("all", "all", 0.2, 1e-3, (), 0.0)
    with monkeypatch.context() as m:  # network_priors.yaml and NVLINK_EFFICIENCY as if learned on poisoned rows
        m.setattr(model, "network_prior", lambda hw, table=None: learned(hw, table) if table is not None else poisoned)
        m.setattr(model, "NVLINK_EFFICIENCY", 0.5)
        assert heldout_errors(table, hw, "all_reduce") == clean
    training_poisoned = table.copy()
    training_poisoned.loc[every_other_size(table), "time_s"] *= 5
    assert heldout_errors(training_poisoned, hw, "all_reduce")["model_mape_pct_large"] != clean["model_mape_pct_large"]
