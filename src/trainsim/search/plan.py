"""`trainsim plan`: how many days and dollars to train a model on N GPUs, with which layout, and where the
time goes, in one command and one page.

A plan is a layout search (every layout on the budget, estimated), the chosen layout (the fastest that fits,
or the cheapest) composed in full by the timeline engine with every missing input built first, and one
self-contained page: the answer (layout, step, MFU, days, GPU-hours, dollars, energy), the step's picture
and breakdown, the memory per rank class, and the alternatives the search saw.
"""

from __future__ import annotations

import dataclasses
import html
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from trainsim.api import Prediction, predict
from trainsim.artifacts import atomic_artifact
from trainsim.config.compose import Run, compose_run
from trainsim.errors import ConfigError
from trainsim.report.collect import breakdown
from trainsim.report.efficiency import token_count
from trainsim.report.html import breakdown_section, efficiency_section, html_page, inputs_used, table_html
from trainsim.search.layouts import SearchSpace
from trainsim.search.output import chosen_layouts, search_sections
from trainsim.search.run import STATUS_OK, SearchResult, cost_column, point_overrides, search_layouts
from trainsim.uncertainty.interval import component_errors, compute_level, probability_best, upper_ratio

CHOICES = {"time": "fastest", "cost": "cheapest"}
SECTIONS = ("answer", "time", "memory", "alternatives", "inputs")
ANSWER_FILE, PAGE_FILE = "plan.json", "plan.html"
RANKING = ("ranking", "same_table")
"""The measured spread between two runs of one GPU and framework (uncertainty/component_errors.yaml)."""


@dataclass
class Plan:
    run: Run
    """The config the search started from (model, hardware, batch, precision, train.tokens)."""
    budget: int
    by: str
    """'time' (the fastest layout that fits) or 'cost' (the cheapest per token)."""
    search: SearchResult
    chosen: pd.Series
    """The search's row of the chosen layout."""
    overrides: list[str]
    """The chosen layout as Hydra overrides: `trainsim compose <these>` reproduces the prediction."""
    chosen_run: Run
    """The chosen layout's config."""
    prediction: Prediction
    """The chosen layout composed in full (the answer's numbers come from here, not from the estimate)."""
    within_days: float = 0.0
    """The deadline the choice was held to (0: none)."""
    confidence: float = 0.0
    """The chance of meeting the deadline the choice asked for (0: the estimate alone meets it)."""

    def probability_best(self) -> float:
        """The chance that the chosen layout is really the fastest (or cheapest) of the layouts it was chosen
        from, their estimates moving apart by the measured spread between runs of one GPU and framework."""
        candidates = eligible(self.search.table, self.within_days, self.days_factor())
        column = "step_time_s" if self.by == "time" else cost_column(self.search.table)
        others = candidates[candidates["layout"] != self.chosen["layout"]][column]
        return probability_best(float(self.chosen[column]), [float(v) for v in others],
                                component_errors()[RANKING].spread)

    def probability_within_deadline(self) -> float | None:
        """The chance that the composed step is fast enough to train within the deadline (None without one)."""
        if not self.within_days:
            return None
        steps = self.prediction.efficiency["training_steps"]
        return self.prediction.interval.probability_at_most(self.within_days * 86400 / steps)

    def days_factor(self) -> float:
        """What the choice multiplies a layout's estimated days by to meet the deadline with `confidence`: the
        one-sided quantile of the measured error of this GPU and framework's compute (1 without a confidence)."""
        if not self.confidence:
            return 1.0
        return deadline_factor(self.run, self.confidence)


def deadline_factor(run: Run, confidence: float) -> float:
    """The factor over an estimated step time under which the real one stays with `confidence`, from the
    measured error of the run's compute level (a fitted framework, another one, another GPU)."""
    level = compute_level(run.hardware.kernel_model.fitted_frameworks, run.framework.name, {"analytical": 1}, True)
    return upper_ratio(component_errors()[("compute", level)], confidence)


def eligible(table: pd.DataFrame, within_days: float, days_factor: float = 1.0) -> pd.DataFrame:
    """The searched layouts that fit, and meet the deadline (their estimated days times `days_factor`)."""
    fits = table[table["status"] == STATUS_OK]
    return fits[fits["training_days"] * days_factor <= within_days] if within_days else fits


