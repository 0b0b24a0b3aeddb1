"""Gather what the report shows from the verified upstream artifacts, as plain Python data.

Everything the page and metrics.json say comes from here, so the two cannot disagree, and a test can
compare them with the inputs. Each artifact is read through `read_manifest` first, so a corrupt or
half-written input stops the report instead of being shown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trainsim.artifacts import read_manifest
from trainsim.comm.fit import AlphaBeta, predict_table
from trainsim.comm.model import CollectiveParams
from trainsim.report.efficiency import efficiency, efficiency_intervals
from trainsim.uncertainty import step_interval
from trainsim.validation.ground_truth import NOT_MEASURED, error_pct, read_ground_truth


def end_to_end(predicted_s: float, truth: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured, normalised to measured; 'measured' False when there is no ground truth."""
    error = error_pct(predicted_s, truth)
    if error is None:
        return {"predicted_s": predicted_s, "measured": False, "reason": truth.get("reason", NOT_MEASURED)}
    measured = truth["step_time_median_s"]
    return {"predicted_s": predicted_s, "measured": True, "measured_s": measured,
            "spread_s": truth.get("step_time_spread_s"), "normalised": predicted_s / measured, "error_pct": error}


def comm_errors(calibration_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per collective: held-out error of the fitted model and the alpha-beta baseline (from fit.json),
    and per message size: median relative error of both over every measured row (training and held-out)."""
    fit = json.loads((calibration_dir / "fit.json").read_text())
    measurements = pd.read_parquet(calibration_dir / "measurements.parquet")
    summary, by_size = [], []
    for name, entry in sorted(fit["collectives"].items()):
        held = entry.get("heldout", {})
        summary.append({"collective": name, "rows": entry.get("rows"), "heldout_rows": held.get("heldout_rows"),
                        "model_mape_pct_large": held.get("model_mape_pct_large"),
                        "baseline_mape_pct_large": held.get("baseline_mape_pct_large"),
                        "model_mape_pct_small": held.get("model_mape_pct_small"),
                        "baseline_mape_pct_small": held.get("baseline_mape_pct_small")})
        part = measurements[measurements["collective"] == name].reset_index(drop=True)
        if part.empty:
            continue
        measured = part["time_s"].to_numpy(float)
        model = predict_table(CollectiveParams.from_dict(entry["params"]), part)
        base = AlphaBeta(**entry["baseline"]).predict(part)
        frame = pd.DataFrame({"message_bytes": part["message_bytes"],
                              "model_error_pct": 100 * np.abs(model - measured) / measured,
                              "baseline_error_pct": 100 * np.abs(base - measured) / measured})
        grouped = frame.groupby("message_bytes", as_index=False).median()
        grouped.insert(0, "collective", name)
        by_size.append(grouped)
    sizes = pd.concat(by_size, ignore_index=True) if by_size else pd.DataFrame(
        columns=["collective", "message_bytes", "model_error_pct", "baseline_error_pct"])
    return pd.DataFrame(summary), sizes


def _nan_to_none(value: Any) -> Any:
    return None if isinstance(value, float) and not np.isfinite(value) else value


def slowdown_summary(model_dir: Path) -> dict[str, Any]:
    """Hold-out and cross-validated metrics of the slowdown model and its constant-factor baseline."""
    metrics = json.loads((model_dir / "metrics.json").read_text())
    importances = pd.read_parquet(model_dir / "importances.parquet").sort_values("gain_share", ascending=False)
    return {"metrics": {split: metrics[split] for split in ("holdout", "cv") if split in metrics},
            "baseline_factors": metrics.get("baseline_factors", {}), "rows": metrics.get("rows", {}),
            "importances": importances.reset_index(drop=True)}


def breakdown(compose_summary: dict[str, Any]) -> pd.DataFrame:
    """One row per rank class: compute, slowdown, exposed communication per group, bubble, idle."""
    rows = []
    for cls in compose_summary["classes"]:
        row = {"rank_class": cls["rank_class"], "ranks": cls["ranks"], "pp_rank": cls["pp_rank"],
               "compute_s": cls["compute_s"], "slowdown_added_s": cls["slowdown_added_s"]}
        row.update({f"exposed_{group}_s": value for group, value in cls["exposed_comm_s"].items()})
        row.update({"exposed_host_copy_s": cls.get("exposed_host_copy_s", 0.0),
                    "pipeline_bubble_s": cls["pipeline_bubble_s"], "idle_s": cls["idle_s"],
                    "optimizer_step_s": cls.get("optimizer_step_s", 0.0),
                    "contention_added_s": cls.get("contention_added_s", 0.0), "end_s": cls["end_s"]})
        rows.append(row)
    return pd.DataFrame(rows)


def provenance(inputs: dict[str, Path]) -> list[dict[str, Any]]:
    """Config hash, content, code version and file manifest of every input artifact."""
    out = []
    for name, directory in inputs.items():
        manifest = read_manifest(directory)
        out.append({"stage": name, "path": str(directory), "config_hash": manifest.get("config_hash", ""),
                    "code_version": manifest.get("code_version", ""), "created_at": manifest.get("created_at", ""),
                    "wall_time_s": manifest.get("wall_time_s"), "files": manifest.get("files", {})})
    return out


def collect(inputs: dict[str, Path], keys: dict[str, str], truth_dir: Path,
            train_tokens: float = 0.0, framework: str = "pytorch") -> dict[str, Any]:
    """Everything the page and the metrics need, read from the artifacts named in `inputs`; `framework`: the
    software stack the step was composed for (the width of its interval depends on whether it was fitted)."""
    prov = provenance(inputs)
    compose_dir = inputs["compose"]
    summary = json.loads((compose_dir / "summary.json").read_text())
    compose_manifest = read_manifest(compose_dir)
    trace_manifest = read_manifest(inputs["trace"]) if "trace" in inputs else {}
    profile = json.loads((inputs["profile"] / "summary.json").read_text()) if "profile" in inputs else {}
    data: dict[str, Any] = {
        "keys": dict(keys), "summary": summary, "config": compose_manifest.get("config", {}),
        "tool_versions": compose_manifest.get("tool_versions", {}),
        "code_version": compose_manifest.get("code_version", ""), "profile": profile,
        "end_to_end": end_to_end(float(summary["step_time_s"]), read_ground_truth(truth_dir)),
        "ground_truth_dir": str(truth_dir),
        "breakdown": breakdown(summary), "timeline": pd.read_parquet(compose_dir / "timeline.parquet"),
        "chrome_trace": compose_dir / "trace.json",
        "cost": {"world_size": summary["world_size"], "trace_s": trace_manifest.get("wall_time_s"),
                 "compose_s": summary.get("simulate_s"), "compose_stage_s": compose_manifest.get("wall_time_s")},
        "provenance": prov,
    }
    config = data["config"]
    fitted = config.get("hardware", {}).get("kernel_model", {}).get("fitted_frameworks", [])
    interval = step_interval(summary, fitted, framework)
    data["end_to_end"]["interval_s"] = interval.as_dict()["intervals_s"]
    data["end_to_end"]["uncertainty"] = interval.parts
    if {"hardware", "model", "parallelism"} <= set(config):
        groups = config["hardware"], config["model"], config["parallelism"]
        data["efficiency"] = efficiency(float(summary["step_time_s"]), *groups, train_tokens=train_tokens)
        data["efficiency_intervals"] = efficiency_intervals(interval.at(), *groups, train_tokens=train_tokens)
    if "calibration" in inputs:
        data["comm_summary"], data["comm_by_size"] = comm_errors(inputs["calibration"])
    if "slowdown_model" in inputs:
        data["slowdown"] = slowdown_summary(inputs["slowdown_model"])
    return data
