"""Stage 2 (kernel profile): solo time of every distinct compute op of a trace on the hardware.

Fills the shared database (--database, append-only) with the signatures it lacks, then publishes
this run's rows and a summary (measured / reused / analytical / fallback) as the stage artifact.
"""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError
from trainsim.profile.stage import write_profile_artifact
from trainsim.stage_cli import resolve_groups, stage_inputs, stage_parser


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--remeasure", action="store_true",
                        help="time every op of the trace again, even those the database has (newer rows win)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware", "model", "parallelism"))
        trace_dir = stage_inputs(args)["trace"]
        if args.database is None:
            raise ConfigError("--database DIR is required (the hardware's profile database)")
        # the timing loop draws its own bar on a terminal (trainsim.progress)
        summary = write_profile_artifact(config["hardware"], keys, trace_dir, args.database, args.output,
                                         remeasure=args.remeasure)
    except (ConfigError, ArtifactError, KeyError) as exc:
        console.print(f"[red]profile failed:[/red] {exc}")
        return 2
    console.print(f"{summary.distinct} distinct ops on {keys['hardware']} ({summary.backend}): "
                  f"{summary.measured} measured, {summary.reused} reused, {summary.analytical} analytical "
                  f"({len(summary.fallback)} fallbacks)")
    for item in summary.fallback:
        console.print(f"  fallback {item['op']}: {item['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
