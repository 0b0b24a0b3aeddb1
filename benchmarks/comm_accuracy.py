"""Accuracy of the collective model against measured collectives, next to the alpha-beta baseline.

  1. Every nccl-tests file in data/nccl-tests: fit on every other message size, predict the
     rest; MAPE for messages >= 1 MiB and < 1 MiB, model and baseline.
     Baselines: alpha-beta (latency + busfactor * size / busbw, both fitted) and NCCL's own tuner
     model (its constants, bus bandwidth fitted; comm/nccl_tuner.py).
  2. Scale: vTrain's single-node A100 all-reduce tables, fit on 2 and 4 GPUs, predict 8.
  3. Across nodes from one node: fit the single-node A100 files, predict 2-node all-reduce with the
     inter-node hop at its priors (NCCL's NET latencies, the config's nominal bandwidth): the AWS p4de
     sweep (EFA, a100-80g-p4de) and the three NCCL points of Azure's NDm A100 v4 (HDR InfiniBand, 8x
     200 Gb/s per node; mscclpp summary table), next to the model fitted to the p4de sweep.
  4. Scale here: gloo sweep on this machine, fit on 2 ranks, predict 3 and 4 (per collective).
The `_all` figures are means over files (each file counts once, whatever its number of sizes).
Priors come from the hardware config matching the file (a100-80g-dgx, a100-80g-p4de, h100-sxm-dgx).

    python benchmarks/comm_accuracy.py [--data data/nccl-tests] [--skip-gloo]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

import pandas as pd

from trainsim.comm.calibration import (
    LARGE_BYTES,
    channel_choices,
    collect_measurements,
    local_sweep,
    read_calibration_file,
)
from trainsim.comm.fit import every_other_size, fit_alpha_beta, fit_collective, mape_pct, predict_table
from trainsim.comm.model import prior_params
from trainsim.comm.nccl_tests import bus_bandwidth_factor
from trainsim.comm.nccl_tuner import fit_nccl_tuner
from trainsim.config import compose_run
from trainsim.config.schema import CalibrationFile
from trainsim.errors import ConfigError

HARDWARE_BY_PREFIX = {"a100": "a100-80g-dgx", "h100": "h100-sxm-dgx", "h200": "h100-sxm-dgx"}
P4DE_FILE = "a100-16gpu-2node-aws-p4de-efa400_allreduce.txt"
NDMV4_FILE = "a100-ndmv4-azure-1node-2node_summary_mscclpp.txt"
NDMV4_INTER_NODE_BYTES_PER_S = 200e9
"""NDm A100 v4: 8x 200 Gb/s HDR InfiniBand per VM (the file's header)."""


def hardware_for(name: str, **fields):
    key = "a100-80g-p4de" if "p4de" in name else HARDWARE_BY_PREFIX.get(name.split("-")[0], "a100-80g-dgx")
    return dataclasses.replace(compose_run([f"hardware={key}"], check="layout").hardware, **fields)


def fit_and_score(train: pd.DataFrame, test: pd.DataFrame, hw, collective: str) -> dict:
    fit = fit_collective(train, prior_params(hw, collective), channel_choices(hw))
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
            "channels": fit.params.channels, "rows": len(test)}


