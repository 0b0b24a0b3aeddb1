"""Accuracy at scale: published multi-node Megatron runs, each predicted by a model fitted without it.

Tables (data/published; trainsim/validation/published.py states how each row becomes a run, the FLOP
formula that turns its TFLOP/s into seconds per step, and every setting assumed where the source is silent):
  megatron2021_a100   Megatron-LM on Selene, GPT 1.7B-1T, 32-3,072 A100 (hardware a100-80g-selene)
  mcore2024_h100      Megatron-Core r0.8, GPT 1.7B-462B, 48-6,144 H100 (hardware h100-sxm-dgx)
  nemo2407_h100_fp8   NeMo 24.07 FP8 pre-training, GPT-3 / Llama 2 / Nemotron 5B-340B, 8-512 H100 with TP, PP,
                      virtual stages (hardware h100-sxm-dgx); step time from the csv (derived_step_time_s).
                      Rows with context parallelism (cp > 1) cannot be expressed yet: printed with the reason
                      and counted (figure scale_skipped_rows_<table>), not in the figures' mean
Leave-one-row-out, pooled per GPU: for each row, the kernel model's matmul_efficiency, fp8_matmul_efficiency
(bounded by the best measured bf16 / FP8 matmul throughput of that GPU, data/kernels) and memory_efficiency are
fitted to every other row of the tables run on the same hardware, then the row is composed with that fit. No
fit sees the row, its linearisation point included: every fit starts from a data-free point (the measured
matmul ceilings, memory 1.0) and moves only by fits on the fold's own rows (trainsim/validation/kernel_fit.py;
a parameter no other row depends on stays at that start). Everything else is physics, datasheet, NCCL
calibration and kernel benchmarks (flash attention), the same for every row. The model's structure was chosen
watching these tables (STRUCTURAL_CHOICES, printed): leave-one-table-out on H100 (fit on one table, predict the
other) measures what that is worth on a table it was not tuned on.

Prints per row and
  figure scale_mape_pct_<table> <v> %       mean |error| over the table's rows that run (target <= 5; NeMo <= 7)
  figure scale_bias_pct_<table> <v> %       signed mean error (target |bias| <= 2)
  figure scale_skipped_rows_<table> <v> rows    rows left out because a config cannot express them yet
  figure scale_max_error_pct_<table> <v> %  largest |error|
  figure scale_fit_<param>_<hardware> <v> ratio   the fit over every row of the GPU's tables (what conf/hardware
                                            carries; python -m trainsim.validation.fit_kernel_model writes it)
  figure scale_mape_pct_<table>_leave_one_table_out <v> %   the table predicted by a fit to its GPU's other
                                            tables alone (tables sharing a GPU)
  The pooled figures (validation/generalisation.py; every table of data/published, the NeMo 25.x, Megatron-Bridge
  and torchtitan tables written as recipes, each with its framework; skip with --skip-generalise):
  figure scale_rows_expressed_pct <v> %     rows of those tables that compose (the others listed with the reason)
  figure scale_mape_pct_leave_one_table_out <v> %   headline: each table predicted by a fit to its GPU's other
                                            tables (a GPU without: the fit its config carries); mean over
                                            tables (target <= 8, no table above 12); per table
                                            scale_table_out_mape_pct_<table>, and _worst_table
  figure scale_bias_pct_leave_one_table_out_max <v> %   the largest |signed mean| of a table (target <= 5)
  figure scale_mape_pct_leave_one_family_out <v> %  each model family predicted by a fit without it (target <= 10)
  figure scale_mape_pct_leave_one_gpu_out <v> %     each GPU at its data-free start times the fitted/data-free
                                            ratios of the other GPUs, each weighted by its rows' information
  figure predict_seconds_cached_fresh_process <v> s   `trainsim compose --quick` of one point in a new
                                            process with every input cached
Rows are composed with the overlap slowdown `trainsim compose` applies on their hardware (validation/fitting.py
pipeline_slowdown; hardware.slowdown.use=auto: none while the model loses to it on unseen kernel groups).

    python benchmarks/scale_accuracy.py [--tables megatron2021_a100 mcore2024_h100] [--skip-timing] [--page OUT.html]
Builds missing NCCL calibrations (seconds); the first run traces 33 layouts (minutes on 2 cores).
--page writes a self-contained page of the tables run: predicted against measured per row (y = x, +-5/10 %
bands, coloured by table and hardware) and |error| by model and by layout, as the sweep summary page draws
its measured points (trainsim/report/accuracy_figures.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from figures import figure

from trainsim.pipeline import build_point
from trainsim.validation import generalisation
from trainsim.validation.generalisation import POOLED_RECIPE_TABLES, base_run, pool_rows, table_errors
from trainsim.validation.published import (
    ASSUMPTIONS,
    FITTED_PER_GPU,
    STRUCTURAL_CHOICES,
    TABLES,
    evaluate_tables,
    leave_one_table_out,
    table_run,
)

PREDICTIONS = Path(__file__).parent / "results" / "generalisation_predictions.csv"
"""Every pooled row's out-of-sample predictions (fold kind, table, row, measured, predicted), written by
generalise(): benchmarks/uncertainty.py scores the intervals on them."""
TIMING_POINT = ["hardware=a100-80g-selene", "model=gpt-175b", "parallelism=pp16-tp8-dp8"]


def time_one_point() -> float:
    """Seconds for `trainsim compose --quick` in a fresh process, after one call built every input."""
    from trainsim import predict

    predict(*TIMING_POINT)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trainsim.cli", "compose", *TIMING_POINT, "--quick"], check=True,
                   capture_output=True)
    return time.perf_counter() - started


FOLDS = ("table", "family", "gpu")


def generalise(published: list[str], recipes: list[str], folds: tuple[str, ...] = FOLDS) -> list[pd.DataFrame]:
    """The headline figures: whole tables, model families and GPUs predicted by fits that never saw them;
    returns each fold kind's predictions (the kinds `folds` names)."""
    for hardware in sorted({base for base in recipe_hardware(recipes)}):
        build_point(base_run(hardware), "calibration")
        build_point(base_run(hardware), "slowdown_model")
    started = time.perf_counter()
    pool = pool_rows(published, recipes)
    total = len(pool.rows) + len(pool.skipped)
    print(f"\npooled {len(pool.rows)} rows of {len(published) + len(recipes)} tables on "
          f"{pool.rows['gpu'].nunique()} GPUs; {len(pool.skipped)} rows not expressed:")
    for row in pool.skipped.itertuples():
        print(f"  {row.table}: {row.label}: {row.reason.splitlines()[0][:150]}")
    figure("scale_rows_expressed_pct", 100 * len(pool.rows) / total, "%")
    out = [{"table": tables_out, "family": families_out, "gpu": gpus_out}[kind](pool).assign(held_out=kind)
           for kind in folds]
    print(f"pooled figures in {time.perf_counter() - started:.0f} s")
    return out


