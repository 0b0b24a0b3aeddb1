"""Stage 1 (trace): model + parallelism -> execution graphs, rank classes and memory per class.

Snakemake passes the resolved config groups as JSON (--config-json); DVC and people pass Hydra
overrides (`model=gpt-13b parallelism=pp8-tp4-dp2`). Either way the layout is validated first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from trainsim.config import compose_run, group_from_plain
from trainsim.config.validate import validate_layout
from trainsim.errors import ConfigError, TraceError
from trainsim.trace.stage import write_trace_artifact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True, type=Path, help="artifact directory to publish")
    parser.add_argument("--config-json", help="resolved {model, parallelism, keys} as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-small parallelism=tp2")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        if args.config_json:
            plain = json.loads(args.config_json)
            model = group_from_plain("model", plain["model"])
            par = group_from_plain("parallelism", plain["parallelism"])
            validate_layout(model, par)
            keys = plain["keys"]
        else:
            run = compose_run(args.overrides, check="layout")
            model, par, keys = run.model, run.parallelism, run.keys
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
