"""Predicted against measured step time, drawn as simulator papers show it (vTrain Fig. 9, Echo, SimAI).

A scatter of predicted against measured per configuration around the y = x line with +-5 % and +-10 %
bands, and the |error| per model size and per layout as bars: how far off the predictions are, and where the
error comes from. The sweep summary page (its points with a ground truth) and the page of published
multi-node runs (`benchmarks/scale_accuracy.py --page`) both draw them from here, so they read the same way.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from trainsim.report.figures import COLOURS, figure_html  # noqa: E402
from trainsim.report.html import html_page, table_html  # noqa: E402
from trainsim.validation.published import ASSUMPTIONS, TABLES  # noqa: E402

BANDS_PCT = (5.0, 10.0)
LOG_SPAN = 10.0
"""log axes once the longest step is this many times the shortest (on linear axes the short ones crowd together)"""
POINT_COLUMNS = ("label", "group", "model", "layout", "predicted_s", "measured_s", "error_pct")
PUBLISHED_SECTIONS = ("accuracy", "rows", "skipped", "assumptions")


def layout_label(row: Mapping[str, Any]) -> str:
    """'tp8 pp4 dp16', with cp and virtual stages where they are not 1: the layout as papers name it."""
    def value(key):
        v = row.get(key)
        return None if v is None or pd.isna(v) else int(v)

    parts = [f"{k}{value(k)}" for k in ("tp", "cp", "pp", "dp") if value(k) is not None
             and (k != "cp" or value(k) > 1)]
    if (value("virtual_stages") or 1) > 1:
        parts.append(f"vp{value('virtual_stages')}")
    return " ".join(parts) or "?"


def accuracy_points(frame: pd.DataFrame, *, predicted: str, measured: str, label: str, model: str | None = None,
                    group: str | None = None, interval: tuple[str, str] | None = None) -> pd.DataFrame:
    """One row per configuration with both a prediction and a measurement (POINT_COLUMNS; error_pct signed,
    of measured). Rows without a measurement are left out: an unmeasured point is not an error of zero.
    `interval`: the columns of each prediction's 80 % interval (low, high), kept as predicted_low_s/_high_s."""
    if measured not in frame or predicted not in frame:
        return pd.DataFrame(columns=POINT_COLUMNS)
    has = frame[frame[measured].notna() & frame[predicted].notna()]

    def text(column):
        return has[column].astype(str) if column and column in has else ""

    pred, meas = has[predicted].astype(float), has[measured].astype(float)
    points = pd.DataFrame({"label": text(label), "group": text(group), "model": text(model),
                           "layout": [layout_label(r) for _, r in has.iterrows()], "predicted_s": pred,
                           "measured_s": meas, "error_pct": 100 * (pred / meas - 1)}, columns=POINT_COLUMNS)
    if interval is not None and set(interval) <= set(has.columns) and has[list(interval)].notna().all().all():
        points["predicted_low_s"] = has[interval[0]].astype(float).to_numpy()
        points["predicted_high_s"] = has[interval[1]].astype(float).to_numpy()
    return points.reset_index(drop=True)


def _colours(points: pd.DataFrame) -> dict[str, str]:
    """One colour per group, in order of appearance (the scatter and the bars agree)."""
    return {g: f"C{i}" for i, g in enumerate(dict.fromkeys(points["group"]))}


def scatter_limits(points: pd.DataFrame) -> tuple[float, float, bool]:
    """Common range of both axes with a margin, and whether they are logarithmic (range >= LOG_SPAN)."""
    values = np.concatenate([points["predicted_s"].to_numpy(float), points["measured_s"].to_numpy(float)])
    lo, hi = float(values.min()), float(values.max())
    if hi / lo >= LOG_SPAN:
        return lo / 1.3, hi * 1.3, True
    pad = 0.15 * (hi - lo) or 0.15 * hi
    return max(lo - pad, 0.0), hi + pad, False


