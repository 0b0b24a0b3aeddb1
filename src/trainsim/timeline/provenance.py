"""What a prediction was made from: calibration, kernel model, slowdown model, and every fallback.

A step time is only as good as its inputs, and a user acting on it must see when one was weak: no
collective measurements (datasheet rates and NCCL's constants), measurements of a single node used for a
multi-node run, a kernel model left at the schema defaults, ops the measuring backend could not time, no
overlap-slowdown model, or one trained on another device. `prediction_inputs` reads the upstream
artifacts' own reports (fit.json, the profile summary, the slowdown metrics) and states each of these
as a warning; the CLI, summary.json, the report and the Python API all show the same dictionary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainsim.artifacts.store import MANIFEST
from trainsim.comm.model import FIT_FILE
from trainsim.comm.network import network_prior, node_bandwidth
from trainsim.comm.placement import job_placement
from trainsim.config.choices import MEASURED_BACKENDS
from trainsim.config.schema import RANGE_SETTINGS, HardwareConfig, ModelConfig
from trainsim.slowdown.choice import choose_slowdown
from trainsim.slowdown.predictor import METRICS_FILE

# not imported: the profile and slowdown stages pull in torch and xgboost training
PROFILE_SUMMARY_FILE = "summary.json"  # trainsim.profile.stage.SUMMARY_FILE
SLOWDOWN_SUMMARY_FILE = "summary.json"  # trainsim.slowdown.stage.SUMMARY_FILE


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _round(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else round(float(value), 2)


def network_inputs(hw: HardwareConfig) -> tuple[dict, str]:
    """How the network hop of a run wider than the measurements is predicted: from the learned prior of
    hw.network's transport (with its band), or from the datasheet rate alone."""
    prior = network_prior(hw)
    if prior is None:
        return ({"prior": None}, f"the inter-node hop uses the datasheet rate ({node_bandwidth(hw) / 1e9:g} GB/s per "
                "node) and " + (f"hardware.inter_node_latency_s ({hw.inter_node_latency_s * 1e6:g} us)"
                                if hw.inter_node_latency_s else "NCCL's network latencies")
                + "; set hardware.network.transport for a learned transport prior")
    return ({"prior": prior.describe(), "level": prior.level, "key": prior.key,
             "uncertainty_pct": round(prior.error_pct, 1)},
            f"the inter-node hop is predicted from the network description with the {prior.describe()}")


def calibration_inputs(hw: HardwareConfig, calibration_dir: Path | None, nodes_used: int) -> tuple[dict, list[str]]:
    """Which measurements fitted the collective model, its held-out error per collective, and warnings."""
    fit = _read_json(Path(calibration_dir) / FIT_FILE) if calibration_dir else {}
    collectives = fit.get("collectives", {})
    network, how = network_inputs(hw)
    if not collectives:
        reason = ("no calibration artifact" if not calibration_dir else
                  "the calibration holds no measurements (hardware.calibration.files is empty and there is no "
                  "local sweep)")
        warnings = [f"collectives: {reason}; using datasheet link rates and NCCL's constants (uncalibrated)"]
        if nodes_used > 1:
            warnings.append(f"collectives: {how}")
        return ({"calibrated": False, "artifact": str(calibration_dir) if calibration_dir else None,
                 "network": network}, warnings)
    sources = list(fit.get("sources", {}))
    if hw.calibration.local_sweep:
        sources.append(f"local {hw.comm_backend} sweep on this machine")
    errors = {name: {"heldout_mape_pct_large": _round(entry["heldout"].get("model_mape_pct_large")),
                     "heldout_mape_pct_small": _round(entry["heldout"].get("model_mape_pct_small")),
                     "rows": entry["rows"], "ranks_nodes": entry["ranks_nodes"]}
              for name, entry in collectives.items()}
    max_nodes = max(nodes for entry in collectives.values() for _, nodes in entry["ranks_nodes"])
    warnings = []
    if nodes_used > max_nodes:
        warnings.append(f"collectives: calibrated on at most {max_nodes} node(s), this run spans {nodes_used}; {how}")
    skipped = {f: n for f, n in fit.get("skipped_wrong_results", {}).items() if n}
    for source, reasons in fit.get("skipped_lines", {}).items():
        counts = ", ".join(f"{seen['count']} {reason}" for reason, seen in reasons.items())
        warnings.append(f"collectives: {source}: lines left out of the fit ({counts}; listed in fit.json)")
    return ({"calibrated": True, "artifact": str(calibration_dir), "sources": sources,
             "collectives": errors, "other_collectives": "borrow the link parameters of a calibrated one",
             "network": network if nodes_used > max_nodes else {"measured": True},
             "skipped_wrong_results": skipped, "skipped_lines": fit.get("skipped_lines", {})}, warnings)


def run_values(model, par) -> dict[str, float]:
    """The run's values of RANGE_SETTINGS."""
    return {name: getattr(model if group == "model" else par, name) for name, group in RANGE_SETTINGS.items()}


def outside_fitted_range(hw: HardwareConfig, values: dict[str, float]) -> list[str]:
    """'name=value (fitted lo-hi)' for every setting outside the range the kernel model was fitted on."""
    out = []
    for name, (low, high) in hw.kernel_model.fitted_range.items():
        if name in values and not low <= values[name] <= high:
            out.append(f"{RANGE_SETTINGS[name]}.{name}={values[name]:g} (fitted {low:g}-{high:g})")
    return out


