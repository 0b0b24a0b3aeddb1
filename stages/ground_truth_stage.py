"""Ground truth: run the reference step for real (gloo, one process per rank) and publish its step-time
statistics with per-op and per-collective tables from torch.profiler.

Hardware that is not this machine (device_kind other than cpu) gets a "not measured" artifact with the
reason. Built on demand only (not part of `rule all`):
    snakemake --cores 2 artifacts/ground_truth/local-cpu/gpt-small/dp2 --config model=gpt-small
    python stages/ground_truth_stage.py --output artifacts/ground_truth/local-cpu/gpt-small/dp2 model=gpt-small
See trainsim/validation/ground_truth.py and docs/validation.md.
"""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ConfigError
from trainsim.stage_cli import resolve_groups, stage_parser
from trainsim.validation.ground_truth import GroundTruthError, write_ground_truth_artifact


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware", "model", "parallelism"))
        summary = write_ground_truth_artifact(config["hardware"], config["model"], config["parallelism"], keys,
                                              args.output)
    except (ConfigError, GroundTruthError) as exc:
        console.print(f"[red]ground truth failed:[/red] {exc}", markup=False, highlight=False)
        return 2
    if summary["status"] == "measured":
        console.print(f"step {summary['step_time_median_s']:.4f} s median over {summary['steps']} steps "
                      f"(IQR {summary['step_time_spread_s']:.4f} s) -> {args.output}")
    else:
        console.print(f"not measured: {summary['reason']} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
