"""Serve the trained slowdown model to the timeline composer.

    predictor = SlowdownPredictor.load(Path("artifacts/models/a100-80g-dgx"))
    s = predictor.predict(overlap_features(compute, comm, device_numbers(hardware)))
    t = stretched_duration(compute["duration_s"], overlap_fraction, s)

The model directory (written by the slowdown_model stage) holds model.json (the XGBoost booster) and
schema.json (schema_version, feature names, the categories of every categorical feature, the
baseline factors). `predict` refuses a frame that lacks a feature, naming it, and a negative or
non-numeric value, naming feature, row and value; NaN numeric features are allowed (unknown).
Categorical values the model never saw (a new collective or op kind) become missing values and are
counted per feature in `last_unknown_categories`, never raised and never silent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from trainsim.artifacts import read_manifest
from trainsim.errors import ArtifactError
from trainsim.slowdown.features import DEVICE_COLUMNS, NUMERIC, device_numbers, overlap_features
from trainsim.slowdown.train import SCHEMA_VERSION, TrainResult, baseline_predict, categorize, stretched_duration

if TYPE_CHECKING:  # imported where a model is loaded (slowdown/train.py says why)
    import xgboost as xgb

MODEL_FILE = "model.json"
SCHEMA_FILE = "schema.json"
METRICS_FILE = "metrics.json"
IMPORTANCES_FILE = "importances.parquet"
PREDICTIONS_FILE = "predictions.parquet"
NON_NEGATIVE = ("solo_duration_s", "flops", "bytes_moved", "message_bytes", "num_ranks", "channels",
                "arithmetic_intensity", "memory_bandwidth_fraction", "compute_fraction", *DEVICE_COLUMNS)

__all__ = ["ConstantSlowdownPredictor", "SlowdownPredictor", "device_numbers", "overlap_features", "save_model",
           "stretched_duration"]


def save_model(result: TrainResult, directory: Path) -> None:
    """Write the model, its schema, metrics, importances and held-out predictions into `directory`."""
    directory = Path(directory)
    result.booster.save_model(directory / MODEL_FILE)
    (directory / SCHEMA_FILE).write_text(json.dumps(result.schema, indent=2, sort_keys=True) + "\n")
    (directory / METRICS_FILE).write_text(json.dumps(result.metrics, indent=2, sort_keys=True) + "\n")
    result.importances.to_parquet(directory / IMPORTANCES_FILE, index=False)
    result.predictions.to_parquet(directory / PREDICTIONS_FILE, index=False)


def _read_schema(model_dir: Path) -> dict:
    read_manifest(model_dir)  # a half-written or edited model directory is refused here
    schema = json.loads((model_dir / SCHEMA_FILE).read_text())
    if schema.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"{model_dir / SCHEMA_FILE}: schema_version {schema.get('schema_version')!r}, this "
                            f"trainsim reads {SCHEMA_VERSION} (version 2 replaced the Nsight metrics and the "
                            "device-type category by features the composer can supply); re-run the "
                            "slowdown_dataset and slowdown_model stages")
    return schema


def _check_numeric(features: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    out = features.copy()
    for name in names:
        values = pd.to_numeric(out[name], errors="coerce")
        bad = values.isna() & out[name].notna()
        if name in NON_NEGATIVE:
            bad |= values < 0
        if bad.any():
            row = bad.to_numpy().nonzero()[0][0]
            value = out[name].iloc[row]
            value = value.item() if isinstance(value, np.generic) else value
            raise ValueError(f"slowdown features: feature {name!r} has value {value!r} in row {row}; "
                             "expected a non-negative number (NaN = unknown)")
        out[name] = values.astype(float)
    return out


class SlowdownPredictor:
    """The trained XGBoost model with its feature schema."""

    def __init__(self, booster: xgb.Booster, schema: dict, source: str = "in memory"):
        self.booster, self.schema, self.source = booster, schema, source
        self.feature_names: list[str] = list(schema["feature_names"])
        self.categories: dict[str, list[str]] = schema["categories"]
        self.last_unknown_categories: dict[str, int] = {}
        """Per categorical feature: rows of the last predict() whose value the model never saw."""

    @classmethod
    def load(cls, model_dir: Path) -> SlowdownPredictor:
        model_dir = Path(model_dir)
        import xgboost as xgb

        schema = _read_schema(model_dir)
        booster = xgb.Booster()
        booster.load_model(model_dir / MODEL_FILE)
        return cls(booster, schema, source=str(model_dir))

    def check(self, features: pd.DataFrame) -> pd.DataFrame:
        """The model's columns of `features`, validated and typed (raises naming what is wrong)."""
        missing = [name for name in self.feature_names if name not in features]
        if missing:
            raise ValueError(f"slowdown model {self.source}: input lacks feature {missing[0]!r}"
                             f"{f' (and {missing[1:]})' if len(missing) > 1 else ''}; "
                             f"the model needs {self.feature_names}")
        numeric = [name for name in self.feature_names if name in NUMERIC]
        out = _check_numeric(features[self.feature_names].reset_index(drop=True), numeric)
        out, self.last_unknown_categories = categorize(out, self.categories)
        return out

    def predict(self, features: pd.DataFrame) -> np.ndarray:
        """Slowdown s >= 0 per row (clipped: a kernel is not taken to speed up when overlapped)."""
        if features.empty:
            self.last_unknown_categories = {}
            return np.zeros(0)
        import xgboost as xgb

        data = xgb.DMatrix(self.check(features), enable_categorical=True)
        return np.clip(self.booster.predict(data), 0.0, None).astype(float)


class ConstantSlowdownPredictor:
    """The constant-factor baseline (Proteus): one mean slowdown per device type of the training data,
    same predict signature. Rows without a 'device_type' column (the model's features have none) or
    with a device type not in the training data get the mean factor (counted)."""

    def __init__(self, factors: dict[str, float]):
        self.factors = dict(factors)
        self.feature_names = ["device_type"]
        self.last_unknown_categories: dict[str, int] = {}

    @classmethod
    def load(cls, model_dir: Path) -> ConstantSlowdownPredictor:
        return cls(_read_schema(Path(model_dir))["baseline_factors"])

    def predict(self, features: pd.DataFrame) -> np.ndarray:
        """The device type's factor; a device type not in the training data (or none) gets the mean factor (counted)."""
        devices = (features["device_type"].astype(str) if "device_type" in features
                   else pd.Series("", index=features.index, dtype=str))
        self.last_unknown_categories = {"device_type": int((~devices.isin(self.factors)).sum())}
        return baseline_predict(self.factors, devices)
