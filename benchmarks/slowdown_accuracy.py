"""Overlap-slowdown accuracy: the XGBoost model against the constant-factor baseline (method.md 1.3).

A100: Echo's published GPT-2 DDP dataset (data/overlap-slowdown), imported as the
a100-80g-dgx hardware does, trained with that hardware's `slowdown.model` settings. Figures are on
held-out kernels: the pooled out-of-fold predictions of the 5-fold cross-validation on the 80 % part
(`_a100`), and the final model on the 20 % hold-out (`_holdout_a100`). A kernel is "within 10 %" when
the predicted overlapped duration (1 - r) t0 + r t0 (1 + s) is within 10 % of the measured one; the
summed error is that of the sum over all overlapped kernels. Targets: >= 75 % within 10 %, summed
error within 3 %, better than the baseline on every metric (Echo reports 52 to 74 % within 10 %).
The `_echo_default_a100` figures are Echo's fixed settings (squared error, depth 12, 100 rounds,
learning rate 0.3) for comparison.

local: the local-cpu dataset, read from artifacts/slowdown/local-cpu when the pipeline has built it,
else measured now with the local-cpu settings (about 30 s on 2 cores).

    python benchmarks/slowdown_accuracy.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from trainsim.artifacts import read_table
from trainsim.config import compose_run
from trainsim.config.schema import SlowdownModelConfig
from trainsim.errors import ArtifactError
from trainsim.slowdown.stage import DATASET_FILE, build_dataset
from trainsim.slowdown.train import train_slowdown_model

ROOT = Path(__file__).resolve().parents[1]


def figure(name: str, value: float, unit: str) -> None:
    print(f"figure {name} {value:.2f} {unit}", flush=True)


def report(suffix: str, metrics: dict) -> None:
    for part, tag in (("cv", ""), ("holdout", "_holdout")):
        model, baseline = metrics[part]["model"], metrics[part]["baseline"]
        for share in (5, 10, 15):
            figure(f"slowdown_within{share}_pct{tag}_{suffix}", model[f"within_{share}_pct"], "%")
            figure(f"baseline_within{share}_pct{tag}_{suffix}", baseline[f"within_{share}_pct"], "%")
        figure(f"slowdown_summed_error_pct{tag}_{suffix}", model["summed_error_pct"], "%")
        figure(f"baseline_summed_error_pct{tag}_{suffix}", baseline["summed_error_pct"], "%")
        figure(f"slowdown_rmse_us{tag}_{suffix}", model["duration_rmse_s"] * 1e6, "us")
        figure(f"baseline_rmse_us{tag}_{suffix}", baseline["duration_rmse_s"] * 1e6, "us")
    figure(f"slowdown_kernels_{suffix}", metrics["rows"]["targets"], "kernels")


def local_dataset(hw):
    artifact = ROOT / "artifacts/slowdown/local-cpu"
    try:
        rows = read_table(artifact, DATASET_FILE).to_pandas()
        print(f"# local-cpu dataset from {artifact}", flush=True)
        return rows
    except ArtifactError:
        print("# no local-cpu dataset artifact: measuring now", flush=True)
        return build_dataset(hw, "local-cpu")[0]


def main() -> int:
    a100 = compose_run(["hardware=a100-80g-dgx"]).hardware
    rows, summary = build_dataset(a100, "a100-80g-dgx")
    print(f"# A100: {summary['rows']} kernels, {summary['status']}, invalid {summary['invalid']}", flush=True)
    result = train_slowdown_model(rows, a100.slowdown.model)
    report("a100", result.metrics)
    tuning = result.metrics["tuning"]
    if tuning:
        print(f"# nested CV over {tuning['grid_size']} settings; per fold: {tuning['cv_fold_params']}; "
              f"final model: {tuning['final_params']}", flush=True)
    echo = dataclasses.replace(SlowdownModelConfig(), random_state=a100.slowdown.model.random_state)
    for name, value in train_slowdown_model(rows, echo).metrics["cv"]["model"].items():
        if name in ("within_10_pct", "summed_error_pct"):
            figure(f"slowdown_{name}_echo_default_a100", value, "%")
    print("# top features (gain share): " + ", ".join(
        f"{r.feature} {r.gain_share:.2f}" for r in result.importances.head(5).itertuples()), flush=True)

    local = compose_run(["hardware=local-cpu"]).hardware
    local_result = train_slowdown_model(local_dataset(local), local.slowdown.model)
    report("local", local_result.metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
