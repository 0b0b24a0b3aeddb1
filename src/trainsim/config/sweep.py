"""Turn `snakemake --config key=value ...` into Hydra overrides, expanding sweeps.

Every config entry `GROUP=OPTION` becomes a Hydra override. Snakemake keys cannot contain dots, so
field-level overrides go in the entry `overrides`, one Hydra override or a YAML list of them:
`--config overrides=parallelism.tp=2` or `--config overrides='[parallelism.tp=2, hardware.num_nodes=4]'`.
A value with Hydra sweep syntax (`model=gpt-tiny,gpt-small`, `'overrides=["parallelism.tp=1,2"]'`) or a
YAML list for a group (`model='[gpt-tiny,gpt-small]'`) is a sweep axis; the points are the cartesian
product of all axes, as in Hydra's basic sweeper.
"""

from __future__ import annotations

import itertools
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainsim.errors import ConfigError

OVERRIDES_KEY = "overrides"


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
    texts = [_as_override(key, value) for key, value in sorted(config.items()) if key != OVERRIDES_KEY]
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
