"""Accuracy of the collective model against measured collectives, next to the alpha-beta baseline.

What each figure holds out, and what it fits without (nothing data-dependent a held-out figure uses was
learned from its held-out data; tests/comm/test_leakage.py poisons the held-out data to check):
  1. Every nccl-tests file in data/nccl-tests: fit on every other message size, predict the
     rest; MAPE for messages >= 1 MiB and < 1 MiB, model and baseline. The fit starts from priors
     learned without the file: network priors from the clusters that never read it (comm/network_fit.py
     priors_without: a cluster's own log leaves that cluster out, a single-node file every cluster whose
     intra-node side it fits), not network_priors.yaml, which has seen every file; the NVLink efficiency
     from the other NVLink sources (comm/nvlink_fit.py; the vTrain 8-GPU table is one).
     Baselines: alpha-beta (latency + busfactor * size / busbw, both fitted) and NCCL's own tuner
     model (its constants, bus bandwidth fitted; comm/nccl_tuner.py).
  2. Scale: vTrain's single-node A100 all-reduce tables, fit on 2 and 4 GPUs, predict 8 (priors learned
     without the 8-GPU table, as in 1).
  3. Across clusters: each measured multi-node cluster (comm/network_fit.py CLUSTERS: AWS p4de and p5
     over EFA, OCI over RoCE, CoreWeave and Azure over InfiniBand) predicted from its hardware description
     alone, with the network priors learned on the other clusters (leave-one-cluster-out), next to an
     alpha-beta model transferred the same way (latency and bus bandwidth / nominal bandwidth).
  4. Scale here: gloo sweep on this machine, fit on 2 ranks, predict 3 and 4 (per collective).
  5. All-to-all (MoE token dispatch): NCCL's all-to-all on Azure NDm A100 v4 (1 x 8, 2 x 1 and 2 x 8 GPUs;
     1 KiB latency, 1 and 4 GiB bus bandwidth; the mscclpp summary in data/nccl-tests) predicted by the
     uncalibrated a100-80g-selene model (the same network): datasheet rates, NCCL constants and network
     priors learned on the other clusters, so nothing of this file (its all-reduce included) is fitted and
     every point is held out. Baseline: the same model pricing it as a ring (an all-gather of the same
     size). Beside it the all-to-all's structure alone: the cluster's measured all-gather of the same size
     times the model's all-to-all / all-gather ratio (what the all-to-all adds, without the link
     calibration both share; the measured all-gather is this figure's input, the ratio is held out).
     gloo's all-to-all on this machine, fit on every other size, predicts the rest (part 4's sweep).
`comm_files_refused`: files of data/nccl-tests the calibration reader refuses, each printed with its reason (target
0, except a file whose header contradicts its busbw / algbw, printed apart).
The `_all` figures are means over files (each file counts once, whatever its number of sizes), the
`_cross_cluster` ones over clusters. The hardware config describing a file's cluster gives its datasheet
priors.

    python benchmarks/comm_accuracy.py [--data data/nccl-tests] [--skip-gloo]
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
from figures import figure

from trainsim.comm.calibration import (
    LARGE_BYTES,
    channel_choices,
    local_sweep,
    read_calibration_file,
)
from trainsim.comm.fit import AlphaBeta, every_other_size, fit_alpha_beta, fit_collective, mape_pct, predict_table
from trainsim.comm.model import CommModel, prior_params
from trainsim.comm.nccl_tuner import fit_nccl_tuner
from trainsim.comm.network import domain_bandwidth
from trainsim.comm.network_fit import LEVELS, Cluster, held_out, load_clusters, priors_without
from trainsim.comm.nvlink_fit import nvlink_efficiency
from trainsim.config import compose_run
from trainsim.config.data_path import resolve_data_path
from trainsim.config.schema import CalibrationFile
from trainsim.errors import ConfigError

HARDWARE_BY_PREFIX = {"a100": "a100-80g-dgx", "h100": "h100-sxm-dgx", "h200": "h100-sxm-dgx", "b200": "dgx-b200"}


CLUSTER_HARDWARE = {"p4de": "a100-80g-p4de", "p5": "h100-80g-p5", "oci": "a100-40g-oci", "ndmv4": "a100-80g-selene"}
"""Files of a named cluster: the hardware config describing that cluster (its network)."""
STATED_NCCL = {"use3a": "2.29.7", "slinky": "2.28.9"}
"""Files of a named cluster -> the NCCL release their log or report states, where the hardware config's differs
(it decides how many channels a send/recv peer gets across nodes: comm.model.p2p_peer_channels)."""


def stated(name: str) -> tuple[str, ...]:
    """The overrides describing a file's cluster as its log states it (its NCCL release)."""
    return tuple(f"hardware.nccl.version={version}" for tag, version in STATED_NCCL.items() if tagged(name, tag))


