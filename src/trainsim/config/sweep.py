"""Turn `snakemake --config key=value ...` into Hydra overrides, expanding sweeps.

Every config entry `GROUP=OPTION` becomes a Hydra override. Snakemake keys cannot contain dots, so
field-level overrides go in the entry `overrides`, one Hydra override or a YAML list of them:
`--config overrides=parallelism.tp=2` or `--config overrides='[parallelism.tp=2, hardware.num_nodes=4]'`.
A value with Hydra sweep syntax (`model=gpt-tiny,gpt-small`, `'overrides=["parallelism.tp=1,2"]'`) or a
YAML list for a group (`model='[gpt-tiny,gpt-small]'`) is a sweep axis; the points are the cartesian
product of all axes, as in Hydra's basic sweeper.

Large grids go in a sweep file (`--config sweep_file=sweeps/grid.yaml`, see `read_sweep_file`); its
points are combined with the command line's. An invalid point does not stop the sweep: `sweep_points`
keeps it with the reason, and the summary lists it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainsim.config.compose import compose_run
from trainsim.errors import ConfigError

OVERRIDES_KEY = "overrides"
SWEEP_FILE_KEY = "sweep_file"
SWEEP_NAME_KEY = "sweep_name"
RESERVED_KEYS = (OVERRIDES_KEY, SWEEP_FILE_KEY, SWEEP_NAME_KEY)
"""--config entries that are not Hydra overrides."""


def _as_override(key: str, value: Any) -> str:
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"{key}={value}"


def expand_sweep(config: dict[str, Any]) -> list[list[str]]:
    """One list of plain overrides per sweep point (a single empty list when config is empty)."""
    parser = OverridesParser.create()
    axes: list[list[str]] = []
    texts = [_as_override(key, value) for key, value in sorted(config.items()) if key not in RESERVED_KEYS]
    extra = config.get(OVERRIDES_KEY, [])
    texts += [str(o) for o in (extra if isinstance(extra, (list, tuple)) else [extra])]
    for text in texts:
        try:
            override = parser.parse_override(text)
        except HydraException as exc:
            raise ConfigError(f"--config {text!r} is not a valid Hydra override: {exc}") from exc
        if override.is_sweep_override():
            axes.append([f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()])
        else:
            axes.append([text])
    return [list(point) for point in itertools.product(*axes)]


def read_sweep_file(path: Path) -> tuple[str | None, list[list[str]]]:
    """A sweep file's name and points. Format (YAML):

        name: my-grid                    # optional: artifacts/sweeps/my-grid
        grid:                            # cartesian product; keys are Hydra override keys
          model: [gpt-tiny, gpt-small]
          parallelism.tp: [1, 2]
        points:                          # explicit points, each a list of overrides
          - [parallelism=pp2, parallelism.global_batch_size=8]
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"sweep file {path}: cannot read it ({exc})") from exc
    unknown = set(data) - {"name", "grid", "points"} if isinstance(data, dict) else {"<not a mapping>"}
    if unknown:
        raise ConfigError(f"sweep file {path}: unknown key(s) {sorted(unknown)}; accepted: name, grid, points")
    grid = data.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"sweep file {path}: 'grid' must map override keys to non-empty lists, got {grid!r}")
    points = [[f"{key}={value}" for key, value in zip(grid, combo, strict=True)]
              for combo in itertools.product(*grid.values())] if grid else []
    for i, point in enumerate(data.get("points") or []):
        if not isinstance(point, list) or not all(isinstance(o, str) for o in point):
            raise ConfigError(f"sweep file {path}: points[{i}] must be a list of overrides, got {point!r}")
        points.append(list(point))
    if not points:
        raise ConfigError(f"sweep file {path}: no points (give 'grid' or 'points')")
    return data.get("name"), points


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep: its overrides and either the composed run or why it is invalid."""

    overrides: tuple[str, ...]
    run: Any = None
    """trainsim.config.Run when valid."""
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        keys = self.run.keys if self.run is not None else None
        return {"overrides": list(self.overrides), "keys": keys, "reason": self.reason}


def sweep_points(config: dict[str, Any], compose=None) -> tuple[str, list[SweepPoint]]:
    """The sweep's name and points for `snakemake --config` entries (a sweep file among them).

    Invalid points are kept with the reason instead of stopping the sweep. The name is `sweep_name`,
    else the sweep file's name, else a hash of the points, so another sweep never overwrites this one.
    """
    compose = compose or compose_run
    base = expand_sweep(config)
    name = config.get(SWEEP_NAME_KEY)
    if SWEEP_FILE_KEY in config:
        file_name, file_points = read_sweep_file(Path(config[SWEEP_FILE_KEY]))
        name = name or file_name
        base = [b + p for b in base for p in file_points]
    points = []
    for overrides in base:
        try:
            points.append(SweepPoint(tuple(overrides), run=compose(overrides)))
        except ConfigError as exc:
            points.append(SweepPoint(tuple(overrides), reason=str(exc)))
    if name is None:
        name = "sweep-" + hashlib.sha256(json.dumps(base).encode()).hexdigest()[:10]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(name)):
        raise ConfigError(f"sweep name {name!r}: use letters, digits, '.', '_' and '-' (it names a directory)")
    return str(name), points
