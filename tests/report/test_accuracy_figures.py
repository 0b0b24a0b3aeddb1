"""The predicted-vs-measured figures shared by the sweep page and the published-runs page, and that page
(benchmarks/scale_accuracy.py --page) built from TableResult rows without running the benchmark."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection, PolyCollection

from trainsim.report.accuracy_figures import (
    PUBLISHED_SECTIONS,
    accuracy_points,
    accuracy_scatter,
    error_bars,
    error_by,
    layout_label,
    published_page,
    published_points,
)
from trainsim.report.browser import broken_elements, render_report
from trainsim.validation.published import TableResult, read_table

FIGURES = {"accuracy-scatter-figure", "error-by-model-figure", "error-by-layout-figure"}


def _frame() -> pd.DataFrame:
    """Four configurations, one without a measurement, step times spanning two decades."""
    return pd.DataFrame({"name": ["a", "b", "c", "d"], "model": ["1B", "1B", "70B", "7B"],
                         "tp": [1, 1, 8, 2], "pp": [1, 2, 4, 1], "cp": [1, 1, 2, 1], "dp": [8, 4, 1, 4],
                         "virtual_stages": [1, 1, 3, 1], "predicted_s": [0.5, 0.95, 50.0, 5.5],
                         "measured_s": [0.52, 1.0, 45.0, None], "hw": ["x", "x", "y", "y"]})


def test_points_leave_out_the_unmeasured_and_the_scatter_draws_each_one():
    points = accuracy_points(_frame(), predicted="predicted_s", measured="measured_s", label="name", model="model",
                             group="hw")
    assert list(points["label"]) == ["a", "b", "c"]  # d has no measurement: left out, not an error of zero
    assert points["error_pct"].tolist() == pytest.approx([100 * (0.5 / 0.52 - 1), -5.0, 100 * (50 / 45 - 1)])
    assert list(points["layout"]) == ["tp1 pp1 dp8", "tp1 pp2 dp4", "tp8 cp2 pp4 dp1 vp3"]
    fig = accuracy_scatter(points)
    ax = fig.axes[0]
    drawn = np.concatenate([c.get_offsets() for c in ax.collections if isinstance(c, PathCollection)])
    assert sorted(map(tuple, drawn)) == sorted(zip(points["measured_s"], points["predicted_s"]))
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # +-10 % and +-5 %
    lo, hi = ax.get_xlim()
    inner = bands[1].get_paths()[0].vertices  # the +-5 % band around y = x
    assert inner[:, 1].max() == pytest.approx(1.05 * hi, rel=1e-6)
    assert ax.get_xscale() == "log" and ax.get_ylim() == ax.get_xlim()  # 0.5 to 50 s: two decades
    assert "3 configurations" in ax.get_title() and "2 within ±10 %" in ax.get_title()
    close = accuracy_scatter(points.iloc[:2])
    assert close.axes[0].get_xscale() == "linear"  # 0.5 to 1 s reads better on linear axes


def test_error_bars_are_the_mean_absolute_error_per_model():
    points = accuracy_points(_frame(), predicted="predicted_s", measured="measured_s", label="name", model="model",
                             group="hw")
    table = error_by(points, "model")
    assert list(table["model"]) == ["1B", "70B"] and list(table["count"]) == [2, 1]
    assert table["mean"].tolist() == pytest.approx([points["error_pct"].abs()[:2].mean(), 100 * (50 / 45 - 1)])
    widths = [bar.get_width() for bar in error_bars(points, "model").axes[0].patches[:2]]
    assert widths == pytest.approx(table["mean"].tolist())
    assert layout_label({"tp": 4, "pp": 1, "dp": 2, "cp": None}) == "tp4 pp1 dp2"


def _results() -> dict[str, TableResult]:
    """Two published tables' real rows, predicted 3 % high on odd rows and 8 % low on even ones; the first
    table's last row as skipped with its reason."""
    results = {}
    for name in ("megatron2021_a100", "mcore2024_h100"):
        rows = read_table(name).reset_index(drop=True)
        rows["predicted_s"] = rows["measured_s"] * np.where(rows.index % 2, 1.03, 0.92)
        rows["error_pct"] = 100 * (rows["predicted_s"] / rows["measured_s"] - 1)
        rows["matmul_efficiency"], rows["memory_efficiency"] = 0.7, 0.9  # each fold's fit, as evaluate_tables has
        skipped = rows.iloc[-1:].assign(skip_reason="layers=61 not divisible by pp*vp=4*1") \
            if name == "megatron2021_a100" else pd.DataFrame()
        results[name] = TableResult(rows.iloc[:-1] if len(skipped) else rows, {"matmul_efficiency": 0.7}, 1.0,
                                    skipped)
    return results


def test_published_page_draws_every_row_and_renders_whole(tmp_path, chromium):
    results = _results()
    points = published_points(results)
    assert len(points) == sum(len(r.rows) for r in results.values())
    assert set(points["group"]) == {"megatron2021_a100 (a100-80g-selene)", "mcore2024_h100 (h100-sxm-dgx)"}
    assert points["error_pct"].abs().max() == pytest.approx(8.0)
    page = tmp_path / "scale.html"
    page.write_text(published_page(results))
    text = page.read_text()
    assert "data/published/megatron-lm_readme_2021_a100_selene_weak_scaling.csv" in text  # the caption's source
    assert text.count("<figcaption") == 3
    rendered = render_report(page, browser=chromium)
    assert broken_elements(rendered, PUBLISHED_SECTIONS) == []
    assert FIGURES <= {img["id"] for img in rendered["images"]}
    tables = {t["id"]: t["rows"] for t in rendered["tables"]}
    assert tables["rows-table"] == len(points) and tables["skipped-table"] == 1 and tables["accuracy-table"] == 2


def test_scale_benchmark_writes_the_page(tmp_path, monkeypatch, capsys):
    """`--page` on the benchmark script itself, with evaluate_tables replaced by the rows above (the real one
    composes every row: minutes per table)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_accuracy.py"
    spec = importlib.util.spec_from_file_location("scale_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = _results()
    monkeypatch.setattr(bench, "evaluate_tables", lambda names: {name: results[name] for name in names})
    monkeypatch.setattr(bench, "build_point", lambda run, target: None)  # what evaluate_tables would read
    monkeypatch.setattr(sys, "argv", ["scale_accuracy.py", "--tables", "mcore2024_h100", "--skip-timing",
                                      "--skip-generalise", "--page", str(tmp_path / "page.html")])
    bench.main()
    assert f"page {tmp_path / 'page.html'}" in capsys.readouterr().out
    text = (tmp_path / "page.html").read_text()
    assert 'id="accuracy-scatter-figure"' in text and "megatron2021" not in text.split('id="assumptions"')[0]