def make_plan(run: Run, budget: int, space: SearchSpace, *, by: str = "time", within_days: float = 0.0,
              confidence: float = 0.0, jobs: int = 1, calibration_dir: Path | None = None) -> Plan:
    """Search the layouts of `run` on `budget` GPUs (and its halvings), choose one by `by` among those that
    train `train.tokens` within `within_days` (0: no deadline; with `confidence` in (0, 1): with that chance,
    by the measured error of the run's compute), compose it in full.

    `by='cost', within_days=D` answers "how many GPUs, and which layout, to train this in D days at the least
    cost": a smaller world that meets the deadline costs fewer GPU-hours when it runs as efficiently."""
    if by not in CHOICES:
        raise ConfigError(f"plan --by {by!r}: accepted 'time' (the fastest layout) or 'cost' (the cheapest)")
    if within_days and not run.train.tokens:
        raise ConfigError(f"plan --within-days {within_days:g} needs the run's token budget: add train.tokens=... "
                          "(e.g. train.tokens=3e11)")
    result = search_layouts(run, budget, space, jobs=jobs, calibration_dir=calibration_dir)
    if not (result.table["status"] == STATUS_OK).any():
        tries = [f"more GPUs than --gpus {budget}"]
        tries += ["--recompute full"] * ("full" not in space.recompute)
        tries += ["--zero-stages 0 1 3"] * (not {1, 3} <= set(space.zero_stages))
        tries += ["--micro-batch-sizes 1"] * (1 not in space.micro_batch_sizes)
        raise ConfigError(f"none of the {len(result.table)} layouts of {run.model.name} fits in memory on {budget} x "
                          f"{run.hardware.name} (least peak {result.table['peak_memory_gib'].min():.0f} GiB per GPU); "
                          f"try {', '.join(tries)}")
    if confidence and not (0 < confidence < 1 and within_days):
        raise ConfigError(f"plan --confidence {confidence:g}: accepted a chance between 0 and 1, with --within-days")
    row = choose(result.table, by, within_days, deadline_factor(run, confidence) if confidence else 1.0)
    # the full compose needs no node count (it spans the ranks the layout has); keeping the configured one
    # keeps the hardware's artifact key, so its calibration and slowdown model are reused, not rebuilt
    overrides = [o for o in point_overrides(row, run, budget) if not o.startswith("hardware.num_nodes=")]
    return Plan(run=run, budget=budget, by=by, search=result, chosen=row, overrides=overrides,
                chosen_run=compose_run(overrides, check="layout"), prediction=predict(*overrides),
                within_days=within_days, confidence=confidence)


def choose(table: pd.DataFrame, by: str, within_days: float = 0.0, days_factor: float = 1.0) -> pd.Series:
    """The searched layout a plan takes: the fastest or the cheapest that fits, among those whose
    training_days (times `days_factor`, for a confidence of meeting it) meet the deadline when there is one."""
    fits = table[table["status"] == STATUS_OK]
    meets = eligible(table, within_days, days_factor)
    if meets.empty:
        fastest = fits.loc[fits["step_time_s"].idxmin()]
        margin = f" (x{days_factor:.2f} for the confidence asked)" if days_factor != 1 else ""
        raise ConfigError(f"no layout on up to {fits['world_size'].max()} GPUs trains within {within_days:g} days"
                          f"{margin}: the fastest, {fastest['layout']}, takes {fastest['training_days']:.1f} days; "
                          "raise --gpus or --within-days")
    return chosen_layouts(meets)[CHOICES[by]]


def page_data(plan: Plan) -> dict:
    """What the report page's sections read (report/html.py), from the composed prediction."""
    p = plan.prediction
    config = {group: plan.chosen_run.group(group) for group in ("hardware", "model", "parallelism")}
    return {"summary": p.summary, "config": config, "efficiency": p.efficiency, "breakdown": breakdown(p.summary),
            "timeline": pd.read_parquet(p.artifact_dir / "timeline.parquet"),
            "chrome_trace": p.artifact_dir / "trace.json"}


def answer(plan: Plan) -> dict:
    """The plan's numbers (plan.json): the chosen layout, its composed step and the whole run."""
    p, row = plan.prediction, plan.chosen
    return {"model": plan.run.model.name, "hardware": plan.run.hardware.name, "budget_gpus": plan.budget,
            "chosen_by": plan.by, "within_days": plan.within_days or None, "layout": row["layout"],
            "world_size": int(row["world_size"]),
            "overrides": plan.overrides, "step_time_s": p.step_time_s,
            "step_time_interval_s": p.interval.as_dict()["intervals_s"], "intervals_80": p.intervals,
            "estimated_step_time_s": float(row["step_time_s"]), "oom": p.oom, **p.efficiency,
            "probability_best": plan.probability_best(), "confidence": plan.confidence or None,
            "probability_within_deadline": plan.probability_within_deadline(), "warnings": p.warnings}


