"""Step time and memory over the layout grid: one cell per (tp, cp, pp) row and dp column, holding the best
layout of that cell. The search page and a sweep's summary page draw the same two heatmaps."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from trainsim.report.figures import COLOURS  # noqa: E402

STATUS_OK = "ok"
"""A layout or sweep point that fits in memory (search/run.py and report/sweep.py use the same word)."""


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
