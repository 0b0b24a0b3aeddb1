"""Learn the network priors (network_priors.yaml) from measured multi-node clusters.

Each cluster is a multi-node all-reduce log plus the hardware config that describes the cluster
(hardware.network: transport, link generation, NICs). Its model is the collective model with the
intra-node side from the GPU's single-node measurements (or priors) and the network hop at nominal;
two numbers per group of clusters are then fitted to the group's multi-node rows (every cluster counts
alike, relative errors): the bandwidth efficiency of the network hop and its latency (per network hop a
collective's critical path crosses: NCCL's composition, comm/model.py).
Groups are the link generation, the transport, the NCCL network plugin and all clusters
(network.network_prior takes the most specific one a cluster belongs to).

Each level's uncertainty is measured, not assumed: every cluster of the group is predicted with priors
learned from the other clusters only (leave-one-cluster-out, falling back to coarser levels as a new
cluster would), and the mean absolute error at messages >= 1 MiB is the band (for a group of one cluster
at least the mean over all clusters: one cluster cannot show a level is better than the rest).

    python -m trainsim.comm.network_fit           # learn, print, and compare with network_priors.yaml
    python -m trainsim.comm.network_fit --write   # rewrite network_priors.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.optimize import least_squares

from trainsim.comm.calibration import LARGE_BYTES, channel_choices, collect_measurements, read_calibration_file
from trainsim.comm.fit import fit_collective, mape_pct, predict_table
from trainsim.comm.model import CollectiveParams, fabric, prior_params, with_network_hop
from trainsim.comm.network import PLUGIN, PRIORS_FILE, network_prior
from trainsim.config import compose_run
from trainsim.config.data_path import resolve_data_path
from trainsim.config.schema import CalibrationFile, HardwareConfig

LEVELS = ("link_generation", "transport", "plugin", "all")
# set: the network fit's starting point
START = (0.9, 20e-6)
"""(efficiency, hop latency) the fit starts from; a weak pull keeps a level with few rows near it."""
# set: the network fit's pull towards its start
PRIOR_WEIGHT = 0.03


@dataclass(frozen=True)
class ClusterSource:
    """A measured multi-node cluster: its log and the hardware config (with overrides) describing it."""

    name: str
    hardware: str
    log: CalibrationFile
    overrides: tuple[str, ...] = ()
    note: str = ""


# cite: the nccl-tests logs in data/nccl-tests and their sources (data/SOURCES.md)
CLUSTERS = (
    ClusterSource("aws-p4de-efa", "a100-80g-p4de",
                  CalibrationFile(path="data/nccl-tests/a100-16gpu-2node-aws-p4de-efa400_allreduce.txt")),
    ClusterSource("aws-p5-efa", "h100-80g-p5",
                  CalibrationFile(path="data/nccl-tests/h100-16gpu-2node-aws-p5-efa3200_allreduce.txt")),
    ClusterSource("aws-p5-hyperpod-efa", "h100-80g-p5",
                  CalibrationFile(path="data/nccl-tests/h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_all_reduce.txt"),
                  note="the same instance type as aws-p5-efa on SageMaker HyperPod with NCCL 2.27.7, 2-32 nodes, "
                       ">= 32 MiB"),
    ClusterSource("oci-a100-roce", "a100-40g-oci",
                  CalibrationFile(path="data/nccl-tests/a100-16gpu-2node-oci-bmgpu4.8-roce_allreduce.txt")),
    ClusterSource("coreweave-h100-ib-ndr", "h100-sxm-dgx",
                  CalibrationFile(path="data/nccl-tests/h100-64gpu-8node-coreweave-ndr-ib-sharp_allreduce.txt",
                                  num_ranks=96, num_nodes=12), ("hardware.num_nodes=12",),
                  note="96 ranks on 12 nodes: the busbw/algbw ratio of every row (data/SOURCES.md), not the 64 the "
                       "header says"),
    ClusterSource("azure-ndmv4-ib-hdr", "a100-80g-selene",
                  CalibrationFile(path="data/nccl-tests/a100-ndmv4-azure-1node-2node_summary_mscclpp.txt",
                                  num_ranks=16, num_nodes=2),
                  note="3 NCCL all-reduce points (1 KiB, 1 GiB, 4 GiB) of the mscclpp summary's 2 x 8 section; "
                       "Selene's network (8x 200 Gb/s HDR per node) is NDm A100 v4's"),
)


@dataclass
class Cluster:
    source: ClusterSource
    hardware: HardwareConfig
    table: pd.DataFrame
    """Its multi-node all-reduce rows (MEASUREMENT_COLUMNS)."""
    base: CollectiveParams
    """The model with the network hop at nominal bandwidth and no latency of its own."""

    @property
    def name(self) -> str:
        return self.source.name

    def keys(self) -> dict[str, str]:
        """The group it belongs to at each level."""
        net = self.hardware.network
        return {"link_generation": f"{net.transport}/{net.link_generation}" if net.link_generation else "",
                "transport": net.transport, "plugin": PLUGIN[net.transport], "all": "all"}

    def predict(self, efficiency: float, hop_latency_s: float) -> np.ndarray:
        return predict_table(with_network_hop(self.base, self.hardware, efficiency, hop_latency_s), self.table)

    def data_files(self) -> set[Path]:
        """Every file learning from this cluster reads: its log and its hardware's calibration files (whose
        single-node rows fit its intra-node side)."""
        entries = [self.source.log, *self.hardware.calibration.files]
        return {resolve_data_path(e.path, "network_fit.CLUSTERS") for e in entries}


def base_params(hw: HardwareConfig) -> CollectiveParams:
    """All-reduce with the intra-node side fitted to hw's single-node measurements (priors without any),
    the network hop at nominal and the configured fabric."""
    unknown = dataclasses.replace(hw, network=dataclasses.replace(hw.network, transport=""))
    prior = prior_params(unknown, "all_reduce")
    params = prior
    if hw.calibration.files or hw.calibration.local_sweep:
        measured = collect_measurements(hw)
        single = measured[(measured["collective"] == "all_reduce") & (measured["num_nodes"] == 1)]
        if len(single):
            params = fit_collective(single.reset_index(drop=True), prior, channel_choices(hw)).params
    return with_network_hop(dataclasses.replace(params, fabric=fabric(hw)), hw, 1.0, 0.0)


def load_clusters(sources=CLUSTERS) -> list[Cluster]:
    clusters = []
    for source in sources:
        hw = compose_run([f"hardware={source.hardware}", *source.overrides], check="layout").hardware
        table = read_calibration_file(source.log, "network_fit.CLUSTERS")
        table = table[(table["collective"] == "all_reduce") & (table["num_nodes"] > 1)].reset_index(drop=True)
        clusters.append(Cluster(source, hw, table, base_params(hw)))
    return clusters


def fit_group(clusters: list[Cluster]) -> tuple[float, float]:
    """(efficiency, hop latency) minimising relative error over the clusters' rows, each cluster weighted alike."""
    start = np.log(START)

    def residuals(x: np.ndarray) -> np.ndarray:
        efficiency, latency = np.exp(x)
        parts = []
        for c in clusters:
            measured = c.table["time_s"].to_numpy()
            parts.append((c.predict(efficiency, latency) - measured) / measured / np.sqrt(len(measured)))
        return np.concatenate([*parts, PRIOR_WEIGHT * (x - start)])

    result = least_squares(residuals, start, bounds=(np.log([0.05, 1e-7]), np.log([1.0, 1e-2])))
    return tuple(float(v) for v in np.exp(result.x))


