"""Stage 3 (NCCL calibration): gather collective measurements, fit the model, keep its held-out error.

Sources, all turned into one table of MEASUREMENT_COLUMNS:
  * the local sweep (hardware.calibration.local_sweep): gloo over loopback here, NCCL on GPUs;
  * files measured elsewhere (hardware.calibration.files): nccl-tests logs, author-compiled busbw tables
    (busbw_tables.py), or Parquet written by `torchrun ... -m trainsim.comm.sweep` on a cluster.
Only out-of-place timings are used (nccl-tests prints both; in-place repeats the measurement).

Artifact (artifacts/calibration/{hardware}/):
  measurements.parquet  every measurement the fit saw
  fit.json              per collective: parameters (model.py), channels, training error, and the error
                        on held-out sizes (fit on every other size from data-free priors, predict the
                        rest; >= 1 MiB and below) next to the alpha-beta baseline fitted the same way; the source files
                        with their SHA-256; with the local sweep on a CPU, the system noise model
                        (noise.py) and its measurements; per source file, the measurements nccl-tests
                        flagged wrong (skipped_wrong_results), the data-like lines the parser left
                        out, by reason with their line numbers (skipped_lines), and the rows of curves
                        run with a forced NCCL algorithm, not fitted (forced_algorithm_rows)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.artifacts.store import atomic_artifact, file_sha256
from trainsim.comm.busbw_tables import is_busbw_table, read_busbw_table
from trainsim.comm.fit import CHANNEL_CHOICES, every_other_size, fit_alpha_beta, fit_collective, mape_pct, predict_table
from trainsim.comm.model import FIT_FILE, prior_params
from trainsim.comm.nccl_tests import NcclTestsFormatError, normalize_collective, parse_nccl_tests_runs
from trainsim.comm.noise import fit_noise, measure_local
from trainsim.config.data_path import resolve_data_path
from trainsim.config.schema import CalibrationFile, HardwareConfig
from trainsim.errors import ConfigError
from trainsim.progress import progress, status

MEASUREMENT_COLUMNS = ["collective", "algorithm", "protocol", "num_ranks", "num_nodes", "message_bytes", "time_s",
                       "source"]
MEASUREMENTS_FILE = "measurements.parquet"
# set: where the accuracy figures' 'large' messages start
LARGE_BYTES = 1 << 20
"""Messages from 1 MiB up are 'large' in the accuracy figures (bandwidth-bound on GPUs)."""


def read_calibration_file(entry: CalibrationFile, field: str = "hardware.calibration.files[].path") -> pd.DataFrame:
    """One file's out-of-place measurements as MEASUREMENT_COLUMNS; names the file and field when it cannot.

    Every run of a multi-run nccl-tests log counts, each with its own rank and node count.
    `attrs["skipped_wrong"]` counts the rows left out because nccl-tests found wrong results in them;
    `attrs["skipped_lines"]` the data-like lines the parser left out: {reason: {"count", "lines"}}.
    """
    skipped_wrong, skipped_lines = 0, {}
    path = resolve_data_path(entry.path, field)
    if path.suffix == ".parquet":
        table = pd.read_parquet(path)
        missing = {"collective", "message_bytes", "time_s", "nranks", "nodes"} - set(table.columns)
        if missing:
            raise ConfigError(f"{path}: not a trainsim.comm.sweep table, missing columns {sorted(missing)}; give "
                              "the Parquet `torchrun ... -m trainsim.comm.sweep --output FILE` writes, or an "
                              "nccl-tests log")
        table = table.rename(columns={"nranks": "num_ranks", "nodes": "num_nodes"})
        if entry.num_ranks:
            table["num_ranks"] = entry.num_ranks
        if entry.num_nodes:
            table["num_nodes"] = entry.num_nodes
    elif is_busbw_table(path):
        table = _read_busbw_table(path, entry, skipped_lines)
    else:
        try:
            runs = parse_nccl_tests_runs(path, collective=entry.collective or None, nranks=entry.num_ranks or None)
        except NcclTestsFormatError as exc:
            raise ConfigError(str(exc)) from None
        tables = []
        for run in runs:
            nodes = entry.num_nodes or run.nodes
            where = path if len(runs) == 1 else f"{path} (run {run.run}, lines {run.lines[0]}-{run.lines[1]})"
            for field, value in (("num_ranks", run.nranks), ("num_nodes", nodes)):
                if not value:
                    raise ConfigError(f"{where}: cannot tell {field} from the file; set it in its hardware."
                                      f"calibration.files entry ({{path: {entry.path}, {field}: ...}})")
            tables.append(run.table.assign(num_ranks=run.nranks, num_nodes=nodes))
            skipped_wrong += run.skipped_wrong
            for line in run.skipped:
                seen = skipped_lines.setdefault(line.reason, {"count": 0, "lines": []})
                seen["count"] += 1
                seen["lines"].append(line.line)
        table = pd.concat(tables, ignore_index=True)
    table = table[table.get("placement", "out_of_place") == "out_of_place"]
    uneven = table[(table["num_ranks"] % table["num_nodes"]) != 0]
    if len(uneven):
        raise ConfigError(f"{path}: num_ranks={uneven['num_ranks'].iloc[0]} is not a multiple of "
                          f"num_nodes={uneven['num_nodes'].iloc[0]}; set the right num_ranks / num_nodes in its "
                          f"hardware.calibration.files entry ({{path: {entry.path}, num_ranks: ..., num_nodes: ...}})")
    algorithm = table["algorithm"] if "algorithm" in table else "auto"
    table = table.assign(collective=table["collective"].map(normalize_collective), algorithm=algorithm,
                         protocol="auto", source=str(entry.path))[MEASUREMENT_COLUMNS].reset_index(drop=True)
    table.attrs["skipped_wrong"] = skipped_wrong
    table.attrs["skipped_lines"] = skipped_lines
    return table


def _read_busbw_table(path: Path, entry: CalibrationFile, skipped_lines: dict) -> pd.DataFrame:
    """An author-compiled table's curves (comm/busbw_tables.py), each with the rank and node counts it states and
    the algorithm it forces ('auto' where NCCL chose); the entry's collective, num_ranks and num_nodes, where
    set, select curves. Sections the reader leaves out are added to `skipped_lines`."""
    try:
        runs = read_busbw_table(path, skipped_lines)
    except NcclTestsFormatError as exc:
        raise ConfigError(str(exc)) from None
    wanted = {"collective": normalize_collective(entry.collective) if entry.collective else None,
              "nranks": entry.num_ranks or None, "nodes": entry.num_nodes or None}
    chosen = [r for r in runs if all(v is None or getattr(r.result, k) == v for k, v in wanted.items())]
    if not chosen:
        stated = sorted({(r.result.collective, r.result.nranks, r.result.nodes) for r in runs})
        raise ConfigError(f"{path}: no curve with {', '.join(f'{k}={v}' for k, v in wanted.items() if v)}; its "
                          f"(collective, ranks, nodes) are {stated}")
    return pd.concat([r.result.table.assign(num_ranks=r.result.nranks, num_nodes=r.result.nodes,
                                            algorithm=r.algorithm or "auto") for r in chosen], ignore_index=True)


def local_sweep(hw: HardwareConfig) -> pd.DataFrame:
    """Measure the configured collectives on this machine for every configured process count."""
    from trainsim.comm.sweep import default_sizes, run_local_sweep  # torch.distributed only when sweeping

    cal = hw.calibration
    sizes = default_sizes(cal.sweep_min_bytes, cal.sweep_max_bytes)
    tables = []
    for ranks in cal.sweep_ranks:
        table = run_local_sweep(ranks, cal.sweep_collectives, sizes, iters=cal.sweep_iters, warmup=2,
                                repeats=cal.sweep_repeats)
        tables.append(table.rename(columns={"nranks": "num_ranks", "nodes": "num_nodes"}).assign(
            algorithm=hw.comm_backend, protocol=hw.comm_backend, source=f"local sweep ({hw.comm_backend})"))
    return pd.concat(tables, ignore_index=True)[MEASUREMENT_COLUMNS]


def collect_measurements(hw: HardwareConfig, sweep=local_sweep) -> pd.DataFrame:
    """All measurements of the hardware: its files, then the local sweep if enabled.

    `attrs["skipped_wrong"]`: per file, the rows nccl-tests flagged with wrong results (left out);
    `attrs["skipped_lines"]`: per file with any, the data-like lines the parser left out, by reason;
    `attrs["forced_algorithm_rows"]`: per file with any, the rows of curves run with a forced NCCL algorithm
    (author tables comparing algorithms), left out of the fit, which is of what NCCL picks itself.
    """
    tables = [read_calibration_file(entry, f"hardware.calibration.files[{i}].path")
              for i, entry in enumerate(hw.calibration.files)]
    skipped = {entry.path: t.attrs["skipped_wrong"] for entry, t in zip(hw.calibration.files, tables, strict=True)}
    skipped_lines = {entry.path: t.attrs["skipped_lines"]
                     for entry, t in zip(hw.calibration.files, tables, strict=True) if t.attrs["skipped_lines"]}
    forced = {entry.path: int((t["algorithm"] != "auto").sum())
              for entry, t in zip(hw.calibration.files, tables, strict=True) if (t["algorithm"] != "auto").any()}
    tables = [t[t["algorithm"] == "auto"] for t in tables]
    if hw.calibration.local_sweep:
        tables.append(sweep(hw))
    if not tables:
        return pd.DataFrame(columns=MEASUREMENT_COLUMNS)
    table = pd.concat(tables, ignore_index=True)
    bad = table[~(table["time_s"] > 0)]
    if len(bad):
        row = bad.iloc[0]
        raise ConfigError(f"{row['source']}: {len(bad)} measurement(s) with time_s <= 0 or NaN "
                          f"(first: {row['collective']} {row['message_bytes']} B); times must be positive")
    table = table.astype({"num_ranks": "int64", "num_nodes": "int64", "message_bytes": "int64"})
    table.attrs["skipped_wrong"] = skipped
    table.attrs["skipped_lines"] = skipped_lines
    table.attrs["forced_algorithm_rows"] = forced
    return table


def channel_choices(hw: HardwareConfig) -> tuple[int, ...]:
    """The configured channel count (NCCL_MAX_NCHANNELS) or, unknown, the choices the fit picks from."""
    return (hw.nccl.max_channels,) if hw.nccl.max_channels else CHANNEL_CHOICES


# set: no learned prior (the datasheet rates), so a held-out fit has seen none of its file
HELD_OUT_PRIORS = {"network_priors": {}, "nvlink_efficiency": 1.0}
"""What the held-out fit starts from instead of the learned priors (network_priors.yaml, NVLINK_EFFICIENCY),
which have seen the measured files, held-out sizes included: the network hop and NVLink at their datasheet
rates, no network hop latency of its own (issue 52)."""


def heldout_errors(table: pd.DataFrame, hw: HardwareConfig, collective: str) -> dict:
    """Fit on every other size from data-free priors (HELD_OUT_PRIORS), predict the rest: model and
    alpha-beta MAPE for large and small messages."""
    train = every_other_size(table)
    fit = fit_collective(table[train], prior_params(hw, collective, **HELD_OUT_PRIORS), channel_choices(hw))
    baseline = fit_alpha_beta(table[train], collective)
    test = table[~train]
    measured = test["time_s"].to_numpy()
    large = (test["message_bytes"] >= LARGE_BYTES).to_numpy()
    model, alpha_beta = predict_table(fit.params, test), baseline.predict(test)
    out = {"heldout_rows": int(len(test))}
    for name, mask in (("large", large), ("small", ~large)):
        out[f"model_mape_pct_{name}"] = mape_pct(model[mask], measured[mask])
        out[f"baseline_mape_pct_{name}"] = mape_pct(alpha_beta[mask], measured[mask])
    return out


def calibrate(measurements: pd.DataFrame, hw: HardwareConfig) -> dict:
    """Per measured collective: the fit on all its measurements and its held-out errors."""
    result = {}
    groups = measurements.groupby("collective", sort=True)
    for collective, table in progress(groups, groups.ngroups, f"fitting {groups.ngroups} collective model(s)"):
        table = table.reset_index(drop=True)
        fit = fit_collective(table, prior_params(hw, collective), channel_choices(hw))
        baseline = fit_alpha_beta(table, collective)
        result[collective] = {
            "params": fit.params.as_dict(),
            "train_mape_pct": fit.train_mape_pct,
            "baseline": dataclasses.asdict(baseline),
            "heldout": heldout_errors(table, hw, collective),
            "ranks_nodes": sorted(set(zip(table["num_ranks"].tolist(), table["num_nodes"].tolist(), strict=True))),
            "rows": int(len(table)),
        }
    return result


def _finite(obj):
    """JSON-safe copy: NaN (no held-out rows in a class) becomes null."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def measures_system_noise(hw: HardwareConfig) -> bool:
    """Noise is measured between CPU ranks of this machine, so only for a CPU hardware swept here."""
    return hw.calibration.local_sweep and hw.calibration.system_noise and hw.device_kind == "cpu"