def tagged(name: str, tag: str) -> bool:
    """Whether a data file's name carries a cluster's tag as one of its dash- or underscore-separated words."""
    return re.search(rf"[-_]{tag}[-_]", name) is not None


def hardware_for(name: str):
    key = next((hw for tag, hw in CLUSTER_HARDWARE.items() if tagged(name, tag)),
               HARDWARE_BY_PREFIX.get(name.split("-")[0], "a100-80g-dgx"))
    return compose_run([f"hardware={key}", *stated(name)], check="layout").hardware


def held_out_prior(hw, collective: str, clusters: list[Cluster], paths: list[Path]):
    """hw's prior parameters with the learned ones (network hop, NVLink efficiency) learned without `paths`."""
    return prior_params(hw, collective, network_priors=priors_without(clusters, paths),
                        nvlink_efficiency=nvlink_efficiency(without=paths))


def fit_and_score(train: pd.DataFrame, test: pd.DataFrame, hw, prior) -> dict:
    """Fit on `train` from `prior` (learned without `test`), score `test`; 'params' and 'predicted' are the fit
    and its predictions of `test`."""
    collective = prior.collective
    fit = fit_collective(train, prior, channel_choices(hw))
    model, baseline = predict_table(fit.params, test), fit_alpha_beta(train, collective).predict(test)
    tuner = fit_nccl_tuner(train, collective, hw.nccl.version).predict(test)
    measured = test["time_s"].to_numpy()
    large = (test["message_bytes"] >= LARGE_BYTES).to_numpy()
    return {"model_large": mape_pct(model[large], measured[large]),
            "model_small": mape_pct(model[~large], measured[~large]),
            "base_large": mape_pct(baseline[large], measured[large]),
            "base_small": mape_pct(baseline[~large], measured[~large]),
            "tuner_large": mape_pct(tuner[large], measured[large]),
            "model_all": mape_pct(model, measured), "base_all": mape_pct(baseline, measured),
            "channels": fit.params.channels, "rows": len(test), "params": fit.params, "predicted": model}


# set: sizes a sweep needs for the held-out-sizes figure (every other one held out)
MIN_SWEEP_SIZES = 4


def auto_curves(path: Path) -> pd.DataFrame:
    """A file's measurements of what NCCL picks itself (an author table's forced-algorithm curves left out)."""
    table = read_calibration_file(CalibrationFile(path=str(path)))
    return table[table["algorithm"] == "auto"].reset_index(drop=True)


