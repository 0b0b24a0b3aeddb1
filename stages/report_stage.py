"""Stage 7 (report): one self-contained HTML page, metrics.json and plot tables per configuration point.

Inputs: --input compose=DIR (required) and trace, profile, calibration, slowdown_model (shown when given);
--input ground_truth=DIR optional, else artifacts/ground_truth/{hardware}/{model}/{parallelism} when it
exists; without it the page says "not measured". The token budget (train.tokens) adds the training totals.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError
from trainsim.registry import STAGES
from trainsim.report.stage import write_report_artifact
from trainsim.stage_cli import resolve_groups, stage_inputs, stage_parser


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware", "model", "parallelism"), STAGES["report"].settings)
        inputs = stage_inputs(args)
        if "compose" not in inputs:
            raise ConfigError("--input compose=DIR is required")
        truth = inputs.get("ground_truth", Path(STAGES["ground_truth"].path(keys)))
        result = write_report_artifact(keys, inputs, args.output, truth, train=config["train"],
                                       framework=config["framework"])
    except (ConfigError, ArtifactError) as exc:
        console.print(f"[red]report failed:[/red] {exc}")
        return 2
    e2e = result["end_to_end"]
    measured = f"error {e2e['error_pct']:+.1f}%" if "error_pct" in e2e else "not measured"
    console.print(f"predicted {e2e['predicted_s']:.4f} s ({measured}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