def system_noise_entry(table: pd.DataFrame) -> dict:
    return {"model": fit_noise(table).as_dict(), "measurements": table.to_dict("records")}


def write_calibration_artifact(hw: HardwareConfig, keys: dict[str, str], output: Path, sweep=local_sweep,
                               noise=measure_local) -> dict:
    """Collect, fit and publish the calibration of one hardware; returns fit.json's content."""
    config = {"hardware": dataclasses.asdict(hw)}
    with atomic_artifact(output, stage="calibration", config=config, config_keys=keys) as tmp:
        measurements = collect_measurements(hw, sweep)
        measurements.to_parquet(tmp / MEASUREMENTS_FILE, index=False)
        sources = {str(e.path): file_sha256(resolve_data_path(e.path, f"hardware.calibration.files[{i}].path"))
                   for i, e in enumerate(hw.calibration.files)}
        fit = {"hardware": hw.name, "nccl_version": hw.nccl.version, "sources": sources,
               "skipped_wrong_results": measurements.attrs.get("skipped_wrong", {}),
               "skipped_lines": measurements.attrs.get("skipped_lines", {}),
               "forced_algorithm_rows": measurements.attrs.get("forced_algorithm_rows", {}),
               "collectives": calibrate(measurements, hw) if len(measurements) else {}}
        if measures_system_noise(hw):
            with status("measuring system noise (2 ranks)"):
                fit["system_noise"] = system_noise_entry(noise())
        (tmp / FIT_FILE).write_text(json.dumps(_finite(fit), indent=2) + "\n")
    return fit