def accuracy_scatter(points: pd.DataFrame):
    """Predicted against measured, one marker per configuration coloured by group, on y = x with the +-5 %
    and +-10 % bands; the title counts the points, their mean |error| and how many are within 10 %."""
    lo, hi, log = scatter_limits(points)
    x = np.geomspace(lo, hi, 200) if log else np.linspace(lo, hi, 200)
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    for i, pct in enumerate(sorted(BANDS_PCT, reverse=True)):
        ax.fill_between(x, x * (1 - pct / 100), x * (1 + pct / 100), color=COLOURS["baseline"], alpha=0.15 * (i + 1),
                        lw=0, label=f"±{pct:g} %")
    ax.plot(x, x, color="black", lw=0.8, ls="--", label="y = x")
    colours = _colours(points)
    for group, part in points.groupby("group", sort=False):
        ax.scatter(part["measured_s"], part["predicted_s"], s=30, color=colours[group], edgecolor="white", lw=0.5,
                   zorder=3, label=group or "configurations")
        if "predicted_low_s" in part:  # each prediction's 80 % interval: honest where it crosses y = x 4 times in 5
            ax.errorbar(part["measured_s"], part["predicted_s"], fmt="none", ecolor=colours[group], lw=1, capsize=2,
                        yerr=[part["predicted_s"] - part["predicted_low_s"],
                              part["predicted_high_s"] - part["predicted_s"]], zorder=2)
    if log:  # ticks at 1, 2, 5 x 10^k written plainly (matplotlib's minor labels overlap at this size)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_box_aspect(1)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    error = points["error_pct"].abs()
    ax.set_title(f"{len(points)} configurations: mean |error| {error.mean():.1f} %, "
                 f"{int((error <= 10).sum())} within ±10 %", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def error_by(points: pd.DataFrame, by: str) -> pd.DataFrame:
    """Mean |error| and count per value of `by` (model or layout) and group, in order of appearance."""
    return (points.assign(abs_error_pct=points["error_pct"].abs())
            .groupby([by, "group"], sort=False)["abs_error_pct"].agg(["mean", "count"]).reset_index())


def error_bars(points: pd.DataFrame, by: str):
    """Bars of `error_by`, coloured by group, with the 5 % and 10 % lines (count in brackets when > 1)."""
    bars = error_by(points, by)
    colours = _colours(points)
    fig, ax = plt.subplots(figsize=(6, 0.9 + 0.3 * len(bars)))
    y = np.arange(len(bars))
    ax.barh(y, bars["mean"], color=[colours[g] for g in bars["group"]])
    for yi, (mean, count) in enumerate(zip(bars["mean"], bars["count"])):
        ax.text(mean, yi, f" {mean:.1f} %" + (f" ({count})" if count > 1 else ""), va="center", fontsize=7)
    for pct in BANDS_PCT:
        ax.axvline(pct, color="black", lw=0.7, ls=":")
    ax.set_yticks(y, bars[by])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max(bars["mean"].max(), max(BANDS_PCT)))
    ax.set_xlabel(f"|error| (%), mean per {by}")
    if len(colours) > 1:
        ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], list(colours), fontsize=7,
                  loc="lower right")
    return fig


def accuracy_html(points: pd.DataFrame, caption: str) -> str:
    """The scatter and |error| by model and by layout, each captioned with where its numbers come from."""
    return (figure_html(accuracy_scatter(points), "accuracy-scatter-figure",
                        "predicted against measured step time with y = x and ±5 % / ±10 % bands", caption)
            + figure_html(error_bars(points, "model"), "error-by-model-figure", "|error| by model", caption)
            + figure_html(error_bars(points, "layout"), "error-by-layout-figure", "|error| by layout", caption))


def published_points(results: Mapping[str, Any]) -> pd.DataFrame:
    """The rows of `TableResult`s (table name -> result) as accuracy_points, grouped by table and hardware."""
    parts = []
    for name, result in results.items():
        hardware = TABLES[name].hardware if name in TABLES else getattr(result.hardware, "name", "?")
        rows = result.rows.assign(group=f"{name} ({hardware})")
        parts.append(accuracy_points(rows, predicted="predicted_s", measured="measured_s", label="model",
                                     model="model", group="group"))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=POINT_COLUMNS)


def published_page(results: Mapping[str, Any]) -> str:
    """A self-contained page of `benchmarks/scale_accuracy.py`: per table its mean |error|, the figures of
    accuracy_html over every row, the rows, the rows left out with their reason, and the assumptions."""
    points = published_points(results)
    sources = ", ".join(f"data/{TABLES[n].path}" if n in TABLES else n for n in results)
    caption = (f"predicted by trainsim compose, leave-one-row-out kernel fit (benchmarks/scale_accuracy.py); "
               f"measured: {sources} (published throughput as seconds per step, validation/published.py)")
    summary = pd.DataFrame([{"table": n, "hardware": TABLES[n].hardware if n in TABLES else "?",
                             "rows": len(r.rows), "skipped": len(r.skipped),
                             "mean |error| %": r.rows["error_pct"].abs().mean() if len(r.rows) else None,
                             "bias %": r.rows["error_pct"].mean() if len(r.rows) else None,
                             "max |error| %": r.rows["error_pct"].abs().max() if len(r.rows) else None}
                            for n, r in results.items()])
    rows = pd.concat([r.rows.assign(table=n) for n, r in results.items()], ignore_index=True) if results \
        else pd.DataFrame()
    skipped = pd.concat([r.skipped.assign(table=n) for n, r in results.items() if len(r.skipped)],
                        ignore_index=True) if any(len(r.skipped) for r in results.values()) else pd.DataFrame()
    row_cols = ["table", "model", "gpus", "tp", "cp", "pp", "dp", "virtual_stages", "micro_batch", "global_batch",
                "measured_s", "predicted_s", "error_pct"]
    sections = {
        "accuracy": (table_html(summary, "accuracy-table") + accuracy_html(points, caption)) if len(points)
                    else "<p class='missing'>no row was evaluated: no figure</p>",
        "rows": table_html(rows[[c for c in row_cols if c in rows]], "rows-table") if len(rows)
                else "<p>no rows</p>",
        "skipped": table_html(skipped[[c for c in (*row_cols[:8], "skip_reason") if c in skipped]], "skipped-table")
                   if len(skipped) else "<p>none: every row of these tables runs</p>",
        "assumptions": "<ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                                        for k, v in ASSUMPTIONS.items()) + "</ul>",
    }
    titles = {"accuracy": "Predicted vs measured", "rows": "Rows", "skipped": "Rows left out",
              "assumptions": "Assumed where the sources are silent"}
    return html_page("trainsim accuracy on published multi-node runs",
                     [(k, titles[k], sections[k]) for k in PUBLISHED_SECTIONS])