def kernel_inputs(hw: HardwareConfig, profile_dir: Path | None, backends: dict[str, int],
                  run: dict[str, float] | None = None) -> tuple[dict, list[str]]:
    """How kernel times were obtained (measured here, or the analytical model, what it was fitted on, and
    whether this run's shapes lie inside that)."""
    summary = _read_json(Path(profile_dir) / PROFILE_SUMMARY_FILE) if profile_dir else {}
    analytical = backends.get("analytical", 0)
    measured = {k: v for k, v in backends.items() if k in MEASURED_BACKENDS}
    out = {"backends": backends, "measured_ops": sum(measured.values()), "analytical_ops": analytical}
    warnings = []
    fallback = summary.get("fallback_count", 0)
    if fallback:
        warnings.append(f"kernels: {fallback} op(s) could not be measured and use the analytical model "
                        f"(listed in {Path(profile_dir) / PROFILE_SUMMARY_FILE})")
    if analytical:
        out["kernel_model"] = hw.kernel_model.fitted_on or "schema defaults (not fitted)"
        if not hw.kernel_model.fitted_on:
            warnings.append(f"kernels: {analytical} op(s) timed by the analytical model with its default "
                            f"efficiencies, not fitted to {hw.name} (fit one with `trainsim profile-fit`)")
        outside = outside_fitted_range(hw, run or {})
        out["inside_fitted_range"] = not outside if hw.kernel_model.fitted_range else None
        if outside:
            warnings.append("kernels: outside what the kernel model was fitted on, extrapolated: " + ", ".join(outside))
    return out, warnings


def slowdown_inputs(hw: HardwareConfig, model_dir: Path | None, device_type: str) -> tuple[dict, list[str]]:
    """Whether compute slowed by overlapping communication was modelled, why (hardware.slowdown.use and the
    model's score on unseen kernel groups against no slowdown, slowdown/choice.py), trained on what, how
    accurate. `modelled` is true only where the compose applied the model."""
    choice = choose_slowdown(hw.slowdown.use, model_dir)
    decision = {"modelled": choice.apply_model, "use": choice.use, "choice": choice.describe()}
    if model_dir is None:
        warnings = [] if choice.use == "none" else [
            "slowdown: no overlap-slowdown model; compute overlapped with communication runs at solo speed"]
        return decision, warnings
    metrics = _read_json(Path(model_dir) / METRICS_FILE)
    dataset_dirs = list(_read_json(Path(model_dir) / MANIFEST).get("inputs", {}))  # the dataset it was trained on
    dataset = _read_json(Path(dataset_dirs[0]) / SLOWDOWN_SUMMARY_FILE) if dataset_dirs else {}
    trained_on = dataset.get("device_types", [])
    scores = choice.scores or {}
    out = {**decision, "artifact": str(model_dir), "source": dataset.get("source", hw.slowdown.source),
           "files": [f["path"] for f in dataset.get("files", [])], "rows": dataset.get("rows"),
           "device_types": trained_on,
           "cv_duration_mape_pct": _round(metrics.get("cv", {}).get("model", {}).get("duration_mape_pct")),
           "unseen_groups_within_10_pct": {who: _round(scores[who]["within_10_pct"]) for who in ("model", "none")
                                           if who in scores}}
    warnings = []
    if choice.apply_model and trained_on and device_type not in trained_on:
        warnings.append(f"slowdown: model trained on {', '.join(trained_on)} kernels, applied to {device_type} "
                        "(an unseen device type)")
    return out, warnings


def model_warnings(model: ModelConfig | None) -> list[str]:
    """What the model config asks that trainsim approximates (model.approximations), one warning each."""
    return [f"model: {text}" for text in (model.approximations if model is not None else [])]


def prediction_inputs(hw: HardwareConfig, inputs: dict[str, Path], backends: dict[str, int], nodes_used: int,
                      device_type: str, run_values: dict[str, float] | None = None,
                      model: ModelConfig | None = None) -> dict:
    """The `inputs` entry of summary.json: calibration, kernels, slowdown, and the warnings of all three and of the
    model's approximations."""
    calibration, w1 = calibration_inputs(hw, inputs.get("calibration"), nodes_used)
    kernels, w2 = kernel_inputs(hw, inputs.get("profile"), backends, run_values)
    slowdown, w3 = slowdown_inputs(hw, inputs.get("slowdown_model"), device_type)
    return {"calibration": calibration, "kernels": kernels, "slowdown": slowdown,
            "warnings": model_warnings(model) + w1 + w2 + w3}


def search_inputs(hw: HardwareConfig, calibration_dir: Path | None, budget_gpus: int,
                  model: ModelConfig | None = None) -> dict:
    """The `inputs` of a layout search: its collective model and kernel model; it never models slowdown."""
    calibration, w1 = calibration_inputs(hw, calibration_dir, job_placement(hw, budget_gpus).domains)
    kernel_model = hw.kernel_model.fitted_on or "schema defaults (not fitted)"
    w2 = [] if hw.kernel_model.fitted_on or hw.device_kind == "cpu" else [
        f"kernels: the analytical model runs with its default efficiencies, not fitted to {hw.name}"]
    return {"calibration": calibration, "kernels": {"kernel_model": kernel_model}, "slowdown": {"modelled": False},
            "warnings": model_warnings(model) + w1 + w2 + [
                "slowdown: not modelled by the search's estimates; the full compose of the chosen layouts "
                "(sweep.yaml) models it"]}
