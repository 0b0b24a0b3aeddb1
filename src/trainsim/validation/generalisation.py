"""Predict whole tables, model families and GPUs that no fit has seen (issue 49's headline figures).

Leave-one-row-out within a table (validation/published.py) fits each row's neighbours: same software, same GPU,
often the same model. What a user needs to know is how well trainsim predicts a run unlike the ones it was fitted
on. Here every row of every step-time table in data/published enters one pool (the three tables of
validation/published.py, and the NeMo 25.x, Megatron-Bridge and torchtitan tables as validation/recipes.py writes
them, composed as a user would, each with its framework), and the per-GPU kernel efficiencies
(kernel_fit.FITTED_PER_GPU) are fitted without the rows held out:

* leave-one-table-out: a table is predicted by the fit to its GPU's other tables; where its GPU has no other
  table, with what the GPU's hardware config carries, as a user's run is: the fit of the same silicon's fitted
  GPU (kernel_fit.CARRIED_TO; the H100 SXM's for the Grand Teton H100 and the H200) to that GPU's other tables,
  else the GPU's data-free start (kernel_fit.data_free_params: measured matmul ceilings, datasheet bandwidth);
* leave-one-family-out: a model family (Llama, GPT, Nemotron, DeepSeek, Mixtral, Kimi) predicted by the fit to
  every other family's rows of the same GPU;
* leave-one-GPU-out: a GPU's rows predicted with what transfers from the other GPUs: each efficiency as the
  ratio of fitted to data-free value, the geometric mean over the other GPUs' fits weighted by how much each
  GPU's rows say about it (transferred_ratios), applied to this GPU's data-free start (its own matmul ceiling
  and datasheet).

Rows are keyed to a GPU by hardware.device_name, so the tables of one GPU pool across hardware configs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainsim.validation.kernel_fit import (
    CARRIED_TO,
    FITTED_PER_GPU,
    FitRow,
    StepTimes,
    data_free_params,
    fit_gauss_newton,
)

FAMILIES = (("deepseek", "DeepSeek"), ("kimi", "Kimi"), ("mixtral", "Mixtral"), ("qwen", "Qwen"),
            ("gpt-oss", "GPT-OSS"), ("nemotron", "Nemotron"), ("llama", "Llama"), ("gpt", "GPT"))
"""Prefix of a model's name (conf/model option or a published table's model column, lower-cased) -> family;
the first match wins."""


def family_of(model: str) -> str:
    """The model family of a model name ('llama3-70b', 'LLAMA2-13B', 'GPT3-175B', 'mcore2024_h100-1.7B')."""
    name = model.lower()
    for prefix, family in FAMILIES:
        if name.startswith(prefix) or f"-{prefix}" in name or f"_{prefix}" in name:
            return family
    return "GPT"  # the GPT-style weak-scaling tables name their models by size only ("1.7B", "1T")


@dataclass
class PooledRows:
    """Every runnable row of the tables pooled: per row its table, family, GPU and measured step time, and the
    traced FitRow the fits compose."""

    rows: pd.DataFrame
    """table, label, model, hardware, framework, family, gpu, measured_s (one per fit_rows entry, same order)"""
    fit_rows: list[FitRow]
    skipped: pd.DataFrame = field(default_factory=pd.DataFrame)
    """table, label, reason: rows no config expresses (not in the figures)"""
    times: dict[str, StepTimes] = field(default_factory=dict)
    """gpu -> its rows' StepTimes (built on first use)"""
    fits: dict[str, dict[str, float]] = field(default_factory=dict)
    """gpu -> the fit to all its rows (built on first use)"""

    def gpu_indices(self, gpu: str) -> np.ndarray:
        return np.flatnonzero(self.rows["gpu"].to_numpy() == gpu)

    def step_times(self, gpu: str) -> tuple[StepTimes, np.ndarray]:
        """The GPU's StepTimes (its rows in pool order, from the GPU's data-free start) and their pool indices."""
        indices = self.gpu_indices(gpu)
        if gpu not in self.times:
            rows = [self.fit_rows[i] for i in indices]
            self.times[gpu] = StepTimes(rows, data_free_params(rows[0].hw))
        return self.times[gpu], indices

    def fit_all(self, gpu: str) -> dict[str, float]:
        """The fit to every row of `gpu`, once: leave-one-GPU-out carries it to each of the other GPUs."""
        if gpu not in self.fits:
            times, indices = self.step_times(gpu)
            measured = self.rows["measured_s"].to_numpy(dtype=float)[indices]
            self.fits[gpu] = fit_gauss_newton(times, range(len(indices)), measured).params
        return self.fits[gpu]