def fit_levels(clusters: list[Cluster]) -> dict[str, dict[str, dict]]:
    """{level: {key: {bandwidth_efficiency, hop_latency_s, clusters}}} over the groups the clusters form."""
    table: dict[str, dict[str, dict]] = {level: {} for level in LEVELS}
    for level in LEVELS:
        groups: dict[str, list[Cluster]] = {}
        for c in clusters:
            if key := c.keys()[level]:
                groups.setdefault(key, []).append(c)
        for key, members in sorted(groups.items()):
            efficiency, latency = fit_group(members)
            table[level][key] = {"bandwidth_efficiency": round(efficiency, 4), "hop_latency_s": float(f"{latency:.4g}"),
                                 "clusters": [c.name for c in members], "error_pct": float("nan")}
    return table


def priors_without(clusters: list[Cluster], paths) -> dict:
    """Network priors (network_priors.yaml's levels, without error bands) learned only from the clusters
    whose data include none of `paths`: what a held-out fit of those files may start from. A file of a
    measured cluster drops that cluster, a single-node file every cluster whose intra-node side it fits."""
    held = {Path(p).name for p in paths}  # by name: the same file wherever a benchmark reads it from
    return fit_levels([c for c in clusters if not {f.name for f in c.data_files()} & held])


def held_out(clusters: list[Cluster]) -> pd.DataFrame:
    """Each cluster predicted from priors learned on the others (its level, efficiency, hop latency, errors)."""
    rows = []
    for c in clusters:
        table = fit_levels([o for o in clusters if o is not c])
        prior = network_prior(c.hardware, table)
        predicted, measured = c.predict(prior.bandwidth_efficiency, prior.hop_latency_s), c.table["time_s"].to_numpy()
        large = (c.table["message_bytes"] >= LARGE_BYTES).to_numpy()
        rows.append({"cluster": c.name, "level": f"{prior.level} {prior.key}", "efficiency": prior.bandwidth_efficiency,
                     "hop_latency_us": prior.hop_latency_s * 1e6,
                     "mape_large": mape_pct(predicted[large], measured[large]),
                     "mape_small": mape_pct(predicted[~large], measured[~large]),
                     "bias_large": float(np.mean(predicted[large] / measured[large] - 1) * 100), "rows": len(measured)})
    return pd.DataFrame(rows)


