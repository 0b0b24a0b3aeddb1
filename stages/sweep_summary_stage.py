"""Sweep summary: gather every point of a sweep (valid, out of memory, invalid with its reason) into
summary.parquet, summary.csv and summary.html. Snakemake runs it as the last job of every sweep:
    snakemake --cores 2 --config model=gpt-tiny,gpt-small parallelism=dp2,tp3
    -> artifacts/sweeps/sweep-<hash>/ (or --config sweep_name=NAME)
--points-json is the list of SweepPoint.as_dict() the Snakefile composed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from trainsim.errors import ArtifactError
from trainsim.report.sweep import STATUS_INVALID, what_if_lines, write_sweep_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--points-json", required=True)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        table = write_sweep_summary(args.name, json.loads(args.points_json), args.output)
    except ArtifactError as exc:
        console.print(f"[red]sweep summary failed:[/red] {exc}", markup=False, highlight=False)
        return 2
    for line in what_if_lines(table):
        console.print(line, markup=False, highlight=False)
    invalid = int((table["status"] == STATUS_INVALID).sum())
    console.print(f"{len(table)} point(s), {invalid} invalid -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
