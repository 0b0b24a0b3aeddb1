"""The report's figures, drawn with matplotlib's Agg backend and embedded as base64 PNG.

PNG data URIs keep the page self-contained (one file to mail or archive, no external assets), and
the Agg backend needs no display, so the stage runs on a headless CI machine.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "comm": "#c44e52",
           "baseline": "#8c8c8c", "model": "#4c72b0", "measured": "#55a868"}


def png_data_uri(fig) -> str:
    """Encode and close a figure (closing keeps memory flat when many are drawn)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def end_to_end_figure(e2e: dict[str, Any]) -> str:
    """Predicted step time normalised to measured (1.0 = exact); without ground truth, says so."""
    fig, ax = plt.subplots(figsize=(5, 2.6))
    if e2e["measured"]:
        ax.bar(["measured", "predicted"], [1.0, e2e["normalised"]],
               color=[COLOURS["measured"], COLOURS["model"]])
        if e2e.get("spread_s"):
            ax.errorbar([0], [1.0], yerr=[e2e["spread_s"] / e2e["measured_s"]], color="black", capsize=4)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylabel("step time / measured")
    else:
        ax.bar(["predicted"], [e2e["predicted_s"] * 1e3], color=COLOURS["model"])
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", fontsize=14,
                color="#a00")
        ax.set_ylabel("step time (ms)")
    return png_data_uri(fig)


def breakdown_figure(table: pd.DataFrame) -> str:
    """Stacked bars per rank class: where the step time goes (the parts that add up to it; optimizer_step_s
    and contention_added_s are parts of those parts, not stacked)."""
    parts = [c for c in table.columns if c.endswith("_s") and c not in ("end_s", "optimizer_step_s",
                                                                         "contention_added_s")]
    fig, ax = plt.subplots(figsize=(6, 0.6 + 0.5 * len(table)))
    left = pd.Series(0.0, index=table.index)
    for part in parts:
        values = table[part] * 1e3
        ax.barh(table["rank_class"].astype(str), values, left=left, label=part.removesuffix("_s"))
        left = left + values
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("rank class")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4)
    return png_data_uri(fig)


def timeline_figure(timeline: pd.DataFrame) -> str:
    """Gantt chart of the replayed nodes: one lane per (rank class, stream), coloured by phase."""
    lanes = sorted({(int(r.rank_class), str(r.stream)) for r in timeline.itertuples()})
    index = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.45 * len(lanes)))
    for row in timeline.itertuples():
        colour = COLOURS["comm"] if row.stream != "compute" else COLOURS.get(str(row.phase), "#937860")
        ax.barh(index[(int(row.rank_class), str(row.stream))], (row.end_s - row.start_s) * 1e3,
                left=row.start_s * 1e3, color=colour, edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), [f"class {c} {s}" for c, s in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time in step (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in ("forward", "backward", "optimizer", "comm")]
    ax.legend(handles, ["forward", "backward", "optimizer", "communication"], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.25 - 0.05 * len(lanes)), ncol=4)
    return png_data_uri(fig)


def comm_figure(by_size: pd.DataFrame) -> str:
    """Relative error against message size per collective, fitted model (solid) vs alpha-beta (dashed)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (name, part) in enumerate(by_size.groupby("collective")):
        colour = f"C{i}"
        ax.plot(part["message_bytes"], part["model_error_pct"], color=colour, marker="o", ms=3, label=name)
        ax.plot(part["message_bytes"], part["baseline_error_pct"], color=colour, ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("median |error| (%)")
    ax.set_title("model (solid) vs alpha-beta baseline (dashed)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return png_data_uri(fig)


def slowdown_accuracy_figure(metrics: dict[str, dict[str, float]]) -> str:
    """Share of kernels predicted within 5/10/15% by the model and the constant-factor baseline."""
    fig, ax = plt.subplots(figsize=(5, 2.8))
    levels = ["within_5_pct", "within_10_pct", "within_15_pct"]
    for offset, who in ((-0.2, "model"), (0.2, "baseline")):
        ax.bar([i + offset for i in range(3)], [metrics[who][k] for k in levels], width=0.4,
               color=COLOURS[who], label=who)
    ax.set_xticks(range(3), ["within 5%", "within 10%", "within 15%"])
    ax.set_ylabel("kernels (%)")
    ax.legend(fontsize=8)
    return png_data_uri(fig)


def importance_figure(importances: pd.DataFrame, top: int = 12) -> str:
    """Gain share of the slowdown model's most important features."""
    head = importances.head(top).iloc[::-1]
    fig, ax = plt.subplots(figsize=(5, 0.5 + 0.25 * len(head)))
    ax.barh(head["feature"], head["gain_share"], color=COLOURS["model"])
    ax.set_xlabel("gain share")
    return png_data_uri(fig)


def cost_figure(cost: dict[str, Any]) -> str:
    """Trace and compose wall time at this configuration's GPU count."""
    fig, ax = plt.subplots(figsize=(4, 2.4))
    names, values = ["trace", "compose"], [cost.get("trace_s") or 0.0, cost.get("compose_s") or 0.0]
    ax.bar(names, values, color=[COLOURS["forward"], COLOURS["backward"]])
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"{cost['world_size']} GPU(s)", fontsize=9)
    return png_data_uri(fig)