def learn(clusters: list[Cluster], held: pd.DataFrame | None = None) -> dict:
    """The network_priors.yaml content: every level's fit over all clusters, with its measured band
    (`held`: held_out(clusters), when already computed)."""
    table = fit_levels(clusters)
    errors = (held if held is not None else held_out(clusters)).set_index("cluster")["mape_large"]
    overall = float(errors.mean())
    for entries in table.values():
        for entry in entries.values():
            group = float(errors[entry["clusters"]].mean())
            # one cluster is too few to narrow the band below what all clusters show
            entry["error_pct"] = round(group if len(entry["clusters"]) > 1 else max(group, overall), 1)
    return table


HEADER = """\
# fit: `python -m trainsim.comm.network_fit --write` (network priors; do not edit by hand; the test suite
# checks this file against a fresh fit). bandwidth_efficiency: achieved fraction of the nominal NIC bandwidth on
# the network hop; hop_latency_s: latency (s) of one network hop on a collective's critical path (per inter-node
# ring step, tree stage, send/recv, once for an all-to-all); error_pct: mean absolute error at
# messages >= 1 MiB of the level's clusters predicted leave-one-cluster-out (the band a prediction reports).
# Clusters (comm/network_fit.py CLUSTERS; logs in data/nccl-tests, sources in data/SOURCES.md):
"""


def render(table: dict, sources=CLUSTERS) -> str:
    lines = [f"#   {s.name}: {s.log.path} described by conf/hardware/{s.hardware}.yaml"
             + (f" {' '.join(s.overrides)}" if s.overrides else "") + (f" ({s.note})" if s.note else "")
             for s in sources]
    return HEADER + "\n".join(lines) + "\n" + yaml.safe_dump(table, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {PRIORS_FILE.name}")
    args = parser.parse_args(argv)
    clusters = load_clusters()
    held = held_out(clusters)
    print(held.round(2).to_string(index=False))
    text = render(learn(clusters, held))
    if args.write:
        PRIORS_FILE.write_text(text)
        print(f"wrote {PRIORS_FILE}")
        return 0
    same = PRIORS_FILE.is_file() and yaml.safe_load(PRIORS_FILE.read_text()) == yaml.safe_load(text)
    print(f"{PRIORS_FILE.name} is {'current' if same else 'OUT OF DATE (run with --write)'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
