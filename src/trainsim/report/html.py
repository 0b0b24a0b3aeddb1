"""Render the collected report data as one self-contained HTML page (inline CSS, figures as data URIs).

Sections carry stable ids (setup, end-to-end, breakdown, communication, slowdown, cost, provenance)
so the browser test and readers' links can find them.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
from pathlib import Path
from typing import Any

import pandas as pd

from trainsim.report import figures
from trainsim.report.figures import figure_html

NOT_MEASURED = "not measured"
SECTIONS = ("setup", "end-to-end", "efficiency", "breakdown", "communication", "slowdown", "cost", "provenance")
MAX_EMBEDDED_TRACE_BYTES = 20 * 2**20
"""A step trace larger than this (gzipped) is linked by path, not embedded: the page must still open."""

CSS = """
body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
img{max-width:100%;display:block;margin:.5em 0}
.missing{color:#a00;font-weight:bold}
code{font-size:.85em}
details{font-size:.8em}
.scroll{overflow-x:auto}
figure{margin:.5em 0 1.2em}figcaption{font-size:.8em;color:#555}
"""


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):  # large numbers in full with thousands separators, as a reader writes them
        return f"{value:,.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1e4:
        return f"{value:,}"
    return str(value)


def table_html(frame: pd.DataFrame, table_id: str) -> str:
    """A plain HTML table (numbers to 4 significant digits, missing as '-')."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                   for row in frame.astype(object).where(frame.notna(), None).itertuples(index=False))
    return (f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{rows}</tbody></table></div>")


def _kv_table(pairs: dict[str, Any], table_id: str) -> str:
    return table_html(pd.DataFrame({"item": list(pairs), "value": [_fmt(v) for v in pairs.values()]}), table_id)


def _made_from(data: dict[str, Any]) -> dict[str, str]:
    """What the composed numbers were made from, for figure captions: the kernel backends and what the kernel
    model was fitted on, the calibration files, the slowdown model's training data."""
    summary = data["summary"]
    inputs = summary.get("inputs", {})
    kernels, cal, slowdown = inputs.get("kernels", {}), inputs.get("calibration", {}), inputs.get("slowdown", {})
    backends = ", ".join(f"{n} {k}" for k, n in summary.get("compute_backends", {}).items()) or "unknown"
    fitted = f" (kernel model: {kernels['kernel_model'].split(':')[0]})" if "kernel_model" in kernels else ""
    sources = cal.get("sources", [])
    collectives = (f"NCCL model calibrated on {', '.join(Path(f).name for f in sources)}" if sources
                   else "collectives from datasheet rates")
    overlap = (f"overlap slowdown trained on {', '.join(Path(f).name for f in slowdown.get('files', []))}"
               if slowdown.get("modelled") else slowdown.get("choice", "no overlap slowdown model"))
    return {"kernels": f"compute kernels {backends}{fitted}", "collectives": collectives, "overlap": overlap}


def _predicted_by(data: dict[str, Any]) -> str:
    return "; ".join(_made_from(data).values())


def inputs_slowdown_choice(summary: dict[str, Any]) -> str | None:
    """The overlap slowdown used and why (provenance's `choice`), else the model's name (older timelines)."""
    return summary.get("inputs", {}).get("slowdown", {}).get("choice") or summary.get("models", {}).get("slowdown")


def setup_section(data: dict[str, Any]) -> str:
    """Hardware, model, layout, software versions and which backend produced each number."""
    summary, config = data["summary"], data["config"]
    par = config.get("parallelism", {})
    hw = config.get("hardware", {})
    setup = {"hardware": data["keys"]["hardware"], "device": hw.get("device_name"), "nodes": hw.get("num_nodes"),
             "devices per node": hw.get("devices_per_node"), "model": data["keys"]["model"],
             "layout": data["keys"]["parallelism"],
             "tp / cp / pp / dp": f"{par.get('tp')} / {par.get('cp', 1)} / {par.get('pp')} / {par.get('dp')}",
             "schedule": summary.get("schedule"), "micro-batches": summary.get("num_microbatches"),
             "precision": par.get("precision"), "code version": data["code_version"]}
    backends = {"compute kernels": ", ".join(f"{k}: {v} ops" for k, v in summary.get("compute_backends", {}).items()),
                "profile backend": data["profile"].get("backend"),
                "communication": summary.get("models", {}).get("comm"),
                "overlap slowdown": inputs_slowdown_choice(summary),
                "measured step time": data["end_to_end"]["measured"] and data["ground_truth_dir"] or NOT_MEASURED}
    inputs = summary.get("inputs", {})
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in inputs.get("warnings", []))
    return ("<h3>Configuration</h3>" + _kv_table(setup, "setup-table")
            + "<h3>Backends that produced each number</h3>" + _kv_table(backends, "backends-table")
            + inputs_used(inputs)
            + (f'<ul id="input-warnings" class="missing">{warnings}</ul>' if warnings else "")
            + "<h3>Software versions</h3>" + _kv_table(data["tool_versions"], "versions-table"))


def inputs_used(inputs: dict[str, Any]) -> str:
    """What the prediction was made from (timeline/provenance.py): calibration files and their held-out
    error, what the kernel model was fitted on, what the slowdown model was trained on."""
    if not inputs:
        return ""
    cal, kernels, slowdown = inputs["calibration"], inputs["kernels"], inputs["slowdown"]
    rows = {"calibration": "; ".join(cal.get("sources", [])) or "none (datasheet rates, NCCL constants)"}
    for name, entry in cal.get("collectives", {}).items():
        rows[f"{name} held-out error (>= 1 MiB / smaller)"] = (f"{entry['heldout_mape_pct_large']} % / "
                                                               f"{entry['heldout_mape_pct_small']} %")
    rows["kernel model"] = kernels.get("kernel_model", "not used (all kernels measured)")
    rows["overlap slowdown"] = slowdown.get("choice", "applied" if slowdown["modelled"] else "none")
    if "artifact" in slowdown:
        trained_on = ", ".join(slowdown["files"]) or slowdown["source"]
        rows["slowdown model"] = (f"trained on {trained_on} ({slowdown['rows']} kernels), CV duration error "
                                  f"{slowdown['cv_duration_mape_pct']} %")
    return "<h3>Inputs of this prediction</h3>" + _kv_table(rows, "inputs-table")


def end_to_end_section(data: dict[str, Any]) -> str:
    e2e = data["end_to_end"]
    row = {"configuration": "/".join(data["keys"][k] for k in ("hardware", "model", "parallelism")),
           "predicted_s": e2e["predicted_s"]}
    if "interval_s" in e2e:
        row["80 % interval (s)"] = "{}-{}".format(*map(_fmt, e2e["interval_s"]["80"]))
        row["95 % interval (s)"] = "{}-{}".format(*map(_fmt, e2e["interval_s"]["95"]))
    if e2e["measured"]:
        row.update({"measured_s": e2e["measured_s"], "spread_s": e2e.get("spread_s"),
                    "predicted / measured": e2e["normalised"], "error_pct": e2e["error_pct"]})
        note = ""
    else:
        row.update({"measured_s": NOT_MEASURED, "predicted / measured": NOT_MEASURED, "error_pct": NOT_MEASURED})
        note = (f'<p class="missing">{NOT_MEASURED} ({html.escape(str(e2e["reason"]))}); ground truth is read from '
                f'<code>{html.escape(str(data["ground_truth_dir"]))}</code>. No error is reported.</p>')
    source = f"measured: {data['ground_truth_dir']}" if e2e["measured"] else "no measurement"
    return (note + table_html(pd.DataFrame([row]), "end-to-end-table") + interval_basis(e2e.get("uncertainty", []))
            + figure_html(figures.end_to_end_figure(e2e), "end-to-end-figure", "predicted vs measured step time",
                          f"predicted by trainsim ({_predicted_by(data)}); {source}"))


EFFICIENCY_ROWS = {"tokens_per_s": "tokens per second", "tokens_per_s_per_gpu": "tokens per second per GPU",
                   "model_tflops_per_s_per_gpu": "model TFLOP/s per GPU", "mfu_pct": "MFU (%)",
                   "hfu_pct": "HFU (%, with recomputation)", "cost_per_step_usd": "USD per step",
                   "cost_per_million_tokens_usd": "USD per million tokens"}
TRAINING_ROWS = {"training_tokens": "tokens", "training_steps": "steps", "training_days": "wall-clock days",
                 "training_gpu_hours": "GPU-hours", "training_cost_usd": "cost (USD)",
                 "training_energy_mwh": "energy (MWh, at the GPUs' maximum power)"}


def interval_basis(parts: list[dict[str, Any]]) -> str:
    """How the interval was built: each part of the critical path, the model's level and its measured error."""
    if not parts:
        return ""
    frame = pd.DataFrame([{"part": p["component"], "level": p["level"].replace("_", " "), "seconds": p["seconds"],
                           "measured bias (%)": p["bias_pct"], "measured spread (%)": p["spread_pct"],
                           "measured on": p["source"]} for p in parts])
    return ("<p>The intervals hold the real step time as often as they say on runs no fit saw (benchmarks/"
            "uncertainty.py): each part of the critical path varies by its model's error measured held out.</p>"
            + table_html(frame, "interval-table"))


def _with_interval(value: Any, interval: tuple[float, float] | None) -> str:
    return _fmt(value) if interval is None else f"{_fmt(value)} (80 %: {_fmt(interval[0])}-{_fmt(interval[1])})"


def efficiency_section(data: dict[str, Any]) -> str:
    """The step in the numbers the field compares (MFU as Megatron counts it), and the whole run."""
    numbers = data.get("efficiency")
    if not numbers:
        return "<p class='missing'>the compose artifact carries no config: no efficiency figures</p>"
    hw = data["config"]["hardware"]
    within = data.get("efficiency_intervals", {})
    step = _kv_table({label: _with_interval(numbers[k], within.get(k)) for k, label in EFFICIENCY_ROWS.items()},
                     "efficiency-table")
    sources = (f"<p>MFU counts model FLOPs (Narayanan et al. 2021), HFU adds recomputation, both against the "
               f"{hw.get('name')} peak; cost at {_fmt(hw.get('price_per_device_hour') or None)} USD per GPU-hour "
               f"and energy at {_fmt(hw.get('power_per_device_w') or None)} W per GPU (hardware config; "
               "'-' = not configured).</p>")
    if numbers["training_tokens"] is None:
        run = ('<p id="training-missing">No token budget: add <code>train.tokens=3e11</code> for the steps, days, '
               "GPU-hours, cost and energy of a whole training run.</p>")
    else:
        run = ("<h3>The whole training run</h3>"
               + _kv_table({label: _with_interval(numbers[k], within.get(k)) for k, label in TRAINING_ROWS.items()},
                           "training-table")
               + "<p>Steady-state steps only: no start-up, checkpoints, evaluation or failures.</p>")
    return step + sources + run


def breakdown_section(data: dict[str, Any]) -> str:
    stages = {int(c["rank_class"]): int(c["pp_rank"]) for c in data["summary"].get("classes", [])
              if "pp_rank" in c}
    return ("<p>Per rank class, in seconds: solo compute, slowdown added by overlap, communication not hidden "
            "behind compute per group, pipeline bubble, idle after the flush; then the optimizer step's part of "
            "them and the communication time added by inter-node transfers sharing a NIC (not added to the rest)."
            "</p>"
            + table_html(data["breakdown"], "breakdown-table")
            + figure_html(figures.breakdown_figure(data["breakdown"]), "breakdown-figure", "step breakdown",
                          f"composed by trainsim: {_predicted_by(data)}")
            + "<h3>One step, per rank class</h3>"
            + figure_html(figures.timeline_figure(data["timeline"], stages), "timeline-figure", "timeline of one step",
                          f"the composed timeline (timeline.parquet of the compose artifact): {_predicted_by(data)}")
            + trace_download(data.get("chrome_trace")))


def trace_download(path: Path | None) -> str:
    """The step's Chrome / Perfetto trace inside the page (gzip, base64), so the page stays one file."""
    if path is None or not Path(path).is_file():
        return "<p class='missing'>no trace.json in the compose artifact</p>"
    packed = gzip.compress(Path(path).read_bytes(), mtime=0)
    if len(packed) > MAX_EMBEDDED_TRACE_BYTES:
        return (f"<p>The step trace ({len(packed) / 2**20:.0f} MiB gzipped) is too large to embed: open "
                f"<code>{html.escape(str(path))}</code> in https://ui.perfetto.dev.</p>")
    return (f'<p><a id="trace-download" download="step-trace.json.gz" '
            f'href="data:application/gzip;base64,{base64.b64encode(packed).decode("ascii")}">Download the step '
            f"trace</a> ({len(packed) / 1024:.0f} KiB, Chrome trace format, gzipped): open it in "
            "https://ui.perfetto.dev or chrome://tracing for every node of every rank class.</p>")


def communication_section(data: dict[str, Any]) -> str:
    if "comm_summary" not in data:
        return "<p class='missing'>no calibration artifact</p>"
    return ("<p>Held-out mean absolute percentage error of the fitted NCCL model and the alpha-beta baseline, "
            "for messages of at least 1 MiB (large) and below (small).</p>"
            + table_html(data["comm_summary"], "comm-table")
            + figure_html(figures.comm_figure(data["comm_by_size"]), "comm-figure", "communication error by size",
                          "held-out points of the calibration's own measurements (its fit.json): "
                          + _made_from(data)["collectives"]))


def slowdown_section(data: dict[str, Any]) -> str:
    if "slowdown" not in data:
        return "<p class='missing'>no slowdown model artifact</p>"
    slow = data["slowdown"]
    choice = data["summary"].get("inputs", {}).get("slowdown", {}).get("choice")
    rows = [{"split": split, "predictor": who, **values}
            for split, block in slow["metrics"].items() for who, values in block.items()]
    holdout = slow["metrics"].get("holdout") or next(iter(slow["metrics"].values()))
    return ((f"<p id='slowdown-choice'>{html.escape(choice)}</p>" if choice else "")
            + table_html(pd.DataFrame(rows), "slowdown-table")
            + figure_html(figures.slowdown_accuracy_figure(holdout), "slowdown-figure", "slowdown accuracy",
                          "hold-out kernels of the slowdown model's data (its metrics.json): "
                          + _made_from(data)["overlap"])
            + "<h3>Feature importances</h3>" + table_html(slow["importances"].head(12), "importance-table")
            + figure_html(figures.importance_figure(slow["importances"]), "importance-figure", "feature importances",
                          "XGBoost gain of the slowdown model (its metrics.json)"))


def cost_section(data: dict[str, Any]) -> str:
    cost = data["cost"]
    frame = pd.DataFrame([{"GPUs": cost["world_size"], "trace_s": cost["trace_s"], "compose_s": cost["compose_s"],
                           "compose_stage_s": cost["compose_stage_s"]}])
    return table_html(frame, "cost-table") + figure_html(
        figures.cost_figure(cost), "cost-figure", "simulation cost",
        "wall time in this point's trace manifest and compose summary.json")


def provenance_section(data: dict[str, Any]) -> str:
    frame = pd.DataFrame([{**{k: v for k, v in p.items() if k != "files"}, "config_hash": p["config_hash"][:16]}
                          for p in data["provenance"]])
    details = "".join(
        f"<details><summary>{html.escape(p['stage'])}: {len(p['files'])} file(s)</summary><pre>"
        + html.escape(json.dumps(p["files"], indent=1)) + "</pre></details>" for p in data["provenance"])
    return table_html(frame, "provenance-table") + details


def render_page(data: dict[str, Any]) -> str:
    """The whole page; one section per SECTIONS entry, in that order."""
    builders = {"setup": setup_section, "end-to-end": end_to_end_section, "efficiency": efficiency_section,
                "breakdown": breakdown_section,
                "communication": communication_section, "slowdown": slowdown_section, "cost": cost_section,
                "provenance": provenance_section}
    titles = {"setup": "Setup", "end-to-end": "End-to-end step time",
              "efficiency": "Throughput, utilisation and the training run", "breakdown": "Step breakdown",
              "communication": "Communication model", "slowdown": "Slowdown model",
              "cost": "Simulation cost", "provenance": "Provenance"}
    title = "trainsim report: " + " / ".join(data["keys"][k] for k in ("hardware", "model", "parallelism"))
    return html_page(title, [(name, titles[name], builders[name](data)) for name in SECTIONS])


def html_page(title: str, sections: list[tuple[str, str, str]]) -> str:
    """A self-contained page: (element id, heading, body HTML) per section, in order."""
    body = "".join(f'<section id="{sid}"><h2>{heading}</h2>{content}</section>' for sid, heading, content in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")
