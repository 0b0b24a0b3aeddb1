"""The sweep summary: every point of a sweep in one table (Parquet, CSV) and one page.

Per valid point: layout, predicted step time, tokens/s, MFU, peak memory and OOM verdict, cost per step
and per million tokens, measured step time and error where a ground truth exists, and what the
simulation cost (trace and compose wall time). Invalid points keep their overrides and the reason; an
OOM point is simulated but flagged. The page adds the what-if answers as before/after bars, predicted vs
measured as papers show it (report/accuracy_figures.py) for the points with a ground truth, and simulation
cost against GPU count; every figure's caption says where its numbers come from.
"""

from __future__ import annotations

import html
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from trainsim.artifacts import atomic_artifact, read_manifest  # noqa: E402
from trainsim.registry import STAGES  # noqa: E402
from trainsim.report.accuracy_figures import accuracy_html, accuracy_points  # noqa: E402
from trainsim.report.efficiency import efficiency  # noqa: E402
from trainsim.report.figures import COLOURS, figure_html  # noqa: E402
from trainsim.report.html import NOT_MEASURED, html_page, table_html  # noqa: E402
from trainsim.report.layout_grid import grid_cells, memory_heatmap, step_time_heatmap  # noqa: E402

TABLE_FILE, CSV_FILE, HTML_FILE = "summary.parquet", "summary.csv", "summary.html"
STATUS_OK, STATUS_OOM, STATUS_INVALID = "ok", "oom", "invalid"
SECTIONS = ("points", "grid", "what-if", "end-to-end", "cost")


def point_row(keys: dict[str, str], root: Path = Path(".")) -> dict[str, Any]:
    """One valid point's row, read from its verified compose, trace and report artifacts."""
    compose_dir = root / STAGES["compose"].path(keys)
    manifest = read_manifest(compose_dir)
    summary = json.loads((compose_dir / "summary.json").read_text())
    config = manifest["config"]
    hw, model, par = config["hardware"], config["model"], config["parallelism"]
    peaks = [c["peak_memory_bytes"] for c in summary["classes"] if c.get("peak_memory_bytes") is not None]
    report_dir = root / STAGES["report"].path(keys)
    end_to_end, train_tokens = {}, 0.0
    if (report_dir / "manifest.json").is_file():
        report = read_manifest(report_dir)  # verified: a corrupt report stops the summary
        end_to_end = json.loads((report_dir / "metrics.json").read_text())["end_to_end"]
        train_tokens = report["config"].get("train", {}).get("tokens", 0.0)  # the budget the page was made for
    row: dict[str, Any] = {
        **keys, "status": STATUS_OOM if summary["oom"] else STATUS_OK, "reason": None,
        "world_size": summary["world_size"], "num_nodes": hw["num_nodes"], "dp": par["dp"], "tp": par["tp"],
        "cp": par.get("cp", 1), "pp": par["pp"], "micro_batch_size": par["micro_batch_size"],
        "num_microbatches": summary["num_microbatches"],
        "schedule": par["schedule"], "recompute": par["recompute"], "step_time_s": summary["step_time_s"],
        **efficiency(summary["step_time_s"], hw, model, par, train_tokens=train_tokens),
        "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "memory_capacity_gib": hw["memory_capacity_bytes"] / 2**30 if hw["memory_capacity_bytes"] else None,
        "oom": bool(summary["oom"]),
        "trace_s": read_manifest(root / STAGES["trace"].path(keys)).get("wall_time_s"),
        "compose_s": summary.get("simulate_s"),
    }
    row["measured_step_s"] = end_to_end.get("measured_s")
    row["error_pct"] = end_to_end.get("error_pct")
    row["step_time_low_80_s"] = end_to_end.get("predicted_low_80_s")  # the report's interval, where it made one
    row["step_time_high_80_s"] = end_to_end.get("predicted_high_80_s")
    return row


def summary_table(points: list[dict[str, Any]], root: Path = Path(".")) -> pd.DataFrame:
    """All points in sweep order; `points` as SweepPoint.as_dict() gives them (keys None when invalid)."""
    rows = []
    for point in points:
        base = {"point": " ".join(point["overrides"]) or "(defaults)"}
        if point["keys"] is None:
            rows.append({**base, "status": STATUS_INVALID, "reason": point["reason"]})
        else:
            rows.append({**base, **point_row(point["keys"], root)})
    table = pd.DataFrame(rows)
    valid = table["status"] != STATUS_INVALID
    if valid.any():  # every answer relative to the sweep's first valid point (the baseline of a what-if)
        first = table.loc[valid, "step_time_s"].iloc[0]
        table.loc[valid, "step_vs_first_pct"] = 100 * (table.loc[valid, "step_time_s"] / first - 1)
    return table


