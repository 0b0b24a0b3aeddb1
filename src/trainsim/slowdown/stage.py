"""Stages 4 and 5: build the hardware's slowdown dataset, then train and evaluate its model.

slowdown_dataset (artifacts/slowdown/{hardware}/): dataset.parquet (SLOWDOWN_SCHEMA) and summary.json
(source, imported files with their SHA-256, rows per status, invalid rows per reason and their ids,
skipped profile ops, wall time). `hardware.slowdown.source` picks measuring here or importing CSVs.

slowdown_model (artifacts/models/{hardware}/): model.json, schema.json, metrics.json (cross-validation
and hold-out figures of the model and of the constant-factor baseline), importances.parquet and
predictions.parquet (every target kernel's measured and predicted slowdown and duration).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from trainsim.artifacts import atomic_artifact, read_table
from trainsim.artifacts.store import file_sha256
from trainsim.config.data_path import resolve_data_path
from trainsim.config.devices import device_type_of
from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError
from trainsim.profile.database import ProfileDatabase
from trainsim.profile.stage import local_device_kind
from trainsim.slowdown.a100_import import import_echo_csv
from trainsim.slowdown.dataset import INVALID_REASONS, status_counts, to_table
from trainsim.slowdown.features import device_numbers
from trainsim.slowdown.predictor import save_model
from trainsim.slowdown.train import TrainResult, train_slowdown_model

DATASET_FILE = "dataset.parquet"
SUMMARY_FILE = "summary.json"
PROFILE_DATABASE = "artifacts/profiles/{hardware}/kernels.parquet"  # the profile stage's database (registry)


def _imported(hw: HardwareConfig, hardware_key: str) -> tuple[pd.DataFrame, dict]:
    if not hw.slowdown.import_files:
        raise ConfigError(f"hardware '{hw.name}': slowdown.source='import' needs slowdown.import_files; list the "
                          "measured CSV files there (hardware.slowdown.import_files=[data/...csv]), or set "
                          "hardware.slowdown.source=measure on a machine with that device")
    frames, summary = [], {"files": [], "invalid": dict.fromkeys(INVALID_REASONS, 0), "invalid_ids": [],
                           "slowdown_mismatch": 0}
    for index, name in enumerate(hw.slowdown.import_files):
        path = resolve_data_path(name, f"hardware.slowdown.import_files[{index}]")
        result = import_echo_csv(path, hardware_key)
        frames.append(result.rows)
        summary["files"].append({"path": name, "sha256": file_sha256(path), "rows": len(result.rows),
                                 "comm_from_header": result.header})
        for reason, count in result.skipped.items():
            summary["invalid"][reason] += count
        summary["invalid_ids"] += result.skipped_ids
        summary["slowdown_mismatch"] += result.slowdown_mismatch
    return pd.concat(frames, ignore_index=True), summary


def _profile_rows(hw: HardwareConfig, hardware_key: str) -> pd.DataFrame | None:
    """Up to `profile_signatures` measured signatures of the hardware's profile database, evenly spread
    over the signatures in sorted order (deterministic for a given database)."""
    wanted = hw.slowdown.profile_signatures
    path = Path(PROFILE_DATABASE.format(hardware=hardware_key))
    if wanted <= 0 or not path.is_dir():
        return None
    rows = ProfileDatabase(path).read()
    rows = rows[(rows["hardware"] == hardware_key) & rows["backend"].isin(["cpu", "cuda"])]
    rows = rows.sort_values("signature").reset_index(drop=True)
    if len(rows) > wanted:
        rows = rows.iloc[np.linspace(0, len(rows) - 1, wanted).round().astype(int)]
    return rows


def _measured(hw: HardwareConfig, hardware_key: str, device_type: str) -> tuple[pd.DataFrame, dict]:
    from trainsim.slowdown.collect import collect_local  # torch.distributed only when measuring

    local = local_device_kind()
    if hw.device_kind != local:
        raise ConfigError(f"hardware '{hw.name}': slowdown.source='measure' needs a {hw.device_kind} device, but this "
                          f"machine has {local} only; set slowdown.source=import with slowdown.import_files")
    profile = _profile_rows(hw, hardware_key)
    rows, invalid, skipped = collect_local(hw.slowdown, hardware_key, device_type, hw.threads_per_device, profile)
    rows = rows.assign(**device_numbers(hw).columns())  # measured here: this hardware's datasheet numbers
    return rows, {"invalid": invalid, "profile_signatures": 0 if profile is None else len(profile),
                  "skipped_profile_ops": skipped}


def build_dataset(hw: HardwareConfig, hardware_key: str) -> tuple[pd.DataFrame, dict]:
    """The hardware's slowdown instances and a summary of where they came from and what was set aside."""
    start = time.perf_counter()
    device_type = device_type_of(hw.device_kind, hw.device_name, hw.slowdown.device_type)
    if hw.slowdown.source == "import":
        rows, summary = _imported(hw, hardware_key)
    elif hw.slowdown.source == "measure":
        rows, summary = _measured(hw, hardware_key, device_type)
    else:
        raise ConfigError(f"hardware.slowdown.source={hw.slowdown.source!r}; accepted: 'measure', 'import'")
    summary = {"source": hw.slowdown.source, "hardware_device_type": device_type,
               "device_types": sorted(rows["device_type"].unique().tolist()), "rows": len(rows),
               "status": status_counts(rows), **summary, "wall_time_s": round(time.perf_counter() - start, 2)}
    return rows, summary


def write_dataset_artifact(hw: HardwareConfig, keys: dict[str, str], output: Path) -> dict:
    config = {"hardware": dataclasses.asdict(hw)}
    with atomic_artifact(output, stage="slowdown_dataset", config=config, config_keys=keys) as tmp:
        rows, summary = build_dataset(hw, keys["hardware"])
        pq.write_table(to_table(rows), tmp / DATASET_FILE)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def write_model_artifact(hw: HardwareConfig, keys: dict[str, str], dataset_dir: Path, output: Path) -> TrainResult:
    rows = read_table(dataset_dir, DATASET_FILE).to_pandas()
    config = {"hardware": dataclasses.asdict(hw)}
    with atomic_artifact(output, stage="slowdown_model", config=config, config_keys=keys,
                         inputs=[dataset_dir]) as tmp:
        result = train_slowdown_model(rows, hw.slowdown.model)
        save_model(result, tmp)
    return result
