"""Turn `snakemake --config key=value ...` into Hydra overrides, expanding sweeps.

Every config entry becomes a Hydra override. A value with Hydra sweep syntax (`model=gpt-tiny,gpt-small`,
`parallelism.tp=range(1,3)`) or a YAML list (`model='[gpt-tiny,gpt-small]'`) is a sweep axis; the
points are the cartesian product of all axes, as in Hydra's basic sweeper.
"""

from __future__ import annotations

import itertools
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainsim.errors import ConfigError


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
    for key, value in sorted(config.items()):
        text = _as_override(key, value)
        try:
            override = parser.parse_override(text)
        except HydraException as exc:
            raise ConfigError(f"--config {text!r} is not a valid Hydra override: {exc}") from exc
        if override.is_sweep_override():
            axes.append([f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()])
        else:
            axes.append([text])
    return [list(point) for point in itertools.product(*axes)]