def what_if_lines(table: pd.DataFrame) -> list[str]:
    """'<what differs>: step -x% (t s vs t0 s with <the first point's value>)' for every valid point after the
    first, e.g. 'hardware.what_if.inter_node_bandwidth_scale=2: step -3.1% (... with ..._scale=1)'."""
    valid = table[table["status"] != STATUS_INVALID]
    if len(valid) < 2:
        return []
    first = valid.iloc[0]
    lines = []
    for row in valid.iloc[1:].itertuples():
        changed, before = differences(first.point, row.point)
        lines.append(f"{changed}: step {row.step_vs_first_pct:+.1f}% ({row.step_time_s:.4g} s vs "
                     f"{first.step_time_s:.4g} s with {before})")
    return lines


def differences(first: str, point: str) -> tuple[str, str]:
    """(the overrides of `point` that the first point has not, the first point's in their place): a point is
    named by what differs from the first, not by its whole override list."""
    changed = [o for o in point.split() if o not in first.split()] or [point]
    before = [o for o in first.split() if o not in point.split()] or [first]
    return " ".join(changed), " ".join(before)


WHAT_IF_METRICS = (("step_time_s", "step time (s)"), ("training_days", "training time (days)"),
                   ("training_cost_usd", "training cost (USD)"))
"""what the before/after bars compare; the training totals only where every valid point has them (a sweep
run with a token budget, train.tokens)"""


def what_if_figure(table: pd.DataFrame):
    """Before (the first valid point, grey) and after (each other point) as paired horizontal bars, one panel
    per WHAT_IF_METRICS column the points all have; each after bar says its value and its change."""
    valid = table[table["status"] != STATUS_INVALID]
    first, others = valid.iloc[0], valid.iloc[1:]
    metrics = [(c, label) for c, label in WHAT_IF_METRICS if c in valid and valid[c].notna().all()]
    fig, axes = plt.subplots(1, len(metrics), figsize=(2.5 + 4 * len(metrics), 1.0 + 0.6 * len(others)),
                             sharey=True, squeeze=False)
    y = np.arange(len(others))
    for ax, (column, label) in zip(axes[0], metrics):
        before, after = float(first[column]), others[column].astype(float)
        ax.barh(y - 0.2, [before] * len(others), height=0.4, color=COLOURS["baseline"], label="before (first point)")
        ax.barh(y + 0.2, after, height=0.4, color=COLOURS["model"], label="after")
        for yi, value in zip(y, after):
            ax.text(value, yi + 0.2, f" {value:.4g} ({100 * (value / before - 1):+.1f} %)", va="center", fontsize=7)
        ax.set_xlim(0, 1.45 * max(before, after.max()))
        ax.set_xlabel(label)
    names = [textwrap.fill(changed, 60) + "\n" + textwrap.fill(f"(vs {was})", 60)
             for changed, was in (differences(first["point"], p) for p in others["point"])]
    axes[0][0].set_yticks(y, names, fontsize=7)
    axes[0][0].invert_yaxis()
    axes[0][0].legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)
    return fig


PREDICTED = f"predicted by trainsim compose per point ({STAGES['compose'].output}/summary.json)"
MEASURED = (f"measured: median step time of the point's ground truth ({STAGES['ground_truth'].output}, "
            "read by its report)")


def end_to_end_html(valid: pd.DataFrame) -> str:
    """The paper-style figures (accuracy_figures) over the points with a ground truth; without any, a sentence
    saying so (no empty figure: an absent measurement is not an error of zero)."""
    points = accuracy_points(valid, predicted="step_time_s", measured="measured_step_s", label="point",
                             model="model", group="hardware", interval=("step_time_low_80_s", "step_time_high_80_s"))
    if not len(points):
        return (f"<p class='missing' id='no-ground-truth'>No point has a ground truth ({NOT_MEASURED}): nothing to "
                f"compare. A measured step time is read from {STAGES['ground_truth'].output}.</p>")
    return (f"<p>{len(points)} of {len(valid)} point(s) measured.</p>"
            + accuracy_html(points, f"{PREDICTED}; {MEASURED}"))