def tables_out(pool) -> pd.DataFrame:
    tables = generalisation.leave_one_table_out(pool)
    print("\nleave-one-table-out (each table predicted by a fit to its GPU's other tables; a GPU without other tables "
          "by the fit its config carries ('carried from'), else at its data-free start ('start')):")
    print(tables[["table", "label", "gpu", "measured_s", "predicted_s", "error_pct", "params_from"]].round(3)
          .to_string(index=False))
    per_table = table_errors(tables)
    print(per_table.round(2).to_string())
    for name, row in per_table.iterrows():
        figure(f"scale_table_out_mape_pct_{figure_name(name)}", row["mape_pct"], "%")
    figure("scale_mape_pct_leave_one_table_out", per_table["mape_pct"].mean(), "%")
    figure("scale_mape_pct_leave_one_table_out_worst_table", per_table["mape_pct"].max(), "%")
    figure("scale_bias_pct_leave_one_table_out_max", per_table["bias_pct"].abs().max(), "%")
    return tables


def families_out(pool) -> pd.DataFrame:
    families = generalisation.leave_one_family_out(pool)
    print("\nleave-one-family-out:")
    print(table_errors(families, "family").round(2).to_string())
    figure("scale_mape_pct_leave_one_family_out", families["error_pct"].abs().mean(), "%")
    return families


