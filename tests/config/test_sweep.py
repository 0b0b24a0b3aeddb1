"""Sweeps: sweep files, invalid points kept with their reason, the summary table and page, efficiency."""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest
from conftest import copy_project

from trainsim.config import compose_run
from trainsim.config.sweep import read_sweep_file, sweep_points
from trainsim.errors import ConfigError
from trainsim.report.browser import broken_elements, find_browser, render_report
from trainsim.report.efficiency import TRAINING_TOTALS, efficiency, hardware_flops_per_step, model_flops_per_step
from trainsim.report.sweep import SECTIONS, STATUS_INVALID, STATUS_OK


def test_sweep_file_grid_and_points(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("name: g\ngrid:\n  model: [gpt-tiny, gpt-small]\n  parallelism.tp: [1, 2]\n"
                    "points:\n  - [parallelism=pp2]\n")
    name, points = read_sweep_file(path)
    assert name == "g" and len(points) == 5
    assert ["model=gpt-small", "parallelism.tp=2"] in points and points[-1] == ["parallelism=pp2"]


@pytest.mark.parametrize("text, message", [
    ("grid: {model: gpt-tiny}\n", "'grid' must map override keys to non-empty lists"),
    ("points: [parallelism=pp2]\n", r"points\[0\] must be a list of overrides"),
    ("grids: {}\n", r"unknown key\(s\) \['grids'\]"),
    ("name: x\n", "no points"),
])
def test_bad_sweep_files_are_named(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"sweep file {path}: {message}"):
        read_sweep_file(path)


def test_invalid_points_are_kept_with_their_reason(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("grid:\n  parallelism.tp: [1, 3]\n")
    name, points = sweep_points({"parallelism": "single", "sweep_file": str(path)})
    assert name.startswith("sweep-") and len(points) == 2
    assert points[0].run is not None and points[0].reason is None
    assert points[1].run is None and "tp=3 does not divide" in points[1].reason
    assert points[1].as_dict() == {"overrides": ["parallelism=single", "parallelism.tp=3"], "keys": None,
                                   "reason": points[1].reason}
    assert sweep_points({"sweep_name": "mine"})[0] == "mine"
    with pytest.raises(ConfigError, match="names a directory"):
        sweep_points({"sweep_name": "../x"})


def test_model_flops_match_megatron_and_efficiency_figures():
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp8-tp8-dp2"])
    model, par = run.group("model"), run.group("parallelism")
    b, s, h, v = par["global_batch_size"], model["seq_length"], model["hidden_size"], model["vocab_size"]
    layers = model["num_layers"]
    megatron = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))  # Narayanan et al. 2021, eq. 3
    assert model_flops_per_step(model, par) == pytest.approx(megatron, rel=1e-12)
    figures = efficiency(10.0, run.group("hardware"), model, par)
    world = par["dp"] * par["tp"] * par["pp"]
    assert figures["mfu_pct"] == pytest.approx(100 * megatron / (10.0 * world * 312e12))
    assert figures["tokens_per_s"] == pytest.approx(b * s / 10.0)
    price = run.group("hardware")["price_per_device_hour"]  # a config choice, not physics: read, not copied
    assert price > 0 and figures["cost_per_step_usd"] == pytest.approx(price * world * 10 / 3600)
    dearer = efficiency(10.0, {**run.group("hardware"), "price_per_device_hour": 2 * price}, model, par)
    assert dearer["cost_per_step_usd"] == pytest.approx(2 * figures["cost_per_step_usd"])  # cost is linear in price
    no_price = efficiency(10.0, {**run.group("hardware"), "price_per_device_hour": 0.0, "peak_flops_per_s": {}},
                          model, par)
    assert no_price["cost_per_step_usd"] is None and no_price["mfu_pct"] is None


