"""Stage 4 (slowdown dataset): compute ops timed solo and overlapped with collectives, or imported.

Publishes dataset.parquet and summary.json for the hardware (see trainsim/slowdown/stage.py).
"""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError
from trainsim.progress import status
from trainsim.slowdown.stage import write_dataset_artifact
from trainsim.stage_cli import resolve_groups, stage_parser


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware",))
        with status(f"slowdown dataset for {keys['hardware']} ({config['hardware'].slowdown.source})"):
            summary = write_dataset_artifact(config["hardware"], keys, args.output)
    except (ConfigError, ArtifactError, ValueError, KeyError) as exc:
        console.print(f"[red]slowdown dataset failed:[/red] {exc}")
        return 2
    invalid = ", ".join(f"{count} {reason}" for reason, count in summary["invalid"].items())
    console.print(f"{summary['rows']} instances on {keys['hardware']} ({summary['source']}, "
                  f"device types {summary['device_types']}): {summary['status']['ok']} overlapped, "
                  f"{summary['status']['zero_overlap']} with zero overlap; set aside as invalid: {invalid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