def gpus_out(pool) -> pd.DataFrame:
    gpus = generalisation.leave_one_gpu_out(pool)
    print("\nleave-one-GPU-out (the other GPUs' fitted/data-free ratios, weighted by their rows' information, on this "
          "GPU's data-free start); each GPU's own fit to all its rows, as fitted/data-free:")
    for gpu in pool.rows["gpu"].unique():
        start, fit = pool.step_times(gpu)[0].start, pool.fit_all(gpu)
        print(f"  {gpu} ({len(pool.gpu_indices(gpu))} rows): "
              + ", ".join(f"{name} {fit[name]:.3f}/{start[name]:.3f} = {fit[name] / start[name]:.3f}"
                          for name in FITTED_PER_GPU))
    print(table_errors(gpus, "gpu").round(2).to_string())
    figure("scale_mape_pct_leave_one_gpu_out", gpus["error_pct"].abs().mean(), "%")
    return gpus


def write_predictions(frames: list[pd.DataFrame]) -> None:
    """The out-of-sample predictions of every fold kind in one csv (PREDICTIONS): the kinds in `frames` replace
    theirs, the other kinds' rows stay (leave-one-row-out and the pooled folds are measured apart). Written
    beside and renamed into place."""
    columns = ["held_out", "table", "label", "model", "family", "gpu", "hardware", "framework", "measured_s",
               "predicted_s", "error_pct", "params_from"]
    new = pd.concat(frames, ignore_index=True)[columns]
    if PREDICTIONS.is_file():
        kept = pd.read_csv(PREDICTIONS)
        new = pd.concat([kept[~kept["held_out"].isin(new["held_out"].unique())], new], ignore_index=True)
    tmp = PREDICTIONS.with_suffix(".csv.tmp")
    new.sort_values("held_out", kind="stable").to_csv(tmp, index=False, float_format="%.6g")
    tmp.replace(PREDICTIONS)
    print(f"predictions in {PREDICTIONS}")


def row_predictions(evaluated: dict) -> pd.DataFrame:
    """The published tables' leave-one-row-out predictions in generalise()'s columns."""
    from trainsim.validation.generalisation import family_of

    frames = []
    for name, result in evaluated.items():
        rows = result.rows
        frames.append(pd.DataFrame({
            "held_out": "row", "table": name, "label": rows["model"].astype(str) + " " + rows["gpus"].astype(str)
            + " GPUs", "model": rows["model"].astype(str), "family": [family_of(m) for m in rows["model"].astype(str)],
            "gpu": table_run(name).hardware.device_name, "hardware": TABLES[name].hardware,
            "framework": TABLES[name].framework, "measured_s": rows["measured_s"],
            "predicted_s": rows["predicted_s"], "error_pct": rows["error_pct"], "params_from": "fit"}))
    return pd.concat(frames, ignore_index=True)


def recipe_hardware(recipes: list[str]) -> set[str]:
    from trainsim.validation.recipes import compose_recipe, read_recipes

    return {c.run.choices["hardware"] for table in recipes for c in map(compose_recipe, read_recipes(table))
            if c.run is not None}


