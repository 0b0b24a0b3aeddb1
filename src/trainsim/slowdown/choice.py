"""Whether a compose applies the overlap-slowdown model or no slowdown, and why (hardware.slowdown.use).

A model that predicts unseen kernels worse than assuming no slowdown at all makes every prediction worse,
so by default (`auto`) the model is applied only when it beats "no slowdown" on kernel groups it never saw:
the slowdown_model stage scores both on the same grouped cross-validation (train.held_out_group_scores,
stored in the model's metrics.json), and this module reads that score. `model` applies it regardless,
`none` never. The compose stage, its provenance and every accuracy benchmark resolve the slowdown here, so
what is scored is what `trainsim compose` runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainsim.config.choices import SLOWDOWN_USES
from trainsim.errors import ConfigError
from trainsim.slowdown.predictor import METRICS_FILE
from trainsim.slowdown.train import HELD_OUT_GROUPS


@dataclass(frozen=True)
class SlowdownChoice:
    """What the composer applies to compute overlapped with communication, and why."""

    apply_model: bool
    """True: the XGBoost model's slowdown; False: none (compute overlapped runs at solo speed)."""
    use: str
    """The hardware.slowdown.use setting it was chosen under."""
    reason: str
    """Why, in words, with the held-out figures when the model has them."""
    scores: dict | None = None
    """The model artifact's held-out kernel-group scores (metrics.json `held_out_groups`), if any."""

    @property
    def label(self) -> str:
        return "XGBoost model" if self.apply_model else "none"

    def describe(self) -> str:
        """One line for people: 'overlap slowdown: none (auto: XGBoost 52 % ..., none 71 %)'."""
        return f"overlap slowdown: {self.label} ({self.reason})"


def held_out_scores(model_dir: Path) -> dict | None:
    """The model's and no slowdown's scores on unseen kernel groups from its metrics.json (None when the
    model was trained before they were recorded)."""
    path = Path(model_dir) / METRICS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(HELD_OUT_GROUPS)


def score_text(scores: dict) -> str:
    model, none = scores["model"]["within_10_pct"], scores["none"]["within_10_pct"]
    return f"XGBoost {model:.0f} % within 10 % on unseen kernel groups, none {none:.0f} %"


def choose_slowdown(use: str, model_dir: Path | None) -> SlowdownChoice:
    """The slowdown a compose applies under `use` (hardware.slowdown.use) with the model artifact at
    `model_dir` (None: no artifact, e.g. `trainsim compose --quick`)."""
    if use not in SLOWDOWN_USES:
        raise ConfigError(f"hardware.slowdown.use={use!r}; accepted: {', '.join(SLOWDOWN_USES)}")
    if use == "none":
        return SlowdownChoice(False, use, "hardware.slowdown.use=none")
    if model_dir is None:
        return SlowdownChoice(False, use, "no overlap-slowdown model artifact")
    scores = held_out_scores(model_dir)
    if use == "auto" and not scores:
        return SlowdownChoice(False, use, f"auto: {Path(model_dir) / METRICS_FILE} has no held-out kernel-group "
                                          "score (trained by an older trainsim); re-run the slowdown_model stage")
    return decide(use, scores)


def decide(use: str, scores: dict | None) -> SlowdownChoice:
    """The choice for a trained model with these held-out kernel-group scores: `auto` applies it only where
    it has strictly more kernels within 10 % than no slowdown; `model` always."""
    if use == "model":
        figures = f"; {score_text(scores)}" if scores else ""
        return SlowdownChoice(True, use, f"hardware.slowdown.use=model{figures}", scores)
    if use != "auto" or not scores:
        raise ValueError(f"decide: use={use!r} with scores {scores!r}; expected 'auto' with scores, or 'model'")
    wins = scores["model"]["within_10_pct"] > scores["none"]["within_10_pct"]
    return SlowdownChoice(wins, use, f"auto: {score_text(scores)}", scores)
