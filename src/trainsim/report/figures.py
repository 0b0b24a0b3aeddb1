"""The report's figures, drawn with matplotlib's Agg backend and embedded as base64 PNG.

PNG data URIs keep the page self-contained (one file to mail or archive, no external assets), and
the Agg backend needs no display, so the stage runs on a headless CI machine.
"""

from __future__ import annotations

import base64
import html
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
    low, high = e2e.get("interval_s", {}).get("80", (e2e["predicted_s"], e2e["predicted_s"]))
    if e2e["measured"]:
        ax.bar(["measured", "predicted"], [1.0, e2e["normalised"]],
               color=[COLOURS["measured"], COLOURS["model"]])
        if e2e.get("spread_s"):
            ax.errorbar([0], [1.0], yerr=[e2e["spread_s"] / e2e["measured_s"]], color="black", capsize=4)
        scale = e2e["measured_s"]
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylabel("step time / measured")
    else:
        ax.bar(["predicted"], [e2e["predicted_s"] * 1e3], color=COLOURS["model"])
        scale = 1e-3
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", fontsize=14,
                color="#a00")
        ax.set_ylabel("step time (ms)")
    centre = e2e["predicted_s"] / scale  # the predicted bar's 80 % interval as an error bar
    ax.errorbar([len(ax.patches) - 1], [centre], yerr=[[centre - low / scale], [high / scale - centre]],
                color="black", capsize=4, label="80 % interval")
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


COMM_COLOURS = {"tp": "#c44e52", "cp": "#8172b3", "pp": "#937860", "dp": "#da8bc3", "ep": "#ccb974",
                "etp": "#e5ae38", "edp": "#b07aa1", "emp": "#ff9da7", "mp": "#64b5cd", "world": "#4d4d4d",
                "dp_shard": "#a64d79", "dp_replicate": "#f0b6d5"}
IDLE_COLOUR = "#e3e3e3"
MAX_TIMELINE_CLASSES = 16


def comm_group(stream: str) -> str:
    """'comm.pp.send' -> 'pp': the process group a communication stream belongs to."""
    return stream.split(".")[1] if stream.startswith("comm.") else stream


def shown_classes(classes: list[int], limit: int = MAX_TIMELINE_CLASSES) -> list[int]:
    """At most `limit` rank classes, evenly spread from the first to the last (a 32-class step stays readable)."""
    if len(classes) <= limit:
        return classes
    return sorted({classes[round(i * (len(classes) - 1) / (limit - 1))] for i in range(limit)})


def timeline_figure(timeline: pd.DataFrame, stages: dict[int, int] | None = None) -> str:
    """A picture of one step, as the Perfetto / Nsight views show it: per rank class (labelled with its
    pipeline stage) one lane of compute coloured by phase, with the time it waits (bubbles, idle) in grey,
    and one lane per process group it communicates in, coloured by group. Where a communication bar sits
    under a compute bar it overlaps; where it sits under grey, the class waits for it."""
    stages = stages or {}
    step_end = float(timeline["end_s"].max())
    frame = timeline.assign(group=timeline["stream"].astype(str).map(comm_group),
                            rank_class=timeline["rank_class"].astype(int))
    every = sorted(frame["rank_class"].unique(), key=lambda c: (stages.get(c, 0), c))
    classes = shown_classes(every)
    lanes: list[tuple[int, str]] = []
    for c in classes:
        groups = set(frame.loc[frame["rank_class"] == c, "group"]) - {"compute"}
        lanes += [(c, "compute"), *((c, g) for g in COMM_COLOURS if g in groups)]
    index = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.26 * len(lanes)))
    used: dict[str, str] = {}
    for (c, group), part in frame[frame["rank_class"].isin(classes)].groupby(["rank_class", "group"]):
        y = index[(c, group)]
        if group == "compute":
            _idle_spans(ax, part, y, step_end)
            used["idle / bubble"] = IDLE_COLOUR
            for phase, rows in part.groupby("phase"):
                colour = COLOURS.get(str(phase), "#937860")
                _spans(ax, rows, y, colour)
                used[str(phase)] = colour
        else:
            colour = COMM_COLOURS.get(group, COLOURS["comm"])
            _spans(ax, part, y, colour)
            used[f"{group} communication"] = colour
    ax.set_yticks(range(len(lanes)), [f"stage {stages[c]} · class {c}" if g == "compute" and c in stages
                                      else f"class {c}" if g == "compute" else g for c, g in lanes], fontsize=7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, step_end * 1e3)
    ax.set_xlabel("time in step (ms)")
    title = f"{len(classes)} of {len(every)} rank classes, evenly spread" if len(classes) < len(every) else None
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in used.values()]
    ax.legend(handles, list(used), fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              title=title, title_fontsize=8)
    return png_data_uri(fig)


def _spans(ax, rows: pd.DataFrame, y: int, colour: str) -> None:
    """One broken bar per lane and colour (thousands of nodes stay one draw call)."""
    ax.broken_barh(list(zip(rows["start_s"] * 1e3, (rows["end_s"] - rows["start_s"]) * 1e3, strict=True)),
                   (y - 0.4, 0.8), facecolors=colour, linewidth=0)


def _idle_spans(ax, compute: pd.DataFrame, y: int, step_end: float) -> None:
    """The gaps of a compute lane between 0 and the step's end: pipeline bubbles, waits, idle after the flush."""
    gaps, cursor = [], 0.0
    for start, end in sorted(zip(compute["start_s"], compute["end_s"], strict=True)):
        if start > cursor:
            gaps.append((cursor * 1e3, (start - cursor) * 1e3))
        cursor = max(cursor, end)
    if step_end > cursor:
        gaps.append((cursor * 1e3, (step_end - cursor) * 1e3))
    ax.broken_barh(gaps, (y - 0.4, 0.8), facecolors=IDLE_COLOUR, linewidth=0)


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


def figure_html(figure, fig_id: str, alt: str, caption: str) -> str:
    """A figure (a matplotlib figure, or the data URI of one) as an <img> with its one-line caption naming
    where its numbers come from (predicted by what, measured where): a figure that does not say so cannot be
    checked by its reader. The page's CSS (report/html.py) styles the caption."""
    src = figure if isinstance(figure, str) else png_data_uri(figure)
    return (f'<figure><img id="{fig_id}" alt="{html.escape(alt)}" src="{src}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")
