"""Stage 6 (timeline compose): trace + kernel profile + NCCL model + slowdown model -> step timeline.

Inputs: --input trace=DIR --input profile=DIR [--input calibration=DIR] [--input slowdown_model=DIR].
Without a calibration the NCCL model runs on datasheet rates; without a slowdown model overlap is free.
"""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError
from trainsim.stage_cli import resolve_groups, stage_inputs, stage_parser
from trainsim.timeline.stage import write_timeline_artifact
from trainsim.timeline.step import TimelineError


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware", "model", "parallelism"))
        inputs = stage_inputs(args)
        for name in ("trace", "profile"):
            if name not in inputs:
                raise ConfigError(f"--input {name}=DIR is required")
        result = write_timeline_artifact(config["hardware"], config["model"], config["parallelism"], keys, inputs,
                                         args.output)
    except (ConfigError, ArtifactError, TimelineError) as exc:
        console.print(f"[red]compose failed:[/red] {exc}")
        return 2
    console.print(f"step {result['step_time_s']:.4f} s over {result['num_rank_classes']} rank class(es), "
                  f"{result['num_nodes']} nodes, {result['simulate_s']:.2f} s "
                  f"(comm: {result['models']['comm']}; slowdown: {result['models']['slowdown']})"
                  + (" [red]OOM[/red]" if result["oom"] else "") + f" -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