def odds_line(a: dict, by: str) -> str:
    """How sure the answer is: the chance the layout is really the fastest (cheapest) of those it was chosen
    from, and of meeting the deadline."""
    text = f"{100 * a['probability_best']:.0f} % chance it is really the {CHOICES[by]} of the layouts that qualify"
    if a["probability_within_deadline"] is not None:
        text += (f"; {100 * a['probability_within_deadline']:.0f} % chance it trains within {a['within_days']:g} days"
                 + (f" (asked: {100 * a['confidence']:.0f} %)" if a["confidence"] else ""))
    return text + " (by the errors measured on runs no fit saw: benchmarks/uncertainty.py)"


def answer_html(plan: Plan, data: dict) -> str:
    a = answer(plan)
    lead = (f"<p id='answer-line'><b>{html.escape(a['layout'])}</b> on {a['world_size']:,} of {plan.budget:,} "
            f"{html.escape(a['hardware'])} GPUs ({CHOICES[plan.by]} layout that fits"
            + (f" and trains within {plan.within_days:g} days" if plan.within_days else "") + "): "
            f"{plan.prediction.interval.describe()} per step")
    within = a["intervals_80"]
    if a["training_days"] is not None:
        lead += f", {a['training_days']:,.1f} days"
        if "training_days" in within:
            lead += " (80 %: {:,.1f}-{:,.1f})".format(*within["training_days"])
        if a["training_cost_usd"] is not None:
            lead += f" and {a['training_cost_usd']:,.0f} USD"
            if "training_cost_usd" in within:
                lead += " (80 %: {:,.0f}-{:,.0f})".format(*within["training_cost_usd"])
        lead += f" for {token_count(a['training_tokens'])} tokens"
    lead += ".</p>" + f"<p id='answer-odds'>{html.escape(odds_line(a, plan.by))}</p>"
    if a["oom"]:
        lead += "<p class='missing'>The full trace of this layout needs more memory than the GPU has (the search's " \
                "estimate said it fits): see the memory section.</p>"
    reproduce = f"<p>Reproduce the step: <code>trainsim compose {html.escape(' '.join(plan.overrides))}</code>; " \
                f"the search estimated {a['estimated_step_time_s']:.4g} s, the full composition gives " \
                f"{a['step_time_s']:.4g} s.</p>"
    return lead + efficiency_section(data) + reproduce


def memory_html(plan: Plan) -> str:
    gib = plan.prediction.memory.copy()
    for column in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "peak_activation_bytes",
                   "peak_bytes", "capacity_bytes"):
        gib[column.replace("_bytes", "_gib")] = gib.pop(column) / 2**30
    return "<p>Per rank class of the full trace, in GiB.</p>" + table_html(gib, "memory-table")


def render_plan_page(plan: Plan) -> str:
    data = page_data(plan)
    alternatives = "".join(f"<h3>{title}</h3>{body}" for sid, title, body in
                           search_sections(plan.run, plan.budget, plan.search) if sid in ("grid", "pareto", "best"))
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in plan.prediction.warnings)
    sections = {
        "answer": answer_html(plan, data),
        "time": breakdown_section(data),
        "memory": memory_html(plan),
        "alternatives": alternatives,
        "inputs": inputs_used(plan.prediction.inputs)
                  + (f'<ul id="input-warnings" class="missing">{warnings}</ul>' if warnings else ""),
    }
    titles = {"answer": "The answer", "time": "Where the time goes", "memory": "Memory per GPU",
              "alternatives": "The layouts it was chosen from", "inputs": "What the prediction used"}
    tokens = f", {token_count(plan.run.train.tokens)} tokens" if plan.run.train.tokens else ""
    return html_page(f"trainsim plan: {plan.run.model.name} on {plan.budget} x {plan.run.hardware.name}{tokens}",
                     [(k, titles[k], sections[k]) for k in SECTIONS])


def plan_dir(run: Run, budget: int) -> Path:
    return Path("artifacts/plans") / run.keys["hardware"] / run.keys["model"] / f"{budget}gpu"


def write_plan_artifact(plan: Plan, output: Path) -> None:
    """plan.html, plan.json and the searched layouts (layouts.csv), published atomically."""
    config = {"hardware": plan.run.group("hardware"), "model": plan.run.group("model"),
              "parallelism": plan.run.group("parallelism"), "train": dataclasses.asdict(plan.run.train),
              "budget": plan.budget, "by": plan.by}
    with atomic_artifact(output, stage="plan", config=config,
                         config_keys={**plan.run.keys, "budget": str(plan.budget)}) as tmp:
        (tmp / PAGE_FILE).write_text(render_plan_page(plan))
        (tmp / ANSWER_FILE).write_text(json.dumps(answer(plan), indent=2, default=str) + "\n")
        plan.search.table.to_csv(tmp / "layouts.csv", index=False)
