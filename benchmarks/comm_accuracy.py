"""Accuracy of the collective model against measured collectives, next to the alpha-beta baseline.

  1. Every nccl-tests file in ../shared/data/nccl-tests: fit on every other message size, predict the
     rest; MAPE for messages >= 1 MiB and < 1 MiB, model and baseline.
     Baselines: alpha-beta (latency + busfactor * size / busbw, both fitted) and NCCL's own tuner
     model (its constants, bus bandwidth fitted; comm/nccl_tuner.py).
  2. Scale: vTrain's single-node A100 all-reduce tables, fit on 2 and 4 GPUs, predict 8.
  3. Scale here: gloo sweep on this machine, fit on 2 ranks, predict 3 and 4 (per collective).
The `_all` figures are means over files (each file counts once, whatever its number of sizes).
Priors come from the hardware config matching the file (a100-80g-dgx, h100-sxm-dgx).

    python benchmarks/comm_accuracy.py [--data ../shared/data/nccl-tests] [--skip-gloo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from trainsim.comm.calibration import LARGE_BYTES, channel_choices, local_sweep, read_calibration_file
from trainsim.comm.fit import every_other_size, fit_alpha_beta, fit_collective, mape_pct, predict_table
from trainsim.comm.model import prior_params
from trainsim.comm.nccl_tuner import fit_nccl_tuner
from trainsim.config import compose_run
from trainsim.config.schema import CalibrationFile
from trainsim.errors import ConfigError

HARDWARE_BY_PREFIX = {"a100": "a100-80g-dgx", "h100": "h100-sxm-dgx", "h200": "h100-sxm-dgx"}


def hardware_for(name: str):
    key = HARDWARE_BY_PREFIX.get(name.split("-")[0], "a100-80g-dgx")
    return compose_run([f"hardware={key}"], check="layout").hardware


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
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/nccl-tests")
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
    if not args.skip_gloo:
        gloo = gloo_scale()
        print("\ngloo on this machine, fit on 2 ranks, predict 3-4 (MAPE %):")
        print(gloo[["collective", "model_all", "base_all", "channels", "rows"]].round(2).to_string(index=False))
        print(f"figure comm_mape_pct_scale_gloo {gloo['model_all'].mean():.2f} %")
        print(f"figure baseline_mape_pct_scale_gloo {gloo['base_all'].mean():.2f} %")
    print(f"\nbenchmark wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