def predict_held_out(pool: PooledRows, held_out: Callable[[pd.DataFrame], np.ndarray]) -> pd.DataFrame:
    """Every row of the pool predicted by a fit that excludes the rows `held_out` marks in its own fold: rows are
    grouped into folds by the held-out mask's key (held_out returns one fold label per row); per GPU and fold, the
    GPU's rows outside the fold are fitted from the data-free start, and the fold's rows are composed with that
    fit. Where the GPU has no other row, its fold is composed with what its hardware config carries: the fit of
    the GPU it carries (kernel_fit.CARRIED_TO) to that GPU's rows outside the fold, else its data-free start."""
    folds = held_out(pool.rows)
    measured = pool.rows["measured_s"].to_numpy(dtype=float)
    predicted = np.full(len(pool.rows), np.nan)
    fitted = [None] * len(pool.rows)
    fits: dict[tuple, dict[str, float]] = {}

    def fit_outside(gpu: str, fold) -> dict[str, float] | None:
        """The fit to `gpu`'s rows outside `fold` (None where it has none), once per (gpu, fold)."""
        if (gpu, fold) not in fits:
            times, indices = pool.step_times(gpu)
            train = np.flatnonzero(folds[indices] != fold)
            fits[gpu, fold] = fit_gauss_newton(times, train, measured[indices]).params if len(train) else None
        return fits[gpu, fold]

    for gpu in pool.rows["gpu"].unique():
        times, indices = pool.step_times(gpu)
        for fold in pd.unique(folds[indices]):
            params, source = fit_outside(gpu, fold), "fit"
            if params is None:
                carried = carried_gpu(pool, gpu)
                params = fit_outside(carried, fold) if carried else None
                params, source = (params, f"carried from {carried}") if params else (times.start, "start")
            local = np.flatnonzero(folds[indices] == fold)
            predicted[indices[local]] = times.seconds_of(local, params)
            for i in indices[local]:
                fitted[i] = source
    out = pool.rows.assign(predicted_s=predicted, params_from=fitted)
    out["error_pct"] = 100 * (out["predicted_s"] / out["measured_s"] - 1)
    return out


def carried_gpu(pool: PooledRows, gpu: str) -> str | None:
    """The pooled GPU whose fit `gpu`'s hardware configs carry (kernel_fit.CARRIED_TO: the same silicon), or None."""
    hardware = set(pool.rows.loc[pool.rows["gpu"] == gpu, "hardware"])
    for fitted, carriers in CARRIED_TO.items():
        source = pool.rows.loc[pool.rows["hardware"] == fitted, "gpu"]
        if hardware & set(carriers) and len(source) and source.iloc[0] != gpu:
            return source.iloc[0]
    return None


def leave_one_table_out(pool: PooledRows) -> pd.DataFrame:
    return predict_held_out(pool, lambda rows: rows["table"].to_numpy())


def leave_one_family_out(pool: PooledRows) -> pd.DataFrame:
    return predict_held_out(pool, lambda rows: rows["family"].to_numpy())


def transferred_ratios(pool: PooledRows, gpus: Sequence[str]) -> dict[str, float]:
    """Per FITTED_PER_GPU parameter, the mean over `gpus` of log(fit to all the GPU's rows / its data-free start),
    each GPU weighted by how much its rows say about the parameter: what a GPU's software reaches of its measured
    ceilings, carried to another GPU. The weight is the information of the GPU's fit, the sum over its rows of the
    squared relative slope (d log step / d log 1/efficiency, at the start): a GPU whose rows barely use a
    parameter (bf16 GEMMs in the FP8 recipes of Blackwell tables) leaves it loosely fitted, and an unweighted mean
    carried that looseness to every other GPU."""
    logs: dict[str, list[tuple[float, float]]] = {name: [] for name in FITTED_PER_GPU}
    for gpu in gpus:
        times, fit = pool.step_times(gpu)[0], pool.fit_all(gpu)
        rows = range(len(times.rows))
        relative = times.slopes_of(rows) / times.seconds_of(rows, times.start)[:, None]
        information = (relative ** 2).sum(axis=0)
        for name, weight in zip(FITTED_PER_GPU, information):
            if weight > 0:  # a parameter no row of that GPU depends on stays at its start and says nothing
                logs[name].append((weight, math.log(fit[name] / times.start[name])))
    return {name: math.exp(sum(w * v for w, v in pairs) / sum(w for w, _ in pairs)) if pairs else 1.0
            for name, pairs in logs.items()}


def leave_one_gpu_out(pool: PooledRows) -> pd.DataFrame:
    """Each GPU's rows composed at its data-free start times the ratios the other GPUs' fits reach."""
    gpus = list(pool.rows["gpu"].unique())
    frames = []
    for gpu in gpus:
        ratios = transferred_ratios(pool, [g for g in gpus if g != gpu])
        times, indices = pool.step_times(gpu)
        params = {name: times.start[name] * ratios[name] for name in FITTED_PER_GPU}
        predicted = times.seconds_of(range(len(indices)), params)
        frames.append(pool.rows.iloc[indices].assign(predicted_s=predicted, params_from="other GPUs"))
    out = pd.concat(frames).sort_index()
    out["error_pct"] = 100 * (out["predicted_s"] / out["measured_s"] - 1)
    return out


