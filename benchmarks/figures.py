"""Benchmark figures from one place: each is printed as `figure <name> <value> <unit>` and recorded in
benchmarks/results/<script>.json with the commit, date and command line that produced it.

docs/validation.md's table and the README's figures are generated from those files
(`python benchmarks/check_figures.py --write`), so a number in the docs is always one a script printed.
Standard library only: .ci/run's system python3 records ci_minutes through the command line below.

    from figures import figure                      # in a benchmark run as `python benchmarks/x.py`
    figure("comm_mape_pct_large_all", 5.91, "%")    # prints `figure comm_mape_pct_large_all 5.91 %`

    python benchmarks/figures.py record SCRIPT NAME VALUE UNIT [--commit SHA] [--fmt .1f]

A run records only the figures it prints: they replace their earlier values in the file, the other figures
stay (a run with `--only X` keeps everything else). Writers are serialised by a lock and the file is replaced
atomically, so two benchmarks of one script running at once lose nothing.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import functools
import json
import math
import numbers
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
RESULTS_DIR = BENCHMARKS_DIR / "results"
# the results files change as benchmarks run; they do not make the code a run measured "dirty"
RESULTS_PATHSPEC = ":(exclude)benchmarks/results"


@functools.cache
def git_state(repo: Path = REPO_ROOT) -> tuple[str, bool]:
    """(HEAD commit, whether tracked files outside benchmarks/results differ from it); ("unknown", True) without git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--",
                                 ".", RESULTS_PATHSPEC], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return head, bool(status.strip())


def running_benchmark() -> Path | None:
    """The benchmark script this process runs (`python benchmarks/x.py`), or None: a test calling a benchmark's
    main() prints its figures but records none, so fake data never lands in the results files."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file:
        return None
    path = Path(main_file).resolve()
    return path if path.parent == BENCHMARKS_DIR and path.suffix == ".py" else None


def as_value(value):
    """A JSON value for `value`: int, float, None for NaN or infinity, or the string as printed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return str(value)


def as_text(value, fmt: str) -> str:
    """The value as printed: numbers through `fmt`, anything else (e.g. "5/8") as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def results_path(script: str, results_dir: Path | None = None) -> Path:
    return (results_dir or RESULTS_DIR) / f"{script}.json"


def read_results(script: str, results_dir: Path | None = None) -> dict:
    """The recorded figures of one script ({} when it has none); a damaged file is an error naming it."""
    path = results_path(script, results_dir)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}); restore it from git or delete it and rerun "
                         f"benchmarks/{script}.py") from error
    if not isinstance(data.get("figures"), dict):
        raise ValueError(f"{path}: field 'figures' is {data.get('figures')!r}; expected an object of figures")
    return data["figures"]


def record(script: str, name: str, value, unit: str, text: str, *, commit: str | None = None,
           argv: list[str] | None = None, results_dir: Path | None = None) -> dict:
    """Merge one figure into results/<script>.json under a lock; returns the entry written."""
    head, dirty = git_state()
    if commit is not None:
        head, dirty = commit, False
    entry = {"value": as_value(value), "unit": unit, "text": text, "commit": head, "dirty": dirty,
             "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
             "argv": list(sys.argv if argv is None else argv)}
    results_dir = results_dir or RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(script, results_dir)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        figures = read_results(script, results_dir)
        figures[name] = entry
        document = {"script": script, "figures": dict(sorted(figures.items()))}
        fd, tmp = tempfile.mkstemp(dir=results_dir, prefix=f".{script}.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(document, out, indent=1)
                out.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return entry


def figure(name: str, value, unit: str, fmt: str = ".2f", *, script: str | None = None, keep: bool = True) -> None:
    """Print `figure <name> <value> <unit>` and, when a benchmark script runs, record it in its results file
    (`script` names another; keep=False only prints, for a check of a script that measures nothing real)."""
    text = as_text(value, fmt)
    print(f"figure {name} {text} {unit}".rstrip(), flush=True)
    benchmark = running_benchmark()
    if keep and benchmark is not None:
        record(script or benchmark.stem, name, value, unit, text)


def parse_number(text: str):
    """'13.6' -> 13.6, '7' -> 7; anything else stays a string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record a figure measured outside a benchmark script "
                                     "(e.g. .ci/run's ci_minutes) in benchmarks/results/SCRIPT.json.")
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="print and record one figure")
    rec.add_argument("script", help="results file stem, e.g. ci for benchmarks/results/ci.json")
    rec.add_argument("name")
    rec.add_argument("value")
    rec.add_argument("unit")
    rec.add_argument("--fmt", default=None, help="format of a numeric value (default: as given)")
    rec.add_argument("--commit", help="the commit measured, when not this repository's HEAD (then not dirty)")
    args = parser.parse_args(argv)
    value = parse_number(args.value)
    text = as_text(value, args.fmt) if args.fmt else args.value
    print(f"figure {args.name} {text} {args.unit}".rstrip(), flush=True)
    record(args.script, args.name, value, args.unit, text, commit=args.commit,
           argv=["figures.py"] + list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
