"""The component errors an interval is built from, measured on predictions no fit saw.

* compute: benchmarks/scale_accuracy.py's out-of-sample step times of the published and recipe tables
  (benchmarks/results/generalisation_predictions.csv): each fold kind is the level of extrapolation a user's run
  sits at (LEVEL_OF_FOLD);
* collectives and all-to-alls: benchmarks/comm_accuracy.py's held-out figures (a mean |error|, turned into a
  spread as for a zero-mean normal error);
* kernels measured on this machine: benchmarks/e2e_accuracy.py's local step-time errors.

`benchmarks/uncertainty.py --write` writes them to component_errors.yaml; a test checks that file against a fresh
measurement from the recorded results.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainsim.uncertainty.interval import MAPE_TO_SPREAD

LEVEL_OF_FOLD = {"row": "fitted", "family": "fitted", "table": "unseen_framework", "gpu": "unseen_gpu"}
"""held-out fold kind of generalisation_predictions.csv -> the compute level whose error it measures: a row
whose neighbours fitted its GPU (leave-one-row-out; a model family the fit never saw, of a framework it did),
a table of a framework no other table of its GPU has (leave-one-table-out, fitted on the GPU's other tables;
a table whose framework another table of the GPU shares, e.g. another release of the same recipes, measures
'fitted'), a GPU none of whose rows were fitted (leave-one-GPU-out). Rows of a table predicted at a GPU's
data-free start are not a level a user's run is predicted at (unseen GPUs carry the other GPUs' fitted
ratios) and are left out; rows predicted with the fit their config carries from the same silicon's fitted GPU
(params_from 'carried from ...') measure 'unseen_gpu', the level of a config with no fitted_frameworks."""
COMM_FIGURES = {("collectives", "calibrated"): "comm_mape_pct_large_all",
                ("collectives", "uncalibrated"): "baseline_mape_pct_cross_cluster",
                ("alltoall", "calibrated"): "comm_mape_pct_alltoall",
                ("alltoall", "uncalibrated"): "baseline_mape_pct_alltoall_as_ring"}
"""(component, level) -> the comm_accuracy figure measuring it: the calibrated model on held-out message sizes
of every measured cluster; datasheet rates against the same logs; all-to-alls alone."""
MEASURED_FIGURE_PREFIX = "e2e_error_pct_local_"
"""e2e_accuracy's step-time errors of runs on this machine against the kernels measured here."""


def log_errors(predictions: pd.DataFrame) -> np.ndarray:
    """log(measured / predicted) per row."""
    return np.log(predictions["measured_s"].to_numpy(dtype=float) / predictions["predicted_s"].to_numpy(dtype=float))


def scored_folds(predictions: pd.DataFrame) -> pd.DataFrame:
    """The rows of generalisation_predictions.csv that measure a level, with their level and log error."""
    kept = predictions[predictions["held_out"].isin(list(LEVEL_OF_FOLD)) & (predictions["params_from"] != "start")]
    kept = kept[np.isfinite(kept["predicted_s"].to_numpy(dtype=float))]
    level = kept["held_out"].map(LEVEL_OF_FOLD)
    tables = predictions[["table", "gpu", "framework"]].drop_duplicates()
    seen = [((tables["gpu"] == gpu) & (tables["table"] != table) & (tables["framework"] == framework)).any()
            for table, gpu, framework in zip(kept["table"], kept["gpu"], kept["framework"])]
    level = level.where(~((kept["held_out"] == "table").to_numpy() & np.array(seen, dtype=bool)), "fitted")
    level = level.where(~kept["params_from"].str.startswith("carried from"), "unseen_gpu")
    return kept.assign(level=level, log_error=log_errors(kept))


def bias_spread(log_error: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation (n - 1) of log errors."""
    return float(np.mean(log_error)), float(np.std(log_error, ddof=1)) if len(log_error) > 1 else 0.0


def compute_errors(predictions: pd.DataFrame) -> dict[str, dict]:
    """Per compute level: bias, spread and count of its held-out step-time errors."""
    folds = scored_folds(predictions)
    out = {}
    for level, rows in folds.groupby("level"):
        bias, spread = bias_spread(rows["log_error"].to_numpy())
        kinds = ", ".join(sorted(rows["held_out"].unique()))
        out[level] = {"bias": round(bias, 4), "spread": round(spread, 4), "count": len(rows),
                      "source": f"benchmarks/scale_accuracy.py, held out by {kinds} "
                                f"({rows['table'].nunique()} tables, {rows['gpu'].nunique()} GPUs)"}
    return out


def ranking_error(predictions: pd.DataFrame) -> dict | None:
    """How far two runs of one table (same GPU and framework) move apart: the spread of the difference of their
    leave-one-row-out log errors over every pair, per run (over sqrt 2). What decides whether a faster estimate
    is really faster: the error they share (the GPU's efficiency) cancels."""
    rows = scored_folds(predictions)
    rows = rows[rows["held_out"] == "row"]
    differences = [a - b for _, table in rows.groupby("table") for i, a in enumerate(table["log_error"])
                   for b in table["log_error"].iloc[i + 1:]]
    if len(differences) < 2:
        return None
    spread = float(np.sqrt(np.mean(np.square(differences)) / 2))
    return {"bias": 0.0, "spread": round(spread, 4), "count": len(differences),
            "source": f"benchmarks/scale_accuracy.py, {len(differences)} pairs of rows of one table, leave-one-row-out"}


def figure_errors(figures: dict[str, float], keys: dict[tuple[str, str], str], script: str) -> dict[tuple, dict]:
    """(component, level) -> a spread from a mean |error| figure (no bias: the figures give none)."""
    out = {}
    for key, name in keys.items():
        if name in figures:
            out[key] = {"bias": 0.0, "spread": round(figures[name] / 100 * MAPE_TO_SPREAD, 4), "count": 0,
                        "source": f"{script} figure {name} ({figures[name]:.2f} % mean |error|)"}
    return out


def measured_errors(figures: dict[str, float]) -> dict[str, dict] | None:
    """The 'measured' compute level from the local step-time errors (|error| per layout), or None without any."""
    values = [v for name, v in figures.items() if name.startswith(MEASURED_FIGURE_PREFIX)]
    if not values:
        return None
    mape = float(np.mean(values))
    return {"bias": 0.0, "spread": round(mape / 100 * MAPE_TO_SPREAD, 4), "count": len(values),
            "source": f"benchmarks/e2e_accuracy.py, {len(values)} local layouts ({mape:.2f} % mean |error|)"}


def component_table(predictions: pd.DataFrame, comm_figures: dict[str, float], e2e_figures: dict[str, float]
                    ) -> dict:
    """component_errors.yaml's content from the recorded results."""
    compute = compute_errors(predictions)
    measured = measured_errors(e2e_figures)
    if measured is not None:
        compute["measured"] = measured
    components: dict[str, dict] = {"compute": compute}
    ranking = ranking_error(predictions)
    if ranking is not None:
        components["ranking"] = {"same_table": ranking}
    for (component, level), entry in figure_errors(comm_figures, COMM_FIGURES, "benchmarks/comm_accuracy.py").items():
        components.setdefault(component, {})[level] = entry
    return {"components": components}

