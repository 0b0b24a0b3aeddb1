"""The search artifact: every layout in a table, a page with the best by time and by cost, step time and
memory over the layout grid, the Pareto front with the fastest and the cheapest layout marked, and a sweep
file of the chosen layouts for the full pipeline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from trainsim.artifacts import atomic_artifact  # noqa: E402
from trainsim.config.compose import Run  # noqa: E402
from trainsim.report.figures import COLOURS, figure_html  # noqa: E402
from trainsim.report.html import html_page, table_html  # noqa: E402
from trainsim.search.layouts import SearchSpace  # noqa: E402
from trainsim.search.run import STATUS_OK, SearchResult, cost_column, summary_json, sweep_file_text  # noqa: E402

SECTIONS = ("best", "grid", "pareto", "layouts", "search-cost")
SHOWN = ("layout", "world_size", "dp", "tp", "cp", "pp", "ep", "etp", "micro_batch_size", "schedule", "virtual_stages",
         "recompute", "step_time_s", "tokens_per_s", "mfu_pct", "peak_memory_gib", "gpu_seconds_per_step",
         "cost_per_million_tokens_usd", "training_days", "training_cost_usd", "pareto")


def search_dir(run: Run, budget: int) -> Path:
    return Path("artifacts/search") / run.keys["hardware"] / run.keys["model"] / f"{budget}gpu"


def chosen_layouts(table: pd.DataFrame) -> dict[str, pd.Series]:
    """The answers people act on: the fastest layout that fits and the cheapest (by cost_column)."""
    ok = table[table["status"] == STATUS_OK]
    return {"fastest": ok.loc[ok["step_time_s"].idxmin()], "cheapest": ok.loc[ok[cost_column(table)].idxmin()]}


def pareto_figure(table: pd.DataFrame):
    """Every layout that fits, the front of those no other beats on both time and cost, and the fastest and
    the cheapest marked and labelled with their layout (one label when they are the same layout)."""
    ok = table[table["status"] == STATUS_OK]
    cost = cost_column(table)
    unit = "USD per million tokens" if cost == "cost_per_million_tokens_usd" else "GPU-seconds per step"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.scatter(ok["step_time_s"], ok[cost], s=8, color=COLOURS["baseline"], label="layouts that fit")
    front = ok[ok["pareto"]].sort_values("step_time_s")
    ax.plot(front["step_time_s"], front[cost], color=COLOURS["model"], marker="o", ms=4, label="Pareto front")
    chosen = chosen_layouts(table)
    same = chosen["fastest"]["layout"] == chosen["cheapest"]["layout"]
    for (name, row), marker, offset in zip(chosen.items(), ("*", "D"), ((-8, 8), (8, -14))):
        if same and name == "cheapest":
            break
        label = "fastest and cheapest" if same else name
        days = row.get("training_days")  # a search with a token budget (train.tokens) has the whole run
        whole_run = f", {days:.3g} days" if days is not None and pd.notna(days) else ""
        ax.scatter([row["step_time_s"]], [row[cost]], s=140 if marker == "*" else 60, marker=marker, zorder=4,
                   color=COLOURS["comm"] if name == "fastest" else COLOURS["optimizer"], edgecolor="black", lw=0.6,
                   label=f"{label}: {row['layout']} ({row['step_time_s']:.3g} s, {row[cost]:.3g}{whole_run})")
        ax.annotate(label, xy=(row["step_time_s"], row[cost]), xytext=offset, textcoords="offset points", fontsize=8,
                    ha="right" if offset[0] < 0 else "left", fontweight="bold")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel(unit)
    ax.margins(x=0.08, y=0.12)  # room for the labels next to the marked layouts
    ax.legend(fontsize=7)
    return fig


def grid_cells(table: pd.DataFrame) -> pd.DataFrame:
    """One cell per (tp, cp, pp) row and dp column of the layout grid, for its best layout: the fastest that
    fits (micro-batch size, schedule, recompute, ep vary inside a cell), or where none fits the one with the
    least peak memory (oom True, no step time): what each grid point can do at best."""
    cells = []
    for (tp, cp, pp, dp), part in table.groupby(["tp", "cp", "pp", "dp"]):
        ok = part[part["status"] == STATUS_OK]
        best = ok.loc[ok["step_time_s"].idxmin()] if len(ok) else part.loc[part["peak_memory_gib"].idxmin()]
        cells.append({"row": f"tp{tp}" + (f" cp{cp}" if cp > 1 else "") + f" pp{pp}", "dp": int(dp),
                      "layout": best["layout"], "step_time_s": float(best["step_time_s"]) if len(ok) else np.nan,
                      "peak_memory_gib": float(best["peak_memory_gib"]), "oom": not len(ok), "layouts": len(part)})
    return pd.DataFrame(cells, columns=["row", "dp", "layout", "step_time_s", "peak_memory_gib", "oom", "layouts"])


def _heatmap(cells: pd.DataFrame, values: pd.DataFrame, texts: pd.DataFrame, cmap: str, vmin: float, vmax: float,
             label: str):
    """`values` (rows x dp) coloured, each cell with its text; OOM cells hatched red; cells without any
    layout blank."""
    fig, ax = plt.subplots(figsize=(2.6 + 0.95 * values.shape[1], 1.2 + 0.42 * values.shape[0]))
    image = ax.imshow(np.ma.masked_invalid(values.to_numpy(float)), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    oom = cells.pivot(index="row", columns="dp", values="oom").reindex_like(values).isin([True]).to_numpy()
    shade = (values.to_numpy(float) - vmin) / ((vmax - vmin) or 1.0)
    for i, j in np.ndindex(values.shape):
        if oom[i, j]:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#f6dcdc", edgecolor="#a00", hatch="//",
                                       lw=0))
        dark = not oom[i, j] and np.isfinite(shade[i, j]) and (shade[i, j] < 0.45 if cmap == "viridis"
                                                                else shade[i, j] > 0.6)
        ax.text(j, i, texts.iat[i, j], ha="center", va="center", fontsize=7, color="white" if dark else
                ("#a00" if oom[i, j] else "black"))
    ax.set_xticks(range(values.shape[1]), [str(c) for c in values.columns])
    ax.set_yticks(range(values.shape[0]), list(values.index))
    ax.set_xlabel("data-parallel replicas (dp)")
    ax.set_ylabel("model parallelism")
    fig.colorbar(image, ax=ax, label=label)
    return fig, ax


def _grid(cells: pd.DataFrame, column: str) -> pd.DataFrame:
    rows, columns = list(dict.fromkeys(cells["row"])), sorted(set(cells["dp"]))
    return cells.pivot(index="row", columns="dp", values=column).reindex(index=rows, columns=columns)


def step_time_heatmap(cells: pd.DataFrame):
    """Best step time per grid cell ('OOM' where no layout fits), the fastest cell outlined."""
    times = _grid(cells, "step_time_s").astype(float)
    finite = times.to_numpy()[np.isfinite(times.to_numpy())]
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    oom = _grid(cells, "oom").isin([True])
    texts = times.map(lambda v: f"{v:.3g}" if np.isfinite(v) else "").mask(oom, "OOM")
    fig, ax = _heatmap(cells, times, texts, "viridis", lo, hi if hi > lo else lo + 1e-9, "best step time (s)")
    if finite.size:
        i, j = np.unravel_index(np.nanargmin(times.to_numpy()), times.shape)
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor=COLOURS["comm"], lw=2.5))
    return fig


def memory_heatmap(cells: pd.DataFrame, capacity_gib: float | None):
    """Peak memory of each cell's best layout against the GPU's capacity (GiB in each cell), OOM cells
    hatched with the least peak memory any of their layouts needs."""
    gib = _grid(cells, "peak_memory_gib").astype(float)
    oom = _grid(cells, "oom").isin([True])
    texts = gib.map(lambda v: f"{v:.1f}" if np.isfinite(v) else "")
    texts = texts.mask(oom, "OOM " + texts)
    if capacity_gib:
        return _heatmap(cells, gib / capacity_gib, texts, "Oranges", 0.0, 1.0,
                        f"peak memory / capacity ({capacity_gib:.0f} GiB); text: GiB")[0]
    return _heatmap(cells, gib, texts, "Oranges", 0.0, float(np.nanmax(gib.to_numpy())) or 1.0, "peak memory (GiB)")[0]


def render_search_page(run: Run, budget: int, result: SearchResult) -> str:
    return html_page(f"trainsim layout search: {run.model.name} on {budget} x {run.hardware.name}",
                     search_sections(run, budget, result))


def search_sections(run: Run, budget: int, result: SearchResult) -> list[tuple[str, str, str]]:
    """(id, heading, HTML) of each SECTIONS entry: the search page's, and `trainsim plan`'s alternatives."""
    table = result.table
    ok = table[table["status"] == STATUS_OK]
    shown = [c for c in SHOWN if c in table and table[c].notna().any()]  # training totals only with a budget
    counts = table["status"].value_counts().to_dict()
    cost = cost_column(table)
    best = pd.DataFrame(list(chosen_layouts(table).values())).assign(best=["time", "cost"]) if len(ok) \
        else ok.assign(best=[])
    rate = len(table) / result.estimate_s if result.estimate_s else float("nan")
    source = (f"predicted by the trainsim layout search (per-layout estimate, search/estimate.py) for {run.model.name}"
              f" on {budget} x {run.hardware.name}; not measured")
    cells = grid_cells(table)
    capacity = run.hardware.memory_capacity_bytes / 2**30 if run.hardware.memory_capacity_bytes else None
    sections = {
        "best": table_html(best[["best", *shown]], "best-table"),
        "grid": "<p>Each cell: the fastest layout that fits at that tp, cp, pp and dp (over micro-batch size, "
                "schedule, recompute and ep); OOM where none fits; blank where no layout was enumerated.</p>"
                + figure_html(step_time_heatmap(cells), "step-time-heatmap",
                              "best step time per tp/pp and dp cell, OOM cells marked",
                              f"{source}; outlined: the fastest cell")
                + figure_html(memory_heatmap(cells, capacity), "memory-heatmap",
                              "peak memory of each cell's best layout against capacity, OOM cells marked",
                              f"{source}; peak per GPU against hardware.memory_capacity_bytes"),
        "pareto": (figure_html(pareto_figure(table), "pareto-figure",
                               "step time against cost: the Pareto front with the fastest and cheapest layouts",
                               f"{source}; cost: {cost} (hardware.price_per_device_hour)")
                   if len(ok) else "<p class='missing'>no layout fits in memory</p>")
                  + table_html(ok[ok["pareto"]].sort_values("step_time_s")[shown], "pareto-table"),
        "layouts": f"<p>{len(table)} layouts: " + ", ".join(f"{v} {k}" for k, v in counts.items())
                   + ". The 50 fastest that fit:</p>"
                   + table_html(ok.nsmallest(50, "step_time_s")[shown], "layouts-table"),
        "search-cost": table_html(pd.DataFrame([{"layouts": len(table), "processes": result.jobs,
                                                 "slice tracing and profiling (s)": result.slices_s,
                                                 "estimates (s)": result.estimate_s, "layouts per second": rate}]),
                                  "search-cost-table"),
    }
    titles = {"best": "Best by time and by cost", "grid": "Step time and memory over the layout grid",
              "pareto": "Pareto front", "layouts": "Layouts", "search-cost": "Search cost"}
    return [(k, titles[k], sections[k]) for k in SECTIONS]


def write_search_artifact(run: Run, budget: int, space: SearchSpace, result: SearchResult, output: Path,
                          top: int = 5) -> None:
    config = {"hardware": run.group("hardware"), "model": run.group("model"),
              "parallelism": run.group("parallelism"), "budget": budget, "space": dataclasses.asdict(space)}
    with atomic_artifact(output, stage="search", config=config, config_keys={**run.keys, "budget": str(budget)}) \
            as tmp:
        result.table.to_parquet(tmp / "layouts.parquet", index=False)
        result.table.to_csv(tmp / "layouts.csv", index=False)
        (tmp / "search.html").write_text(render_search_page(run, budget, result))
        (tmp / "sweep.yaml").write_text(sweep_file_text(result, run, budget, top))
        (tmp / "summary.json").write_text(summary_json(result, budget) + "\n")