def test_hardware_flops_count_recomputation_as_megatron_does():
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp8-tp8-dp2"])
    model, hw = run.group("model"), run.group("hardware")
    par = run.group("parallelism")
    b, s, h, v = par["global_batch_size"], model["seq_length"], model["hidden_size"], model["vocab_size"]
    layers = model["num_layers"]
    full = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))  # Korthikanti et al. 2022
    assert hardware_flops_per_step(model, {**par, "recompute": "full"}) == pytest.approx(full, rel=1e-12)
    selective = model_flops_per_step(model, par) + b * s * layers * 4 * s * h  # scores and values once more
    assert hardware_flops_per_step(model, {**par, "recompute": "selective"}) == pytest.approx(selective, rel=1e-12)
    # torchtitan's op-level policy: every second linear, its GPT block's output projection and fc2 (h x h, 4h x h)
    op = model_flops_per_step(model, par) + b * s * layers * 2 * (h * h + 4 * h * h)
    assert hardware_flops_per_step(model, {**par, "recompute": "op"}) == pytest.approx(op, rel=1e-12)
    figures = efficiency(10.0, hw, model, {**par, "recompute": "full"})
    assert figures["hfu_pct"] / figures["mfu_pct"] == pytest.approx(full / model_flops_per_step(model, par))
    world = par["dp"] * par["tp"] * par["pp"]
    assert figures["tokens_per_s_per_gpu"] * world == pytest.approx(figures["tokens_per_s"])
    assert figures["model_tflops_per_s_per_gpu"] == pytest.approx(figures["mfu_pct"] / 100 * 312)


