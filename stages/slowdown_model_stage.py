"""Stage 5 (slowdown model): XGBoost on the slowdown dataset, cross-validated, with a hold-out and
the constant-factor baseline. Publishes the model, its schema and its metrics (trainsim/slowdown/stage.py).
"""

from __future__ import annotations

import sys

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError
from trainsim.progress import status
from trainsim.slowdown.stage import write_model_artifact
from trainsim.stage_cli import resolve_groups, stage_inputs, stage_parser


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware",))
        dataset_dir = stage_inputs(args)["slowdown_dataset"]
        with status(f"training the slowdown model of {keys['hardware']}"):
            result = write_model_artifact(config["hardware"], keys, dataset_dir, args.output)
    except (ConfigError, ArtifactError, ValueError, KeyError) as exc:
        console.print(f"[red]slowdown model failed:[/red] {exc}")
        return 2
    rows = result.metrics["rows"]
    console.print(f"{rows['targets']} overlapped kernels ({rows['zero_overlap']} zero-overlap rows not targets); "
                  f"{rows['train']} train, {rows['holdout']} hold-out")
    for part in ("cv", "holdout"):
        for who in ("model", "baseline"):
            m = result.metrics[part][who]
            console.print(f"  {part:8s} {who:8s} within 5/10/15 %: {m['within_5_pct']:.1f} / "
                          f"{m['within_10_pct']:.1f} / {m['within_15_pct']:.1f} %, "
                          f"summed duration error {m['summed_error_pct']:+.2f} %, "
                          f"RMSE {m['duration_rmse_s'] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
