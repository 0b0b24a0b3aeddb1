"""Stage 1 (trace): model + parallelism -> execution graphs, rank classes and memory per class."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import Progress

from trainsim.errors import ConfigError, TraceError
from trainsim.stage_cli import resolve_groups, stage_parser
from trainsim.trace.stage import write_trace_artifact


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("model", "parallelism"))
        model, par = config["model"], config["parallelism"]
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"tracing {model.name} / {par.name}", total=par.pp)
            result = write_trace_artifact(model, par, keys, args.output,
                                          progress=lambda done, total: bar.update(task, completed=done))
    except (ConfigError, TraceError) as exc:
        console.print(f"[red]trace failed:[/red] {exc}")
        return 2
    console.print(f"traced {par.pp} rank class(es) of {par.world_size} ranks, {result.graph.num_rows} events "
                  f"in {sum(result.seconds_per_class):.2f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