def test_training_totals_for_a_token_budget():
    run = compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp8-tp8-dp2", "train.tokens=3e11"])
    model, hw, par = run.group("model"), run.group("hardware"), run.group("parallelism")
    world, tokens = par["dp"] * par["tp"] * par["pp"], par["global_batch_size"] * model["seq_length"]
    totals = efficiency(10.0, hw, model, par, train_tokens=run.train.tokens)
    steps = -(-300_000_000_000 // tokens)  # the last step is a whole one
    assert totals["training_steps"] == steps
    assert totals["training_days"] == pytest.approx(steps * 10.0 / 86400)
    assert totals["training_gpu_hours"] == pytest.approx(steps * 10.0 * world / 3600)
    assert totals["training_cost_usd"] == pytest.approx(totals["training_gpu_hours"] * hw["price_per_device_hour"])
    assert totals["training_energy_mwh"] == pytest.approx(400 * world * steps * 10.0 / 3.6e9)
    no_power = efficiency(10.0, {**hw, "power_per_device_w": 0.0, "price_per_device_hour": 0.0}, model, par,
                          train_tokens=3e11)
    assert no_power["training_days"] == totals["training_days"]
    assert no_power["training_energy_mwh"] is None and no_power["training_cost_usd"] is None
    assert all(efficiency(10.0, hw, model, par)[k] is None for k in TRAINING_TOTALS)
    with pytest.raises(ConfigError, match="train.tokens=-1.0"):
        compose_run(["train.tokens=-1"], check="layout")


@pytest.mark.slow
def test_a_sweep_with_an_invalid_point_runs_the_rest_and_summarises(tmp_path, workflow_env):
    project = copy_project(tmp_path / "project")
    (project / "grid.yaml").write_text("name: mixed\npoints:\n  - [parallelism=dp2]\n  - [parallelism=pp2]\n"
                                       "  - [parallelism=single, parallelism.tp=3]\n")
    proc = subprocess.run(["snakemake", "--cores", "2", "--config", "sweep_file=grid.yaml",
                           "overrides=hardware=a100-80g-dgx"], cwd=project, env=workflow_env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "invalid sweep point" in proc.stderr and "tp=3 does not divide" in proc.stderr
    summary = project / "artifacts/sweeps/mixed"
    table = pd.read_parquet(summary / "summary.parquet")
    assert list(table["status"]) == [STATUS_OK, STATUS_OK, STATUS_INVALID]
    assert "tp=3 does not divide" in table["reason"].iloc[2]
    assert (table["step_time_s"].iloc[:2] > 0).all() and (table["mfu_pct"].iloc[:2] > 0).all()
    assert (table["cost_per_million_tokens_usd"].iloc[:2] > 0).all()
    assert table["measured_step_s"].isna().all()  # a100: not measured here, and never an error of zero
    assert pd.read_csv(summary / "summary.csv")["status"].tolist() == table["status"].tolist()
    if find_browser() is not None:
        rendered = render_report(summary / "summary.html")
        assert broken_elements(rendered, SECTIONS) == []
        assert {t["id"]: t["rows"] for t in rendered["tables"]}["points-table"] == 3
        # dp2 and pp2 of one model on one hardware: two cells of the layout grid, each at its point's values
        assert {"step-time-heatmap", "memory-heatmap"} <= {img["id"] for img in rendered["images"]}
    from trainsim.report.layout_grid import grid_cells

    cells = grid_cells(table.iloc[:2].assign(layout=table["point"].iloc[:2]))
    assert sorted(cells["dp"]) == [1, 2] and cells["step_time_s"].tolist() == table["step_time_s"].iloc[:2].tolist()


def test_what_if_scales_links_and_kernels():
    from trainsim.comm.model import CommModel

    base = compose_run(["hardware=a100-80g-dgx"])
    fast = compose_run(["hardware=a100-80g-dgx", "hardware.what_if.inter_node_bandwidth_scale=2",
                        "hardware.what_if.latency_scale=0.5"])
    assert fast.keys["hardware"] != base.keys["hardware"]  # a what-if is a hardware of its own
    before, after = CommModel.from_hardware(base.hardware), CommModel.from_hardware(fast.hardware)
    big, small = 1 << 30, 1 << 10
    # 2 nodes, 1 GiB: bound by the network, so about twice as fast; 1 KiB: latency-bound, about half
    assert after.collective_seconds("all_reduce", big, 16, 2) == pytest.approx(
        before.collective_seconds("all_reduce", big, 16, 2) / 2, rel=0.15)
    assert after.collective_seconds("all_reduce", small, 16, 2) < 0.7 * before.collective_seconds(
        "all_reduce", small, 16, 2)
    # inside one node nothing changed but the latency
    assert after.collective_seconds("all_reduce", big, 8, 1) == pytest.approx(
        before.collective_seconds("all_reduce", big, 8, 1), rel=0.02)

    from trainsim.what_if import compute_scale_factors

    flops = compose_run(["hardware=a100-80g-dgx", "hardware.what_if.peak_flops_scale=2"]).hardware
    ops = pd.DataFrame({"op": ["aten::mm", "aten::add"], "flops": [2 * 8192**3, 4096**2],
                        "bytes_moved": [3 * 2 * 8192**2, 3 * 2 * 4096**2], "input_dtypes": ["bf16,bf16", "bf16,bf16"]})
    matmul, add = compute_scale_factors(ops, flops)
    assert matmul == pytest.approx(0.5, rel=0.05) and add == pytest.approx(1.0, rel=0.05)  # roofline decides
    with pytest.raises(ConfigError, match="what_if.latency_scale=0.0 must be positive"):
        compose_run(["hardware.what_if.latency_scale=0"])
    with pytest.raises(ConfigError, match="need hardware.peak_flops_per_s"):
        compose_run(["hardware=local-cpu", "hardware.what_if.peak_flops_scale=2"])


def test_summary_compares_every_point_with_the_first():
    from trainsim.report.sweep import what_if_lines

    table = pd.DataFrame({"point": ["model=m net=1", "model=m net=2", "model=m net=3"],
                          "status": ["ok", "ok", "invalid"], "step_time_s": [2.0, 1.5, None]})
    table.loc[[0, 1], "step_vs_first_pct"] = [0.0, -25.0]
    assert what_if_lines(table) == ["net=2: step -25.0% (1.5 s vs 2 s with net=1)"]


SUMMARY_POINTS = {  # name -> (model, tp, pp, dp, predicted step s)
    "net=1": ("gpt-small", 1, 1, 8, 2.0), "net=2": ("gpt-small", 1, 1, 8, 1.5), "big": ("gpt-1b", 2, 2, 2, 8.0)}


def _summary(monkeypatch, measured: dict[str, float], **extra) -> pd.DataFrame:
    """A what-if sweep (net=1 first, net=2, a bigger model) and an invalid point through the real summary_table,
    with point_row replaced by rows of its shape (no artifacts needed); `measured` gives ground truths and
    `extra` more columns per point name."""
    from trainsim.report import sweep

    def point_row(keys, root):
        model, tp, pp, dp, step = SUMMARY_POINTS[keys["parallelism"]]
        return {**keys, "status": STATUS_OK, "reason": None, "world_size": tp * pp * dp, "num_nodes": 1, "dp": dp,
                "tp": tp, "pp": pp, "step_time_s": step, "measured_step_s": measured.get(keys["parallelism"]),
                "trace_s": 1.0, "compose_s": 0.2, **{k: v[keys["parallelism"]] for k, v in extra.items()}}

    monkeypatch.setattr(sweep, "point_row", point_row)
    points = [{"overrides": [f"model={m}", name], "keys": {"hardware": "a100-80g-dgx", "model": m, "parallelism": name},
               "reason": None} for name, (m, *_) in SUMMARY_POINTS.items()]
    return sweep.summary_table([*points, {"overrides": ["parallelism.tp=3"], "keys": None, "reason": "tp=3"}])


def test_what_if_bars_put_every_point_after_the_first(monkeypatch):
    from trainsim.report.sweep import what_if_figure

    fig = what_if_figure(_summary(monkeypatch, {}))
    assert len(fig.axes) == 1  # no token budget: step time only
    bars = [p.get_width() for p in fig.axes[0].patches]
    assert bars == pytest.approx([2.0, 2.0, 1.5, 8.0])  # before (the first point) twice, then each after
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == [" 1.5 (-25.0 %)", " 8 (+300.0 %)"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["net=2\n(vs net=1)",
                                                                      "model=gpt-1b big\n(vs model=gpt-small net=1)"]
    days = {"net=1": 20.0, "net=2": 15.0, "big": 80.0}
    with_budget = what_if_figure(_summary(monkeypatch, {}, training_days=days,
                                          training_cost_usd={"net=1": 1e6, "net=2": 7.5e5, "big": None}))
    assert [ax.get_xlabel() for ax in with_budget.axes] == ["step time (s)", "training time (days)"]  # cost: not all


def test_summary_page_draws_predicted_against_measured_in_chromium(monkeypatch, tmp_path, chromium):
    from trainsim.report.accuracy_figures import accuracy_points
    from trainsim.report.sweep import render_summary_page

    table = _summary(monkeypatch, {"net=1": 2.1, "big": 7.4})
    points = accuracy_points(table, predicted="step_time_s", measured="measured_step_s", label="point",
                             model="model")
    assert list(points["label"]) == ["model=gpt-small net=1", "model=gpt-1b big"]  # net=2 is not measured
    assert points["error_pct"].tolist() == pytest.approx([100 * (2.0 / 2.1 - 1), 100 * (8.0 / 7.4 - 1)])
    measured_page, unmeasured_page = tmp_path / "measured.html", tmp_path / "unmeasured.html"
    measured_page.write_text(render_summary_page("m", table))
    unmeasured_page.write_text(render_summary_page("u", _summary(monkeypatch, {})))
    accuracy = {"accuracy-scatter-figure", "error-by-model-figure", "error-by-layout-figure"}
    rendered = render_report(measured_page, browser=chromium)
    assert broken_elements(rendered, SECTIONS) == []
    images = {img["id"] for img in rendered["images"]}
    assert accuracy | {"what-if-figure", "cost-figure"} <= images
    assert measured_page.read_text().count("<figcaption") == len(images)  # every figure says where it comes from
    assert "measured: median step time" in measured_page.read_text()
    rendered = render_report(unmeasured_page, browser=chromium)
    assert broken_elements(rendered, SECTIONS) == []
    assert not accuracy & {img["id"] for img in rendered["images"]}  # no empty figure: a sentence says why
    assert "No point has a ground truth" in unmeasured_page.read_text()
