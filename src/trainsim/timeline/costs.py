"""What the composer asks of the other models: communication cost and overlap slowdown.

The core only sees these small protocols, so it never imports the NCCL model or the XGBoost
predictor; the compose stage wires the real ones (`trainsim.comm.model.CommModel`,
`trainsim.slowdown.predictor.SlowdownPredictor`) and tests use hand-computable ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd

from trainsim.slowdown.predictor import overlap_features


@runtime_checkable
class CommCost(Protocol):
    """Seconds of one collective or P2P transfer once every member has arrived (no waiting included)."""

    def collective_seconds(self, collective: str, message_bytes: int, num_ranks: int, num_nodes: int) -> float:
        """`message_bytes` in nccl-tests semantics (the trace's message_bytes column)."""

    def p2p_seconds(self, message_bytes: int, same_node: bool) -> float:
        """One send/recv pair."""

    def sync_wait_s(self, segment_s: float, num_ranks: int) -> float:
        """Expected wait for the last of `num_ranks` identical ranks at a blocking collective after
        `segment_s` of compute each (system noise, trainsim/comm/noise.py); 0 when not measured."""


@runtime_checkable
class SlowdownEstimate(Protocol):
    """Overlap slowdown s >= 0 of compute op i while comm op i runs (Echo sec. 3: t = t0 * (1 + s))."""

    def slowdown(self, compute: pd.DataFrame, comm: pd.DataFrame) -> np.ndarray:
        """compute: columns op, flops, bytes_moved, duration_s; comm: collective, message_bytes, num_ranks."""


@dataclass(frozen=True)
class NoSlowdown:
    """Overlap costs nothing (what most simulators assume)."""

    name: str = "none"

    def slowdown(self, compute: pd.DataFrame, comm: pd.DataFrame) -> np.ndarray:
        return np.zeros(len(compute))


@dataclass(frozen=True)
class ConstantSlowdown:
    """Every overlapped compute op is `s` slower (Echo's constant-factor baseline)."""

    s: float
    name: str = "constant"

    def slowdown(self, compute: pd.DataFrame, comm: pd.DataFrame) -> np.ndarray:
        return np.full(len(compute), float(self.s))


@dataclass
class PredictorSlowdown:
    """Adapter for the learned model: features by `overlap_features`, s by `SlowdownPredictor.predict`."""

    predictor: object
    device: object
    """trainsim.slowdown.features.DeviceNumbers of the hardware (device_numbers(hw))."""
    name: str = "xgboost"

    def slowdown(self, compute: pd.DataFrame, comm: pd.DataFrame) -> np.ndarray:
        features = overlap_features(compute.reset_index(drop=True), comm.reset_index(drop=True), self.device)
        return np.clip(np.asarray(self.predictor.predict(features), dtype=float), 0.0, None)


@dataclass(frozen=True)
class TableComm:
    """Hand-set costs for tests and what-if studies: seconds per collective name, per P2P transfer."""

    collective_s: Mapping[str, float]
    p2p_s: float = 0.0
    name: str = "table"
    wait_per_compute_s: float = 0.0
    """Sync wait per second of compute before a collective of two or more identical ranks."""

    def collective_seconds(self, collective: str, message_bytes: int, num_ranks: int, num_nodes: int) -> float:
        return float(self.collective_s.get(collective, 0.0)) if num_ranks > 1 else 0.0

    def p2p_seconds(self, message_bytes: int, same_node: bool) -> float:
        return float(self.p2p_s)

    def sync_wait_s(self, segment_s: float, num_ranks: int) -> float:
        return self.wait_per_compute_s * segment_s if num_ranks > 1 else 0.0


def model_name(model: object) -> str:
    """What the summary calls a model: its `name`, else its class plus its `source` when it has one."""
    if getattr(model, "name", None):
        return str(model.name)
    source = getattr(model, "source", None)
    return f"{type(model).__name__} ({source})" if source else type(model).__name__


def finite_seconds(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} returned {value!r} seconds; expected a finite value >= 0")
    return float(value)
