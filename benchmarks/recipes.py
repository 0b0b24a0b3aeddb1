"""Recipes as people write them: every row of the published tables composed as its source states the layout.

Each row of data/published's NeMo, Megatron-Bridge and torchtitan tables becomes the overrides a user would
type (validation/recipes.py) and goes through compose_run, the path of every trainsim command; the rows it
refuses are counted with their reasons:

    figure recipes_rows_total <n> rows
    figure recipes_rows_refused <n> rows          target 0
    figure recipes_rows_not_built <n> rows        refused as architectures listed as not built (recipes.NOT_BUILT)
    figure recipes_rows_megatron_rejects <n> rows  layouts as stated that Megatron-Core itself refuses

`--memory` traces every accepted row and prints `figure recipes_rows_flagged_oom <n> rows` (target 0: they ran).
`--compose` also predicts every accepted row through `trainsim.predict` (trace, profile, calibration and
compose, each built once and cached) and prints each row's error against the step time its throughput implies:
informative here (issue 49 scores it), and slow: minutes per large model.

Then the model import (`recipes_import_mismatches`: conf/model against the config.json of the same model in
tests/config/fixtures/hf) and the Megatron argument round trip of every conf/parallelism preset
(`recipes_layout_roundtrip_failures`).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from figures import figure

from trainsim.validation.recipes import NOT_BUILT, RECIPE_TABLES, compose_recipe, read_recipes

REPO = Path(__file__).resolve().parents[1]


def refusals(verbose: bool) -> list:
    composed = [compose_recipe(recipe) for table in RECIPE_TABLES for recipe in read_recipes(table)]
    reasons = Counter(c.refusal.splitlines()[0][:160] for c in composed if c.refusal)
    for c in composed:
        if verbose or c.refusal:
            status = "refused" if c.refusal else "ok"
            print(f"{status:8} {c.recipe.table} row {c.recipe.row}: {c.recipe.label}"
                  + (f"\n         {c.refusal.splitlines()[0]}" if c.refusal else ""))
    print("\nrefusals by reason:")
    for reason, count in reasons.most_common():
        print(f"  {count:3}  {reason}")
    figure("recipes_rows_total", len(composed), "rows", "d")
    not_built = sum(c.refusal in NOT_BUILT.values() for c in composed)
    megatron_rejects = sum(c.recipe.megatron_rejects for c in composed)
    figure("recipes_rows_refused", sum(reasons.values()) - not_built - megatron_rejects, "rows", "d")
    figure("recipes_rows_not_built", not_built, "rows", "d")
    figure("recipes_rows_megatron_rejects", megatron_rejects, "rows", "d")
    return composed


def predictions(composed: list) -> None:
    import trainsim

    for c in composed:
        if c.refusal or c.recipe.measured_s is None:
            continue
        nodes = c.run.hardware.num_nodes
        result = trainsim.predict(*c.recipe.overrides, f"hardware.num_nodes={nodes}")
        error = 100 * (result.step_time_s / c.recipe.measured_s - 1)
        print(f"{c.recipe.table} row {c.recipe.row} {c.recipe.label}: predicted {result.step_time_s:.3f} s, "
              f"measured {c.recipe.measured_s:.3f} s ({error:+.1f} %)")


def flagged_out_of_memory(composed: list) -> None:
    """Every accepted row traced (trace/memory.py per rank class) against its GPU's memory: a published run ran,
    so a row flagged out of memory is a fault of the memory model (target 0)."""
    from trainsim.trace import trace_layout

    flagged = 0
    for c in composed:
        if c.refusal:
            continue
        memory = trace_layout(c.run.model, c.run.parallelism).memory.to_pandas()
        peak, capacity = float(memory["peak_bytes"].max()), c.run.hardware.memory_capacity_bytes
        if peak > capacity:
            flagged += 1
            print(f"out of memory: {c.recipe.table} row {c.recipe.row} {c.recipe.label}: peak {peak / 2**30:.1f} "
                  f"GiB of {capacity / 2**30:.1f} GiB")
    figure("recipes_rows_flagged_oom", flagged, "rows", "d")


def layout_round_trip() -> None:
    """Every conf/parallelism preset through `megatron_arguments` and back (a preset Megatron-LM cannot express,
    GPipe, counts as a failure with its reason)."""
    from trainsim.config.imported_layout import read_parallelism_file
    from trainsim.config.megatron_layout import megatron_arguments, megatron_round_trip_mismatches
    from trainsim.errors import ConfigError

    presets = {p.stem: read_parallelism_file(p) for p in sorted((REPO / "conf" / "parallelism").glob("*.yaml"))}
    inexpressible = {}
    for name, par in presets.items():
        try:
            megatron_arguments(par)
        except ConfigError as error:
            inexpressible[name] = str(error)
    failures = {name: m for name, par in presets.items()
                if name not in inexpressible and (m := megatron_round_trip_mismatches(par))}
    for name, reason in inexpressible.items():
        print(f"no Megatron-LM arguments for {name}: {reason.splitlines()[0]}")
    for name, mismatches in failures.items():
        print(f"round trip {name}: {'; '.join(m.splitlines()[0] for m in mismatches)}")
    figure("recipes_layout_presets", len(presets), "presets", "d")
    figure("recipes_layout_not_megatron", len(inexpressible), "presets", "d")
    figure("recipes_layout_roundtrip_failures", len(failures), "presets", "d")


def model_import() -> None:
    """conf/model against the import of the same model's config.json (tests/config/fixtures/hf), field by field."""
    from trainsim.config.imported_models import import_mismatches

    mismatches = import_mismatches(REPO / "tests" / "config" / "fixtures" / "hf", REPO / "conf")
    for model, field, imported, configured in mismatches:
        print(f"import {model}: {field} imported {imported!r}, conf/model has {configured!r}")
    figure("recipes_import_models", len(list((REPO / "tests" / "config" / "fixtures" / "hf").glob("*/config.json"))),
           "models", "d")
    figure("recipes_import_mismatches", len(mismatches), "fields", "d")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compose", action="store_true", help="also predict every accepted row (slow)")
    parser.add_argument("--verbose", action="store_true", help="list the accepted rows too")
    parser.add_argument("--memory", action="store_true",
                        help="trace every accepted row and count those flagged out of memory (minutes)")
    args = parser.parse_args(argv)
    composed = refusals(args.verbose)
    model_import()
    layout_round_trip()
    if args.memory:
        flagged_out_of_memory(composed)
    if args.compose:
        predictions(composed)


if __name__ == "__main__":
    main()
