"""Write the report artifact: report.html, metrics.json and plots/*.csv, published atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from trainsim.artifacts import atomic_artifact
from trainsim.config.schema import FrameworkConfig, TrainConfig
from trainsim.report.collect import collect
from trainsim.report.html import render_page
from trainsim.report.metrics import metrics, write_plots

HTML_FILE = "report.html"
METRICS_FILE = "metrics.json"
UPSTREAM = ("trace", "profile", "calibration", "slowdown_model", "compose")


def write_report_artifact(keys: dict[str, str], inputs: dict[str, Path], output: Path,
                          truth_dir: Path, train: TrainConfig | None = None,
                          framework: FrameworkConfig | None = None) -> dict[str, Any]:
    """Build the page and metrics from the input artifacts; ground truth is optional (shown as not measured),
    and so is the token budget of the training totals. `framework`: the software stack the step was composed
    for (default: conf/config.yaml's)."""
    train = train or TrainConfig()
    framework = framework or FrameworkConfig()
    upstream = {name: inputs[name] for name in UPSTREAM if name in inputs}
    data = collect(upstream, keys, truth_dir, train_tokens=train.tokens, framework=framework.name)
    result = metrics(data)
    deps = list(upstream.values())
    if (Path(truth_dir) / "manifest.json").is_file():
        deps.append(Path(truth_dir))
    config = {"keys": keys, "train": dataclasses.asdict(train), "framework": framework.name}
    with atomic_artifact(output, stage="report", config=config, config_keys=keys, inputs=deps) as tmp:
        (tmp / HTML_FILE).write_text(render_page(data))
        (tmp / METRICS_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        write_plots(data, tmp)
    return result
