"""Honest uncertainty: do trainsim's intervals contain the measured step time as often as they claim?

The intervals (trainsim/uncertainty/interval.py) are built from each cost model's measured held-out error
(trainsim/uncertainty/component_errors.yaml, written here with --write from the recorded results of
scale_accuracy.py, comm_accuracy.py and e2e_accuracy.py). They are scored on the project's own out-of-sample step
times, benchmarks/results/generalisation_predictions.csv (scale_accuracy.py: leave-one-row-out over the three
published tables, and the pooled leave-one-table-out, leave-one-family-out and leave-one-GPU-out folds), each at
the level a user's run of that kind gets. The error model that gives a row its interval is itself measured without
the row's held-out group (its table; its family or GPU for those folds): nested, so no interval was calibrated on
the rows it is scored on.

Prints
  figure interval_coverage_pct_<50|80|95> <v> %   share of held-out step times inside the interval (targets:
                                                    80 % interval 75-88, 95 % interval >= 90)
  figure interval_coverage_pct_80_<level> <v> %     per level (fitted, unseen_framework, unseen_gpu)
  figure interval_median_width_pct <v> %            median width of the 80 % interval over the prediction, on
                                                    in-range predictions (level fitted; target <= 25)
  figure interval_median_width_pct_<level> <v> %
  figure interval_seconds_overhead_8192gpu <v> s    the interval's extra time for GPT-175B on 8,192 GPUs (target <= 2)
and writes the reliability plot (coverage against nominal level) to docs/img/uncertainty_reliability.svg.

    python benchmarks/uncertainty.py [--write] [--skip-timing]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import yaml
from figures import figure, read_results

from trainsim.uncertainty.interval import COMPONENT_ERRORS, NOMINAL_LEVELS, ComponentError, sample_interval
from trainsim.uncertainty.measured_errors import bias_spread, component_table, scored_folds

REPO = Path(__file__).resolve().parent.parent
PREDICTIONS = REPO / "benchmarks" / "results" / "generalisation_predictions.csv"
RELIABILITY_SVG = REPO / "docs" / "img" / "uncertainty_reliability.svg"
GROUP_OF_FOLD = {"row": "table", "table": "table", "family": "family", "gpu": "gpu"}
"""fold kind -> the group whose rows the nested error model leaves out for that fold's rows"""
TIMING_POINT = ("hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp16-tp8-dp64", "parallelism.recompute=full",
                "parallelism.global_batch_size=1536")


def read_predictions() -> pd.DataFrame:
    if not PREDICTIONS.is_file():
        sys.exit(f"{PREDICTIONS} is missing: run python benchmarks/scale_accuracy.py --skip-timing first")
    return pd.read_csv(PREDICTIONS)


def nested_intervals(folds: pd.DataFrame) -> pd.DataFrame:
    """Each held-out prediction's interval at NOMINAL_LEVELS, from its level's errors without its group."""
    rows = []
    for row in folds.itertuples():
        group = GROUP_OF_FOLD[row.held_out]
        calibration = folds[(folds["level"] == row.level) & (folds[group] != getattr(row, group))]
        if len(calibration) < 3:
            continue  # too few predictions of this level outside the group to measure its error
        bias, spread = bias_spread(calibration["log_error"].to_numpy())
        error = ComponentError("compute", row.level, bias, spread, len(calibration), "nested")
        bounds = sample_interval(row.predicted_s, {("compute", row.level): row.predicted_s}, [error])
        out = {"held_out": row.held_out, "level": row.level, "table": row.table, "label": row.label,
               "measured_s": row.measured_s, "predicted_s": row.predicted_s}
        for level, (low, high) in bounds.items():
            out[f"inside_{level}"] = low <= row.measured_s <= high
            out[f"width_{level}"] = 100 * (high - low) / row.predicted_s
        rows.append(out)
    return pd.DataFrame(rows)


