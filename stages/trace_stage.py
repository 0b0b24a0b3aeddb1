"""Stage 1 (trace): model + parallelism -> execution graphs, rank classes and memory per class."""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ConfigError, TraceError
from trainsim.progress import tracked
from trainsim.stage_cli import resolve_groups, stage_parser
from trainsim.trace.stage import write_trace_artifact


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("model", "parallelism"))
        model, par = config["model"], config["parallelism"]
        with tracked(f"tracing {model.name} / {par.name}", par.pp) as bar:  # silent unless stderr is a terminal
            result = write_trace_artifact(model, par, keys, args.output, progress=bar)
    except (ConfigError, TraceError) as exc:
        console.print(f"[red]trace failed:[/red] {exc}")
        return 2
    console.print(f"traced {par.pp} rank class(es) of {par.world_size} ranks, {result.graph.num_rows} events "
                  f"in {sum(result.seconds_per_class):.2f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