def _cost_figure(table: pd.DataFrame):
    valid = table[table["status"] != STATUS_INVALID]
    fig, ax = plt.subplots(figsize=(5, 3))
    for column, colour in (("trace_s", COLOURS["forward"]), ("compose_s", COLOURS["backward"])):
        if column in valid:
            ax.scatter(valid["world_size"], valid[column], color=colour, label=column.removesuffix("_s"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("wall time (s)")
    ax.legend(fontsize=8)
    return fig


def grid_html(valid: pd.DataFrame) -> str:
    """The search page's heatmaps over the sweep's layouts, when its points share hardware and model and span
    more than one (tp, cp, pp, dp) cell; else why not."""
    if valid.empty or valid[["hardware", "model"]].drop_duplicates().shape[0] > 1:
        return "<p>The points differ in hardware or model (or none is valid): no grid of layouts to draw.</p>"
    cells = grid_cells(valid.assign(layout=valid["point"]))
    if len(cells) < 2:
        return "<p>Every point has the same tp, cp, pp and dp: no grid of layouts to draw.</p>"
    capacity = valid["memory_capacity_gib"].iloc[0]
    source = f"{PREDICTED}; each cell the fastest point that fits at that tp, cp, pp and dp"
    return (figure_html(step_time_heatmap(cells), "step-time-heatmap", "step time per tp/pp and dp cell", source)
            + figure_html(memory_heatmap(cells, capacity if pd.notna(capacity) else None), "memory-heatmap",
                          "peak memory per tp/pp and dp cell against capacity", f"{source}; peak per GPU"))


def render_summary_page(name: str, table: pd.DataFrame) -> str:
    shown = [c for c in ("point", "status", "reason", "world_size", "dp", "tp", "cp", "pp", "micro_batch_size",
                         "schedule", "recompute", "step_time_s", "step_time_low_80_s", "step_time_high_80_s",
                         "tokens_per_s", "tokens_per_s_per_gpu", "mfu_pct",
                         "hfu_pct", "peak_memory_gib", "oom", "cost_per_step_usd", "cost_per_million_tokens_usd",
                         "training_days", "training_gpu_hours", "training_cost_usd", "training_energy_mwh",
                         "step_vs_first_pct", "measured_step_s", "error_pct")
             if c in table and table[c].notna().any()]  # training totals only with a token budget
    invalid = int((table["status"] == STATUS_INVALID).sum())
    valid = table[table["status"] != STATUS_INVALID]
    e2e = valid[[c for c in ("point", "step_time_s", "measured_step_s", "error_pct") if c in table]].copy()
    if "measured_step_s" in e2e:  # "not measured", never an error of zero
        e2e["measured_step_s"] = e2e["measured_step_s"].astype(object).where(e2e["measured_step_s"].notna(),
                                                                             NOT_MEASURED)
    cost_cols = [c for c in ("point", "world_size", "trace_s", "compose_s") if c in table]
    lines = what_if_lines(table)
    sections = {
        "grid": grid_html(valid),
        "what-if": ("<p>Each point against the first (the baseline when the sweep varies hardware.what_if, "
                    "num_nodes or any other knob):</p><ul id='what-if-list'>"
                    + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>"
                    + figure_html(what_if_figure(table), "what-if-figure", "before and after step time per point",
                                  f"{PREDICTED}, before = the first valid point; not measured")) if lines
                   else "<p>one valid point: nothing to compare</p>",
        "points": f"<p>{len(table)} point(s), {invalid} invalid (reason in the table).</p>"
                  + table_html(table[shown], "points-table"),
        "end-to-end": table_html(e2e, "end-to-end-table") + end_to_end_html(valid),
        "cost": table_html(valid[cost_cols], "cost-table")
                + figure_html(_cost_figure(table), "cost-figure", "simulation cost by GPU count",
                              "wall time of each point's trace stage (its manifest) and compose (its summary.json)"),
    }
    titles = {"points": "Points", "grid": "Step time and memory over the layouts", "what-if": "What if",
              "end-to-end": "Predicted vs measured",
              "cost": "Simulation cost by GPU count"}
    return html_page(f"trainsim sweep {name}", [(k, titles[k], sections[k]) for k in SECTIONS])


def write_sweep_summary(name: str, points: list[dict[str, Any]], output: Path,
                        root: Path = Path(".")) -> pd.DataFrame:
    """Gather the points and publish summary.parquet, summary.csv and summary.html atomically."""
    table = summary_table(points, root)
    inputs = [root / STAGES["compose"].path(p["keys"]) for p in points if p["keys"] is not None]
    with atomic_artifact(output, stage="sweep_summary", config={"name": name, "points": points},
                         config_keys={"sweep": name}, inputs=inputs) as tmp:
        table.to_parquet(tmp / TABLE_FILE, index=False)
        table.to_csv(tmp / CSV_FILE, index=False)
        (tmp / HTML_FILE).write_text(render_summary_page(name, table))
    return table