def figure_name(table: str) -> str:
    """A table's name as a figure name component (csv names without '.csv', dots as underscores)."""
    return table.removesuffix(".csv").replace(".", "_").replace("-", "_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", nargs="*", default=list(TABLES), choices=list(TABLES),
                        help="tables to predict (none: only the timing)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-leave-one-table-out", action="store_true")
    parser.add_argument("--generalise-only", action="store_true",
                        help="only the pooled figures (the tables' leave-one-row-out predictions in the csv kept)")
    parser.add_argument("--folds", nargs="+", choices=FOLDS, default=list(FOLDS),
                        help="the pooled fold kinds to run (each writes its rows of the predictions csv)")
    parser.add_argument("--skip-generalise", action="store_true",
                        help="skip the pooled leave-one-table/family/GPU-out figures (every table of data/published)")
    parser.add_argument("--recipe-tables", nargs="*", default=list(POOLED_RECIPE_TABLES),
                        choices=list(POOLED_RECIPE_TABLES), help="recipe tables in the pooled figures")
    parser.add_argument("--page", type=Path, metavar="OUT.html", help="write the tables' accuracy page here")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    print("assumed where the sources are silent:")
    for name, text in ASSUMPTIONS.items():
        print(f"  {name}: {text}")
    print("structural choices made watching these tables (not held out by leave-one-row-out):")
    for name, text in STRUCTURAL_CHOICES.items():
        print(f"  {name}: {text}")
    for name in args.tables:  # the tables' NCCL calibrations and slowdown models, built where missing
        build_point(table_run(name), "calibration")
        build_point(table_run(name), "slowdown_model")
    if args.generalise_only:
        write_predictions(generalise(args.tables, args.recipe_tables, tuple(args.folds)))
        return
    evaluated = evaluate_tables(args.tables)
    for name, result in evaluated.items():
        rows = result.rows
        print(f"\n{name} on {TABLES[name].hardware}, leave-one-row-out ({result.seconds:.0f} s):")
        columns = ["model", "gpus", "tp", "pp", "dp", "virtual_stages", "micro_batch", "global_batch", "measured_s",
                   "predicted_s", "error_pct", *(p for p in FITTED_PER_GPU if p in rows)]
        print(rows[columns].round(3).to_string(index=False))
        print(f"skipped {len(result.skipped)} of {len(rows) + len(result.skipped)} rows (not in the figures)"
              + "".join(f"\n  {r.model} ({r.gpus} GPUs, tp {r.tp} pp {r.pp} cp {r.cp}): {r.skip_reason}"
                        for r in result.skipped.itertuples()))
        figure(f"scale_mape_pct_{name}", rows['error_pct'].abs().mean(), "%")
        figure(f"scale_bias_pct_{name}", rows['error_pct'].mean(), "%")
        figure(f"scale_max_error_pct_{name}", rows['error_pct'].abs().max(), "%")
        figure(f"scale_skipped_rows_{name}", len(result.skipped), "rows", "")
    if set(evaluated) == set(TABLES):  # the README's headline: every row of every table
        errors = pd.concat([result.rows["error_pct"] for result in evaluated.values()]).abs()
        figure("scale_mape_pct_all", errors.mean(), "%")
        figure("scale_rows_within10_all", f"{(errors <= 10).sum()}/{len(errors)}", "rows")
    fits = {TABLES[name].hardware: result for name, result in evaluated.items()}
    for hardware, result in fits.items():
        gn = result.all_rows_convergence
        if gn is not None:
            print(f"{hardware}: all-rows fit from the data-free start, {gn.iterations} Gauss-Newton steps, last "
                  f"move {100 * gn.moved:.3f} %")
        for param, value in result.all_rows_fit.items():
            figure(f"scale_fit_{param}_{hardware}", value, "ratio", ".4f")
    if not args.skip_leave_one_table_out:
        for name, rows in leave_one_table_out(evaluated).items():
            print(f"\n{name} predicted by a fit to the other tables of {TABLES[name].hardware} alone:")
            print(rows[["model", "gpus", "measured_s", "predicted_s", "error_pct"]].round(3).to_string(index=False))
            figure(f"scale_mape_pct_{name}_leave_one_table_out", rows['error_pct'].abs().mean(), "%")
            figure(f"scale_bias_pct_{name}_leave_one_table_out", rows['error_pct'].mean(), "%")
    if set(evaluated) == set(TABLES):
        write_predictions([row_predictions(evaluated)])
    if not args.skip_generalise:
        write_predictions(generalise(args.tables, args.recipe_tables, tuple(args.folds)))
    if args.page is not None:
        from trainsim.report.accuracy_figures import published_page

        args.page.write_text(published_page(evaluated))
        print(f"page {args.page}")
    if not args.skip_timing:
        figure("predict_seconds_cached_fresh_process", time_one_point(), "s")


if __name__ == "__main__":
    main()
