"""Where a data file named in a config lives.

Configs name measured data (nccl-tests logs, Echo's overlap CSV) relative to the project, e.g.
`data/nccl-tests/...` (the repository's data/, indexed in data/SOURCES.md). A stage runs in the project
root (Snakemake, DVC), but a copy of the project (a sweep directory, a test's temporary project) keeps
finding the data through the trainsim checkout.
"""

from __future__ import annotations

from pathlib import Path

from trainsim.errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[3]
DATA_DIR = CHECKOUT / "data"
"""The measured public data shipped with the repository (each file names its source in its header)."""


def resolve_data_path(value: str, field: str) -> Path:
    """The file `value` names: absolute, else under the working directory, else under the checkout.

    The error names the config field and every place looked at.
    """
    path = Path(value)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, CHECKOUT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"{field}={value!r}: no such file (looked at {', '.join(str(c) for c in candidates)})")
