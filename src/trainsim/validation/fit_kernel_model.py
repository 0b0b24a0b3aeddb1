"""Fit each published-table GPU's kernel-model efficiencies to every row of its tables, and write them into its
hardware config: the script behind the fitted numbers of conf/hardware/h100-sxm-dgx.yaml and
a100-80g-selene.yaml (tests/validation/test_scale_figures.py fails when a config drifts from this fit).

    python -m trainsim.validation.fit_kernel_model [--write]

The fit is kernel_fit.fit_gauss_newton over every runnable row of the GPU's tables (published.TABLES), from the
data-free start; it traces the rows that are not cached (minutes) and reads the GPUs' NCCL calibrations,
which the driver builds (benchmarks/scale_accuracy.py does, or trainsim.pipeline.build_point(table_run(name),
'calibration')). --write replaces only the fitted lines of the config's kernel_model and the
numbers and date of the comment that names this script.
"""

from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

from trainsim.config.compose import default_config_dir
from trainsim.validation.kernel_fit import CARRIED_TO
from trainsim.validation.published import TABLES, active_params, gpu_rows

DECIMALS = 3
"""digits the configs carry"""
FIT_COMMENT = re.compile(r"fit_kernel_model, \d{4}-\d{2}-\d{2}\): \d+\.\d+( / \d+\.\d+)*")
"""the part of a config comment this script rewrites: 'fit_kernel_model, <date>): <values in FITTED_PER_GPU
order, ' / ' between>'"""


def fit_hardware(hardware: str, workers: int = 2) -> dict[str, float]:
    """The all-rows fit of `hardware`'s tables (the parameters some row depends on), rounded to DECIMALS."""
    from trainsim.validation.kernel_fit import fit_gauss_newton

    names = [name for name, table in TABLES.items() if table.hardware == hardware]
    gpu = gpu_rows(names, workers)
    fit = fit_gauss_newton(gpu.times, range(len(gpu.rows)), gpu.measured())
    return {name: round(fit.params[name], DECIMALS) for name in active_params(gpu.times)}


def write_fit(path: Path, fit: dict[str, float], today: str, comment: bool = True) -> str:
    """The config text at `path` with each fitted kernel_model line set to `fit` and (with `comment`) the
    FIT_COMMENT updated. Raises ValueError naming the file and field where a fitted field or the comment is not
    there."""
    text = path.read_text()
    block = re.search(r"^kernel_model:\n((?:[ #].*\n|\n)*)", text, re.MULTILINE)
    if block is None:
        raise ValueError(f"{path}: no kernel_model block to write {sorted(fit)} into")
    body = block.group(1)
    for name, value in fit.items():
        body, count = re.subn(rf"^(\s+{name}:) [0-9.eE+-]+$", rf"\g<1> {value:.{DECIMALS}f}", body, flags=re.MULTILINE)
        if count != 1:
            raise ValueError(f"{path}: kernel_model.{name} found {count} times; the fit writes it exactly once")
    text = text[:block.start(1)] + body + text[block.end(1):]
    if not comment:
        return text
    values = " / ".join(f"{v:.{DECIMALS}f}" for v in fit.values())
    text, count = FIT_COMMENT.subn(f"fit_kernel_model, {today}): {values}", text)
    if count != 1:
        raise ValueError(f"{path}: expected one comment naming 'fit_kernel_model, <date>): <values>', found {count}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write the fits into conf/hardware")
    parser.add_argument("--hardware", nargs="*", default=sorted({t.hardware for t in TABLES.values()}))
    args = parser.parse_args()
    today = datetime.date.today().isoformat()
    for hardware in args.hardware:
        fit = fit_hardware(hardware)
        print(hardware, " ".join(f"{name}={value:.{DECIMALS}f}" for name, value in fit.items()))
        if args.write:
            for name in (hardware, *CARRIED_TO.get(hardware, ())):
                path = default_config_dir() / "hardware" / f"{name}.yaml"
                path.write_text(write_fit(path, fit, today, comment=name == hardware))
                print(f"wrote {path}")


if __name__ == "__main__":
    main()
