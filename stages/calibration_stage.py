"""Stage 3 (NCCL calibration): measure or read collective timings of a hardware and fit the model.

Writes measurements.parquet and fit.json (parameters per collective with held-out error against the
alpha-beta baseline); see trainsim/comm/calibration.py.
"""

from __future__ import annotations

import math
import sys

from rich.console import Console

from trainsim.comm.calibration import write_calibration_artifact
from trainsim.errors import ArtifactError, ConfigError
from trainsim.progress import status
from trainsim.stage_cli import resolve_groups, stage_parser


def main(argv: list[str] | None = None) -> int:
    args = stage_parser(__doc__).parse_args(argv)
    console = Console(stderr=True)
    try:
        config, keys = resolve_groups(args, ("hardware",))
        with status(f"calibrating collectives on {keys['hardware']}"):
            fit = write_calibration_artifact(config["hardware"], keys, args.output)
    except (ConfigError, ArtifactError, KeyError) as exc:
        console.print(f"[red]calibration failed:[/red] {exc}")
        return 2
    if not fit["collectives"]:
        console.print(f"{keys['hardware']}: no measurements configured; the model uses NCCL constants and "
                      "datasheet rates (add hardware.calibration.files)")
    for source, count in fit["skipped_wrong_results"].items():
        if count:
            console.print(f"[yellow]{source}: {count} measurement(s) with wrong results skipped[/yellow]")
    for source, reasons in fit.get("skipped_lines", {}).items():
        for reason, seen in reasons.items():
            console.print(f"[yellow]{source}: {seen['count']} line(s) left out ({reason}): lines "
                          f"{seen['lines'][:10]}[/yellow]")
    for name, entry in fit["collectives"].items():
        held = {k: "-" if v is None or math.isnan(v) else f"{v:.1f}%" for k, v in entry["heldout"].items()}
        console.print(f"{name}: {entry['rows']} measurements, fit error {entry['train_mape_pct']:.1f}%; held-out sizes "
                      f">=1MiB {held['model_mape_pct_large']} (alpha-beta {held['baseline_mape_pct_large']}), "
                      f"<1MiB {held['model_mape_pct_small']} (alpha-beta {held['baseline_mape_pct_small']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
