"""The search artifact: every layout in a table, a page with the best by time and by cost, step time and
memory over the layout grid, the Pareto front with the fastest and the cheapest layout marked, and a sweep
file of the chosen layouts for the full pipeline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from trainsim.artifacts import atomic_artifact  # noqa: E402
from trainsim.config.compose import Run  # noqa: E402
from trainsim.report.figures import COLOURS, figure_html  # noqa: E402
from trainsim.report.html import html_page, table_html  # noqa: E402
from trainsim.report.layout_grid import grid_cells, memory_heatmap, step_time_heatmap  # noqa: E402
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
