"""The search artifact: every layout in a table, a page with the best by time and by cost and the Pareto
front, and a sweep file of the chosen layouts for the full pipeline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from trainsim.artifacts import atomic_artifact  # noqa: E402
from trainsim.config.compose import Run  # noqa: E402
from trainsim.report.figures import COLOURS, png_data_uri  # noqa: E402
from trainsim.report.html import html_page, table_html  # noqa: E402
from trainsim.search.layouts import SearchSpace  # noqa: E402
from trainsim.search.run import STATUS_OK, SearchResult, cost_column, summary_json, sweep_file_text  # noqa: E402

SECTIONS = ("best", "pareto", "layouts", "search-cost")
SHOWN = ("layout", "world_size", "dp", "tp", "cp", "pp", "ep", "etp", "micro_batch_size", "schedule", "virtual_stages",
         "recompute", "step_time_s", "tokens_per_s", "mfu_pct", "peak_memory_gib", "gpu_seconds_per_step",
         "cost_per_million_tokens_usd", "pareto")


def search_dir(run: Run, budget: int) -> Path:
    return Path("artifacts/search") / run.keys["hardware"] / run.keys["model"] / f"{budget}gpu"


def pareto_figure(table: pd.DataFrame) -> str:
    ok = table[table["status"] == STATUS_OK]
    cost = cost_column(table)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.scatter(ok["step_time_s"], ok[cost], s=8, color=COLOURS["baseline"], label="layouts that fit")
    front = ok[ok["pareto"]].sort_values("step_time_s")
    ax.plot(front["step_time_s"], front[cost], color=COLOURS["model"], marker="o", label="Pareto front")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("USD per million tokens" if cost == "cost_per_million_tokens_usd" else "GPU-seconds per step")
    ax.legend(fontsize=8)
    return png_data_uri(fig)


def render_search_page(run: Run, budget: int, result: SearchResult) -> str:
    table = result.table
    ok = table[table["status"] == STATUS_OK]
    shown = [c for c in SHOWN if c in table]
    counts = table["status"].value_counts().to_dict()
    cost = cost_column(table)
    best = pd.concat([ok.nsmallest(1, "step_time_s").assign(best="time"),
                      ok.nsmallest(1, cost).assign(best="cost")]) if len(ok) else ok.assign(best=[])
    rate = len(table) / result.estimate_s if result.estimate_s else float("nan")
    sections = {
        "best": table_html(best[["best", *shown]], "best-table"),
        "pareto": (f'<img id="pareto-figure" alt="step time against cost" src="{pareto_figure(table)}">'
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
    titles = {"best": "Best by time and by cost", "pareto": "Pareto front", "layouts": "Layouts",
              "search-cost": "Search cost"}
    return html_page(f"trainsim layout search: {run.model.name} on {budget} x {run.hardware.name}",
                     [(k, titles[k], sections[k]) for k in SECTIONS])


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
