"""metrics.json (flat numbers for `dvc metrics show`) and CSV tables for `dvc plots`.

DVC shows nested JSON as dotted keys, so the nesting here is shallow and every leaf is a number.
A configuration without ground truth has no end_to_end.error_pct at all: an absent metric reads as
"not measured", while a zero would read as a perfect prediction.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return value
    return None


def _clean(block: dict[str, Any]) -> dict[str, Any]:
    return {k: n for k, v in block.items() if (n := _number(v)) is not None}


def metrics(data: dict[str, Any]) -> dict[str, Any]:
    """Flat numeric metrics of one configuration point."""
    e2e = data["end_to_end"]
    out: dict[str, Any] = {"end_to_end": _clean({k: e2e.get(k) for k in (
        "predicted_s", "measured", "measured_s", "spread_s", "normalised", "error_pct")})}
    for level, (low, high) in e2e.get("interval_s", {}).items():
        out["end_to_end"][f"predicted_low_{level}_s"], out["end_to_end"][f"predicted_high_{level}_s"] = low, high
    breakdown = data["breakdown"]
    out["breakdown"] = _clean({col: float(breakdown[col].max()) for col in breakdown.columns if col.endswith("_s")})
    if "comm_summary" in data:
        out["comm"] = {row["collective"]: _clean({k: v for k, v in row.items() if k != "collective"})
                       for row in data["comm_summary"].to_dict("records")}
    if "slowdown" in data:
        out["slowdown"] = {f"{split}_{who}": _clean(values)
                           for split, block in data["slowdown"]["metrics"].items() for who, values in block.items()}
    out["cost"] = _clean(data["cost"])
    if "efficiency" in data:
        out["efficiency"] = _clean(data["efficiency"])
    return out


def write_plots(data: dict[str, Any], directory: Path) -> None:
    """CSV tables behind the main figures, in the columns PLOTS names."""
    (directory / "plots").mkdir(parents=True, exist_ok=True)
    if "comm_by_size" in data:
        data["comm_by_size"].to_csv(directory / "plots/comm_error.csv", index=False)
    else:
        (directory / "plots/comm_error.csv").write_text("collective,message_bytes,model_error_pct,baseline_error_pct\n")
    breakdown = data["breakdown"]
    rows = ["part,rank_class,seconds"] + [f"{col.removesuffix('_s')},{r},{v}" for col in breakdown.columns
                                          if col.endswith("_s") and col != "end_s"
                                          for r, v in zip(breakdown["rank_class"], breakdown[col], strict=True)]
    (directory / "plots/breakdown.csv").write_text("\n".join(rows) + "\n")
    if "slowdown" in data:
        data["slowdown"]["importances"].to_csv(directory / "plots/importances.csv", index=False)
    else:
        (directory / "plots/importances.csv").write_text("feature,gain_share,splits\n")