def reliability_svg(coverage: dict[int, float], per_level: dict[str, dict[int, float]]) -> str:
    """Coverage against nominal level, the diagonal where an interval is honest; one line per level."""
    size, pad = 320, 40
    scale = lambda v: pad + (size - 2 * pad) * v / 100  # noqa: E731
    y = lambda v: size - scale(v)  # noqa: E731
    colours = {"all": "#222", "fitted": "#1b7837", "unseen_framework": "#2166ac", "unseen_gpu": "#b2182b"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{size + 150}" height="{size}" font-family="sans-serif" '
             'font-size="11">',
             f'<line x1="{scale(0)}" y1="{y(0)}" x2="{scale(100)}" y2="{y(100)}" stroke="#999" stroke-dasharray="4"/>',
             f'<line x1="{scale(0)}" y1="{y(0)}" x2="{scale(100)}" y2="{y(0)}" stroke="#000"/>',
             f'<line x1="{scale(0)}" y1="{y(0)}" x2="{scale(0)}" y2="{y(100)}" stroke="#000"/>',
             f'<text x="{size / 2 - 30}" y="{size - 8}">nominal level (%)</text>',
             f'<text x="4" y="{pad - 12}">measured inside (%)</text>']
    for tick in (0, 50, 80, 95, 100):
        parts.append(f'<text x="{scale(tick) - 6}" y="{y(0) + 14}">{tick}</text>')
        parts.append(f'<text x="{scale(0) - 24}" y="{y(tick) + 4}">{tick}</text>')
    for i, (name, points) in enumerate({"all": coverage, **per_level}.items()):
        colour = colours.get(name, "#666")
        xy = " ".join(f"{scale(level)},{y(value)}" for level, value in sorted(points.items()))
        width = 2.5 if name == "all" else 1.5
        parts.append(f'<polyline points="{xy}" fill="none" stroke="{colour}" stroke-width="{width}"/>')
        parts += [f'<circle cx="{scale(level)}" cy="{y(value)}" r="3" fill="{colour}"/>'
                  for level, value in points.items()]
        parts.append(f'<text x="{size - 10}" y="{pad + 16 * i}" fill="{colour}">{name}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def time_overhead() -> float:
    """Seconds the interval adds to one composed 8,192-GPU step (the compose itself cached first)."""
    from trainsim import predict
    from trainsim.config import compose_run
    from trainsim.uncertainty import step_interval

    prediction = predict(*TIMING_POINT, build_missing=False)
    run = compose_run(list(TIMING_POINT), check="layout")
    started = time.perf_counter()
    step_interval(prediction.summary, run.hardware.kernel_model.fitted_frameworks, run.framework.name)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help=f"write {COMPONENT_ERRORS.name} from the recorded results")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    predictions = read_predictions()
    table = component_table(predictions, read_figures("comm_accuracy"), read_figures("e2e_accuracy"))
    print("component errors measured (log of measured / predicted):")
    for component, levels in table["components"].items():
        for level, entry in levels.items():
            print(f"  {component:12s} {level:17s} bias {entry['bias']:+.4f} spread {entry['spread']:.4f} "
                  f"n={entry['count']:4d}  {entry['source']}")
    if args.write:
        header = ("# fit: `python benchmarks/uncertainty.py --write` (do not edit by hand; tests/uncertainty checks\n"
                  "# it against the recorded results). bias, spread: mean and standard deviation of log(measured /\n"
                  "# predicted) on predictions the model was not fitted on; count: how many.\n")
        COMPONENT_ERRORS.write_text(header + yaml.safe_dump(table, sort_keys=True, width=120))
        print(f"wrote {COMPONENT_ERRORS}")
    scored = nested_intervals(scored_folds(predictions))
    print(f"\n{len(scored)} held-out step times scored:")
    summary = scored.groupby(["held_out", "level"]).agg(
        rows=("label", "size"), **{f"inside_{n}": (f"inside_{n}", "mean") for n in NOMINAL_LEVELS},
        width_80=("width_80", "median"))
    print(summary.round(3).to_string())
    coverage = {n: 100 * scored[f"inside_{n}"].mean() for n in NOMINAL_LEVELS}
    per_level = {level: {n: 100 * rows[f"inside_{n}"].mean() for n in NOMINAL_LEVELS}
                 for level, rows in scored.groupby("level")}
    for n in NOMINAL_LEVELS:
        figure(f"interval_coverage_pct_{n}", coverage[n], "%", ".1f")
    for level, points in per_level.items():
        figure(f"interval_coverage_pct_80_{level}", points[80], "%", ".1f")
        figure(f"interval_median_width_pct_{level}", scored[scored["level"] == level]["width_80"].median(), "%", ".1f")
    figure("interval_median_width_pct", scored[scored["level"] == "fitted"]["width_80"].median(), "%", ".1f")
    RELIABILITY_SVG.parent.mkdir(parents=True, exist_ok=True)
    RELIABILITY_SVG.write_text(reliability_svg(coverage, per_level))
    print(f"reliability plot {RELIABILITY_SVG}")
    if not args.skip_timing:
        figure("interval_seconds_overhead_8192gpu", time_overhead(), "s", ".3f")


def read_figures(script: str) -> dict[str, float]:
    """A benchmark's recorded numeric figures (benchmarks/results/<script>.json)."""
    return {name: float(entry["value"]) for name, entry in read_results(script).items()
            if isinstance(entry.get("value"), int | float)}


if __name__ == "__main__":
    main()