def per_file(data: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(data.iterdir()):
        try:
            table = read_calibration_file(CalibrationFile(path=str(path)))
        except ConfigError as exc:
            print(f"skipped {path.name}: {str(exc).splitlines()[0][:120]}")
            continue
        train = every_other_size(table)
        rows.append({"file": path.name, **fit_and_score(table[train], table[~train], hardware_for(path.name),
                                                         table["collective"].iloc[0])})
    return pd.DataFrame(rows)


def vtrain_scale(data: Path) -> dict:
    tables = {n: read_calibration_file(CalibrationFile(path=str(data / f"a100-{n}gpu-nvlink_allreduce_vtrain-lut.csv")))
              for n in (2, 4, 8)}
    train = pd.concat([tables[2], tables[4]], ignore_index=True)
    return fit_and_score(train, tables[8], hardware_for("a100"), "all_reduce")


def mscclpp_nccl_all_reduce(path: Path, section: str = "2 nodes, 8 gpus/node", ranks: int = 16) -> pd.DataFrame:
    """The NCCL AllReduce column of one section of the mscclpp performance summary: latency rows give
    the time, bus-bandwidth rows give it through nccl-tests' bus factor. MEASUREMENT_COLUMNS."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    rows, current, kind, column = [], None, None, None
    for line in path.read_text().splitlines():
        if line.startswith("###"):
            current = line.lstrip("#").strip()
        elif line.startswith("**"):
            kind = "latency" if "Latency" in line else "busbw"
        elif line.startswith("|") and current == section:
            cells = [c.strip().strip("*").strip() for c in line.strip("|").split("|")]
            if "NCCL AllReduce" in cells:
                column = cells.index("NCCL AllReduce")
            elif (size := re.fullmatch(r"(\d+)([KMG])", cells[0])) and column is not None:
                message = int(size[1]) * units[size[2]]
                value = float(cells[column])
                seconds = value * 1e-6 if kind == "latency" else (
                    message * bus_bandwidth_factor("all_reduce", ranks) / (value * 1e9))
                rows.append({"collective": "all_reduce", "algorithm": "", "protocol": "", "num_ranks": ranks,
                             "num_nodes": 2, "message_bytes": message, "time_s": seconds, "source": path.name})
    if not rows:
        raise ValueError(f"{path}: no NCCL AllReduce rows in section {section!r}")
    return pd.DataFrame(rows)


def inter_node_from_one_node(data: Path) -> pd.DataFrame:
    """Fit a100-80g-dgx's all-reduce files (single-node), predict 2-node all-reduce with the inter-node
    hop at its priors; the p4de sweep also with the model fitted to it (every other size), for reference."""
    single = collect_measurements(hardware_for("a100"))  # a100-80g-dgx's files: all single-node
    single = single[single["collective"] == "all_reduce"].reset_index(drop=True)
    p4de = read_calibration_file(CalibrationFile(path=str(data / P4DE_FILE)))
    ndmv4 = mscclpp_nccl_all_reduce(data / NDMV4_FILE)
    rows = []
    for name, table, hw in (("p4de EFA, prior", p4de, hardware_for(P4DE_FILE)),
                            ("NDm A100 v4 InfiniBand, prior", ndmv4,
                             hardware_for("a100", inter_node_bandwidth_bytes_per_s=NDMV4_INTER_NODE_BYTES_PER_S))):
        fit = fit_collective(single, prior_params(hw, "all_reduce"), channel_choices(hw))
        rows.append(_signed_errors(name, predict_table(fit.params, table), table))
    train = every_other_size(p4de)
    fitted = fit_collective(p4de[train], prior_params(hardware_for(P4DE_FILE), "all_reduce"))
    rows.append(_signed_errors("p4de EFA, fitted to p4de", predict_table(fitted.params, p4de[~train]), p4de[~train]))
    rows.append(_signed_errors("NDm A100 v4 with the p4de fit", predict_table(fitted.params, ndmv4), ndmv4))
    return pd.DataFrame(rows)


def _signed_errors(name: str, predicted, table: pd.DataFrame) -> dict:
    measured = table["time_s"].to_numpy()
    large = (table["message_bytes"] >= LARGE_BYTES).to_numpy()
    error = 100 * (predicted / measured - 1)
    return {"case": name, "rows": len(table), "mape_large": mape_pct(predicted[large], measured[large]),
            "mape_small": mape_pct(predicted[~large], measured[~large]),
            "signed_errors_pct": " ".join(f"{e:+.0f}" for e in error) if len(table) <= 4 else ""}


def gloo_scale() -> pd.DataFrame:
    hw = compose_run(["hardware=local-cpu"], check="layout").hardware
    measurements = local_sweep(hw)
    rows = []
    for collective, table in measurements.groupby("collective"):
        train, test = table[table["num_ranks"] == 2], table[table["num_ranks"] > 2].reset_index(drop=True)
        rows.append({"collective": collective, **fit_and_score(train, test, hw, collective)})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / "data/nccl-tests")
    parser.add_argument("--skip-gloo", action="store_true", help="skip the local gloo sweep (about a minute)")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    start = time.perf_counter()
    files = per_file(args.data)
    print("\nHeld-out sizes (fit on every other size), MAPE %:")
    print(files.round(2).to_string(index=False))
    print(f"figure comm_mape_pct_large_all {files['model_large'].mean():.2f} %")
    print(f"figure comm_mape_pct_small_all {files['model_small'].mean():.2f} %")
    print(f"figure baseline_mape_pct_large_all {files['base_large'].mean():.2f} %")
    print(f"figure baseline_mape_pct_small_all {files['base_small'].mean():.2f} %")
    print(f"figure nccl_tuner_mape_pct_large_all {files['tuner_large'].mean():.2f} %")
    beats = (files["model_all"] < files["base_all"]).sum()
    print(f"figure comm_files_better_than_baseline {beats}/{len(files)} files")
    scale = vtrain_scale(args.data)
    print(f"\nvTrain A100 all-reduce, fit on 2+4 GPUs, predict 8: model {scale['model_all']:.2f} %, "
          f"alpha-beta {scale['base_all']:.2f} %")
    print(f"figure comm_mape_pct_scale_vtrain8 {scale['model_all']:.2f} %")
    print(f"figure baseline_mape_pct_scale_vtrain8 {scale['base_all']:.2f} %")
    inter = inter_node_from_one_node(args.data)
    print("\n2-node all-reduce predicted from single-node fits, inter-node hop at its priors (MAPE %):")
    print(inter.round(1).to_string(index=False))
    for key, case in (("p4de", 0), ("ndmv4", 1)):
        print(f"figure comm_internode_prior_mape_pct_large_{key} {inter['mape_large'][case]:.2f} %")
        print(f"figure comm_internode_prior_mape_pct_small_{key} {inter['mape_small'][case]:.2f} %")
    if not args.skip_gloo:
        gloo = gloo_scale()
        print("\ngloo on this machine, fit on 2 ranks, predict 3-4 (MAPE %):")
        print(gloo[["collective", "model_all", "base_all", "channels", "rows"]].round(2).to_string(index=False))
        print(f"figure comm_mape_pct_scale_gloo {gloo['model_all'].mean():.2f} %")
        print(f"figure baseline_mape_pct_scale_gloo {gloo['base_all'].mean():.2f} %")
    print(f"\nbenchmark wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