def table_errors(predicted: pd.DataFrame, by: str = "table") -> pd.DataFrame:
    """Per group: rows, mean |error|, signed mean error."""
    grouped = predicted.groupby(by)["error_pct"]
    return pd.DataFrame({"rows": grouped.size(), "mape_pct": grouped.apply(lambda e: e.abs().mean()),
                         "bias_pct": grouped.mean()})


POOLED_RECIPE_TABLES = ("megatron-bridge_25.09_pretrain.csv", "megatron-bridge_26.02_pretrain.csv",
                        "megatron-bridge_26.04_pretrain.csv", "nemo_25.02_pretrain_partial.csv",
                        "nemo_25.04_pretrain_partial.csv", "nemo_25.07_pretrain_partial.csv",
                        "torchtitan_llama_perf.csv")
"""validation/recipes.py's tables in the pool (NeMo 24.07's is there as published.py's nemo2407_h100_fp8)."""


def base_run(hardware: str):
    """The run whose NCCL calibration and overlap slowdown compose a hardware option's rows (its option alone,
    as published.table_run: pipeline.build_point builds both)."""
    from trainsim.config import compose_run

    return compose_run([f"hardware={hardware}", "model=gpt-small", "parallelism=single"])


def recipe_fit_rows(table: str, workers: int = 2) -> tuple[pd.DataFrame, list[FitRow], pd.DataFrame]:
    """A recipe table's rows that compose, traced, as FitRows (each with the hardware and layout its overrides
    compose, framework included), and the refused rows with their reasons."""
    from trainsim.validation.fitting import calibrated_comm, pipeline_slowdown
    from trainsim.validation.published import RowRun, trace_rows
    from trainsim.validation.recipes import compose_recipe, read_recipes

    kept, skipped, runs = [], [], []
    for recipe in read_recipes(table):
        composed = compose_recipe(recipe)
        if composed.refusal or recipe.measured_s is None:
            skipped.append({"table": table, "label": recipe.label,
                            "reason": composed.refusal or "no step time in the table"})
            continue
        kept.append(composed)
        runs.append(RowRun(composed.run.model, composed.run.parallelism, None))
    runs = trace_rows(runs, workers)
    fit_rows, frames, bases = [], [], {}
    for composed, traced_run in zip(kept, runs):
        hardware = composed.run.choices["hardware"]
        if hardware not in bases:
            run = base_run(hardware)
            bases[hardware] = (calibrated_comm(run), pipeline_slowdown(run))
        comm, slowdown = bases[hardware]
        fit_rows.append(FitRow(traced_run.directory, composed.run.parallelism, composed.run.hardware, comm, slowdown))
        frames.append({"label": composed.recipe.label, "model": composed.run.model.name,
                       "hardware": hardware, "framework": composed.run.framework.name,
                       "measured_s": composed.recipe.measured_s})
    return pd.DataFrame(frames), fit_rows, pd.DataFrame(skipped)


def pool_rows(published: Sequence[str], recipes: Sequence[str] = POOLED_RECIPE_TABLES, workers: int = 2
              ) -> PooledRows:
    """The pool of every runnable row of the published tables `published` (validation/published.py) and the
    recipe tables `recipes` (validation/recipes.py)."""
    from trainsim.validation.published import TABLES, table_fit_rows

    frames, fit_rows, skipped = [], [], []
    for name in published:
        rows, table_rows, table_skipped = table_fit_rows(name, workers)
        frames.append(pd.DataFrame({"table": name, "label": rows["model"].astype(str) + " " + rows["gpus"].astype(str)
                                    + " GPUs", "model": rows["model"].astype(str), "hardware": TABLES[name].hardware,
                                    "framework": TABLES[name].framework, "measured_s": rows["measured_s"]}))
        fit_rows += table_rows
        skipped += [{"table": name, "label": f"{r.model} {r.gpus} GPUs", "reason": r.skip_reason}
                    for r in table_skipped.itertuples()]
    for name in recipes:
        rows, table_rows, table_skipped = recipe_fit_rows(name, workers)
        if len(rows):
            frames.append(rows.assign(table=name))
        fit_rows += table_rows
        skipped += table_skipped.to_dict("records")
    rows = pd.concat(frames, ignore_index=True)
    rows["family"] = [family_of(m) for m in rows["model"]]
    rows["gpu"] = [r.hw.device_name for r in fit_rows]
    return PooledRows(rows, fit_rows, pd.DataFrame(skipped, columns=["table", "label", "reason"]))