def sweeps(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of the (ranks, nodes) sweeps with at least MIN_SWEEP_SIZES sizes."""
    sizes = table.groupby(["num_ranks", "num_nodes"])["message_bytes"].transform("nunique")
    return table[sizes >= MIN_SWEEP_SIZES].reset_index(drop=True)


def held_out_sizes(path: Path, clusters: list[Cluster], collective: str | None = None) -> dict:
    """One file's sweeps of one collective (default: its only one) fitted on every other size, from priors
    learned without the file (held_out_prior: network priors from the clusters that never read it, the NVLink
    efficiency from the other sources), predicting the rest."""
    table = sweeps(auto_curves(path))
    collective = collective or table["collective"].iloc[0]
    table = table[table["collective"] == collective].reset_index(drop=True)
    train = every_other_size(table)
    hw = hardware_for(path.name)
    prior = held_out_prior(hw, collective, clusters, [path])
    return fit_and_score(table[train], table[~train].reset_index(drop=True), hw, prior)


def per_file(data: Path, clusters: list[Cluster]) -> tuple[pd.DataFrame, dict[str, str], list[str]]:
    """The held-out-sizes scores of every (file, collective) with sweeps, file -> reason for the files the reader
    refuses, and the files read whose curves are too short to hold sizes out (scored by the sections below).
    Lines a file's reader leaves out are printed with their reason."""
    rows, refused, unscored = [], {}, []
    for path in sorted(data.iterdir()):
        try:
            curves = auto_curves(path)
        except ConfigError as exc:
            refused[path.name] = str(exc).splitlines()[0]
            continue
        for reason, seen in curves.attrs.get("skipped_lines", {}).items():
            print(f"read, {seen['count']} lines left out ({reason}): {path.name}")
        collectives = sorted(set(sweeps(curves)["collective"]))
        if not collectives:
            unscored.append(path.name)
        for collective in collectives:
            rows.append({"file": path.name, "collective": collective,
                         **held_out_sizes(path, clusters, collective)})
    return pd.DataFrame(rows).drop(columns=["params", "predicted"]), refused, unscored


def contradicts_its_header(reason: str) -> bool:
    """A refusal because the file's stated rank count disagrees with its busbw / algbw (nccl_ranks.py): right."""
    return "busbw / algbw implies" in reason


def vtrain_scale(data: Path, clusters: list[Cluster]) -> dict:
    """Fit on vTrain's 2- and 4-GPU tables, predict the 8-GPU one (priors learned without it)."""
    paths = {n: data / f"a100-{n}gpu-nvlink_allreduce_vtrain-lut.csv" for n in (2, 4, 8)}
    tables = {n: read_calibration_file(CalibrationFile(path=str(p))) for n, p in paths.items()}
    train = pd.concat([tables[2], tables[4]], ignore_index=True)
    hw = hardware_for("a100")
    return fit_and_score(train, tables[8], hw, held_out_prior(hw, "all_reduce", clusters, [paths[8]]))


def _signed_errors(name: str, predicted, table: pd.DataFrame) -> dict:
    measured = table["time_s"].to_numpy()
    large = (table["message_bytes"] >= LARGE_BYTES).to_numpy()
    error = 100 * (predicted / measured - 1)
    return {"case": name, "rows": len(table), "mape_large": mape_pct(predicted[large], measured[large]),
            "mape_small": mape_pct(predicted[~large], measured[~large]),
            "signed_errors_pct": " ".join(f"{e:+.0f}" for e in error) if len(table) <= 4 else ""}


def alpha_beta_cross_cluster(clusters: list[Cluster]) -> pd.DataFrame:
    """The baseline on the same protocol: each cluster's alpha-beta fit as (latency, bus bandwidth / nominal
    node bandwidth); a held-out cluster takes the geometric mean over the other clusters of its most specific
    group (link generation, transport, plugin, all), as the model's priors do."""
    fits = {}
    for c in clusters:
        ab = fit_alpha_beta(c.table, "all_reduce")
        fits[c.name] = (max(ab.latency_s, 1e-7), ab.bus_bandwidth_bytes_per_s / domain_bandwidth(c.hardware))
    rows = []
    for c in clusters:
        others = [o for o in clusters if o is not c]
        for level in LEVELS:
            group = [o for o in others if c.keys()[level] and o.keys()[level] == c.keys()[level]]
            if group:
                break
        latency = float(np.exp(np.mean([np.log(fits[o.name][0]) for o in group])))
        ratio = float(np.exp(np.mean([np.log(fits[o.name][1]) for o in group])))
        predicted = AlphaBeta("all_reduce", latency, ratio * domain_bandwidth(c.hardware)).predict(c.table)
        rows.append(_signed_errors(c.name, predicted, c.table) | {"level": f"{level} {c.keys()[level]}",
                                                                   "latency_us": 1e6 * latency, "ratio": ratio})
    return pd.DataFrame(rows)


def cross_cluster(clusters: list[Cluster]) -> pd.DataFrame:
    """Leave-one-cluster-out over the measured multi-node clusters: model (network priors learned on the
    others, comm/network_fit.py) next to the alpha-beta baseline on the same protocol."""
    model = held_out(clusters)
    baseline = alpha_beta_cross_cluster(clusters).set_index("case")
    model["base_large"] = model["cluster"].map(baseline["mape_large"])
    model["base_small"] = model["cluster"].map(baseline["mape_small"])
    return model


def gloo_scale() -> tuple[pd.DataFrame, dict]:
    """Per collective: fit on 2 ranks, predict 3 and 4; and the all-to-all fit on every other size (all rank
    counts), predicting the rest."""
    hw = compose_run(["hardware=local-cpu"], check="layout").hardware
    measurements = local_sweep(hw)
    rows = []
    for collective, table in measurements.groupby("collective"):
        train, test = table[table["num_ranks"] == 2], table[table["num_ranks"] > 2].reset_index(drop=True)
        rows.append({"collective": collective, **fit_and_score(train, test, hw, prior_params(hw, collective))})
    alltoall = measurements[measurements["collective"] == "all_to_all"].reset_index(drop=True)
    train = every_other_size(alltoall)
    sizes = fit_and_score(alltoall[train], alltoall[~train].reset_index(drop=True), hw, prior_params(hw, "all_to_all"))
    return pd.DataFrame(rows), sizes


AZURE_SUMMARY = "data/nccl-tests/a100-ndmv4-azure-1node-2node_summary_mscclpp.txt"


def all_to_all_public(clusters: list[Cluster]) -> pd.DataFrame:
    """Every NCCL all-to-all point of the mscclpp summary (section 5), held out: predicted by the uncalibrated
    a100-80g-selene model ('predicted'; the same network; datasheet rates, NCCL constants and network priors
    learned on the other clusters, never on this file), the same model pricing it as a ring, an all-gather of
    the same size ('as_ring'), and the cluster's measured all-gather of the same size times the model's
    all-to-all / all-gather ratio ('structure': the all-to-all's own structure, without the link calibration
    both share)."""
    path = resolve_data_path(AZURE_SUMMARY, "comm_accuracy")
    priors = priors_without(clusters, [path])
    table = read_calibration_file(CalibrationFile(path=AZURE_SUMMARY)).set_index(["num_ranks", "num_nodes"])
    rows = []
    for (ranks, nodes), curve in table.groupby(level=[0, 1], sort=False):
        hw = compose_run(["hardware=a100-80g-selene", f"hardware.num_nodes={nodes}"], check="layout").hardware
        model = CommModel.from_hardware(hw, priors)
        gathers = curve[curve["collective"] == "all_gather"].set_index("message_bytes")["time_s"]
        for r in curve[curve["collective"] == "all_to_all"].itertuples():
            predicted = model.collective_seconds("all_to_all", r.message_bytes, ranks, nodes)
            ring = model.collective_seconds("all_gather", r.message_bytes, ranks, nodes)
            structure = gathers[r.message_bytes] * predicted / ring
            rows.append({"nodes x gpus": f"{nodes} x {ranks // nodes}", "bytes": r.message_bytes,
                         "measured_ms": 1e3 * r.time_s, "predicted_ms": 1e3 * predicted, "ring_ms": 1e3 * ring,
                         "error_pct": 100 * (predicted / r.time_s - 1),
                         "ring_error_pct": 100 * (ring / r.time_s - 1),
                         "structure_error_pct": 100 * (structure / r.time_s - 1)})
    return pd.DataFrame(rows)


P5_TABLES = tuple(f"data/nccl-tests/h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_{c}.txt"
                  for c in ("all_reduce", "all_gather", "alltoall"))
"""AWS p5 (EFA v2) on 2-32 nodes: the node-scaling figure's tables."""
P5_HYPERPOD = "aws-p5-hyperpod-efa"
"""Their cluster in network_fit.CLUSTERS (its all-reduce table): left out of every prior that predicts it."""


def without_cluster(clusters: list[Cluster], name: str) -> list[Cluster]:
    """The clusters but `name`: a held-out cluster's other logs (another collective, other node counts) must not
    teach the network priors that predict it."""
    return [c for c in clusters if c.name != name]


def node_scaling(clusters: list[Cluster]) -> pd.DataFrame:
    """Each p5 table fitted on its 2-node rows (priors learned without its cluster), predicting 4-32 nodes;
    alpha-beta fitted the same way beside it. One row per (collective, nodes): MAPE and signed mean error, %."""
    hw = compose_run(["hardware=h100-80g-p5"], check="layout").hardware
    rows = []
    for name in P5_TABLES:
        path = resolve_data_path(name, "comm_accuracy")
        table = auto_curves(path)
        collective = table["collective"].iloc[0]
        train, test = table[table["num_nodes"] == 2], table[table["num_nodes"] > 2].reset_index(drop=True)
        prior = held_out_prior(hw, collective, without_cluster(clusters, P5_HYPERPOD), [path])
        score = fit_and_score(train, test, hw, prior)
        baseline = fit_alpha_beta(train, collective).predict(test)
        for nodes, part in test.groupby("num_nodes"):
            measured, index = part["time_s"].to_numpy(), part.index.to_numpy()
            rows.append({"collective": collective, "nodes": nodes,
                         "mape": mape_pct(score["predicted"][index], measured),
                         "bias": float(np.mean(score["predicted"][index] / measured - 1) * 100),
                         "base_mape": mape_pct(baseline[index], measured), "rows": len(part)})
    return pd.DataFrame(rows)


NCCL_TESTS = "data/nccl-tests/"
MULTINODE = {
    "all_to_all": {
        P5_HYPERPOD: ("h100-80g-p5", (NCCL_TESTS + "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_alltoall.txt",)),
        "azure-ndmv4-ib-hdr": ("a100-80g-selene", (AZURE_SUMMARY,)),
    },
    "send_recv": {
        "together-b200-ib-ndr": ("dgx-b200", (
            NCCL_TESTS + "b200-16to512gpu-2to64node-together_use3a-ss-ib_cx7_400g_sendrecv_busbw_table.txt",
            NCCL_TESTS + "b200-16gpu-2node-together_use3a-ss-ib_cx7_400g_sendrecv.txt")),
        "together-b200-slinky-ib-ndr-sharp": ("dgx-b200", (
            NCCL_TESTS + "b200-8to512gpu-1to64node-together_slinky-ib_ndr400_12hca_sharp_peak_busbw_tables.txt",)),
    },
}
"""Per collective, the clusters a hardware config describes with their multi-node logs: cluster -> (hardware,
files). The H100 pair on a slow fabric (xxrjun cluster00) is not among them: its source does not state its
interconnect."""


def multinode(collective: str, clusters: list[Cluster]) -> pd.DataFrame:
    """Each cluster's multi-node rows of `collective`, predicted from its hardware description alone (the model
    `trainsim compose` uses for a cluster it has no measurement of: datasheet rates, NCCL constants and the
    network priors, learned without the cluster). One row per (cluster, file, nodes): MAPE and bias, %."""
    rows = []
    for cluster, (hardware, names) in MULTINODE[collective].items():
        paths = [resolve_data_path(name, "comm_accuracy") for name in names]
        priors = priors_without(without_cluster(clusters, cluster), paths)
        for path in paths:
            table = auto_curves(path)
            table = table[(table["collective"] == collective) & (table["num_nodes"] > 1)]
            for (ranks, nodes), part in table.groupby(["num_ranks", "num_nodes"]):
                hw = compose_run([f"hardware={hardware}", f"hardware.num_nodes={nodes}", *stated(path.name)],
                                 check="layout").hardware
                model = CommModel.from_hardware(hw, priors)
                predicted = np.array([model.collective_seconds(collective, int(b), int(ranks), int(nodes))
                                      for b in part["message_bytes"]])
                measured = part["time_s"].to_numpy()
                large = (part["message_bytes"] >= LARGE_BYTES).to_numpy()
                rows.append({"cluster": cluster, "file": path.name[:40], "nodes": nodes, "ranks": ranks,
                             "mape_large": mape_pct(predicted[large], measured[large]),
                             "bias_large": float(np.mean(predicted[large] / measured[large] - 1) * 100),
                             "rows": int(large.sum())})
    return pd.DataFrame(rows)


def cluster_mean(table: pd.DataFrame) -> float:
    """Mean over clusters of each cluster's row-weighted MAPE at >= 1 MiB."""
    weighted = table.assign(w=table["mape_large"] * table["rows"]).groupby("cluster")[["w", "rows"]].sum()
    return float((weighted["w"] / weighted["rows"]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / "data/nccl-tests")
    parser.add_argument("--skip-gloo", action="store_true", help="skip the local gloo sweep (about a minute)")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    start = time.perf_counter()
    clusters = load_clusters()
    files, refused, unscored = per_file(args.data, clusters)
    for name, reason in refused.items():
        kind = "header contradicts its numbers" if contradicts_its_header(reason) else "refused"
        print(f"{kind}: {name}: {reason[:200]}")
    for name in unscored:
        print(f"read, curves too short to hold sizes out (scored below): {name}")
    figure("comm_files_refused", sum(not contradicts_its_header(r) for r in refused.values()), "files", "d")
    print("\nHeld-out sizes (fit on every other size), MAPE %:")
    print(files.round(2).to_string(index=False))
    figure("comm_mape_pct_large_all", files['model_large'].mean(), "%")
    figure("comm_mape_pct_small_all", files['model_small'].mean(), "%")
    figure("baseline_mape_pct_large_all", files['base_large'].mean(), "%")
    figure("baseline_mape_pct_small_all", files['base_small'].mean(), "%")
    figure("nccl_tuner_mape_pct_large_all", files['tuner_large'].mean(), "%")
    beats = (files["model_all"] < files["base_all"]).sum()
    figure("comm_files_better_than_baseline", f"{beats}/{len(files)}", "files")
    scale = vtrain_scale(args.data, clusters)
    print(f"\nvTrain A100 all-reduce, fit on 2+4 GPUs, predict 8: model {scale['model_all']:.2f} %, "
          f"alpha-beta {scale['base_all']:.2f} %")
    figure("comm_mape_pct_scale_vtrain8", scale['model_all'], "%")
    figure("baseline_mape_pct_scale_vtrain8", scale['base_all'], "%")
    cross = cross_cluster(clusters)
    print("\nEach multi-node cluster predicted from its description, network priors learned on the others "
          "(MAPE %, bias % at >= 1 MiB):")
    print(cross.round(2).to_string(index=False))
    figure("comm_mape_pct_cross_cluster", cross['mape_large'].mean(), "%")
    figure("baseline_mape_pct_cross_cluster", cross['base_large'].mean(), "%")
    figure("comm_mape_pct_cross_cluster_small", cross['mape_small'].mean(), "%")
    figure("comm_clusters_better_than_baseline", f"{(cross['mape_large'] < cross['base_large']).sum()}/{len(cross)}",
           "clusters")
    scaling = node_scaling(clusters)
    print("\nAWS p5 (EFA) fitted on 2 nodes, 4-32 nodes predicted (MAPE %, bias %):")
    print(scaling.round(2).to_string(index=False))
    figure("comm_mape_pct_node_scaling", scaling.groupby("collective")["mape"].mean().mean(), "%")
    figure("baseline_mape_pct_node_scaling", scaling.groupby("collective")["base_mape"].mean().mean(), "%")
    for collective, name in (("all_to_all", "alltoall"), ("send_recv", "sendrecv")):
        table = multinode(collective, clusters)
        print(f"\nMulti-node {collective}, each cluster from its description, network priors learned without it "
              "(MAPE %, bias % at >= 1 MiB):")
        print(table.round(2).to_string(index=False))
        figure(f"comm_mape_pct_{name}_multinode", cluster_mean(table), "%")
    alltoall = all_to_all_public(clusters)
    print("\nNCCL all-to-all on Azure NDm A100 v4, predicted by a100-80g-selene (uncalibrated, network priors "
          "learned without Azure), as a ring, and anchored on the cluster's own all-gather (error %):")
    print(alltoall.round(3).to_string(index=False))
    figure("comm_mape_pct_alltoall", alltoall['error_pct'].abs().mean(), "%")
    figure("baseline_mape_pct_alltoall_as_ring", alltoall['ring_error_pct'].abs().mean(), "%")
    figure("comm_mape_pct_alltoall_structure", alltoall['structure_error_pct'].abs().mean(), "%")
    if not args.skip_gloo:
        gloo, alltoall_sizes = gloo_scale()
        print("\ngloo on this machine, fit on 2 ranks, predict 3-4 (MAPE %):")
        print(gloo[["collective", "model_all", "base_all", "channels", "rows"]].round(2).to_string(index=False))
        figure("comm_mape_pct_scale_gloo", gloo['model_all'].mean(), "%")
        figure("comm_mape_pct_alltoall_gloo", gloo.set_index('collective').loc['all_to_all', 'model_all'], "%")
        figure("baseline_mape_pct_scale_gloo", gloo['base_all'].mean(), "%")
        figure("comm_mape_pct_alltoall_gloo_heldout_sizes", alltoall_sizes['model_all'], "%")
        figure("baseline_mape_pct_alltoall_gloo_heldout_sizes", alltoall_sizes['base_all'], "%")
    print(f"\nbenchmark wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
