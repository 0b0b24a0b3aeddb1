"""Compose a run from conf/ with Hydra's compose API, validate it, and name its artifacts.

Snakemake, DVC, the CLI and the tests all come through `compose_run`, so a layout is checked
the same way everywhere. Stages receive *plain* dicts (JSON), never OmegaConf objects.
A composition is cached (compose_cache.py), so Hydra and OmegaConf are imported only on a cache miss:
they take longer to import and compose than the rest of a cached `trainsim compose`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainsim.config.compose_cache import composition_key, read_composition, typed_from_plain, write_composition
from trainsim.config.framework import apply_framework
from trainsim.config.imported_models import HF_PREFIX, hydra_overrides
from trainsim.config.schema import (
    CONFIG_GROUPS,
    FrameworkConfig,
    HardwareConfig,
    ModelConfig,
    ParallelismConfig,
    TrainConfig,
    register_configs,
)
from trainsim.config.validate import validate_layout, validate_run
from trainsim.errors import ConfigError


def default_config_dir() -> Path:
    """./conf of the working directory (the workflow's project), else conf/ of this checkout."""
    local = Path.cwd() / "conf"
    return local if local.is_dir() else Path(__file__).resolve().parents[3] / "conf"


def stable_hash(obj: Any, length: int = 8) -> str:
    """Short content hash of a JSON-able object (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class Run:
    """One composed, validated simulation point."""

    hardware: HardwareConfig
    model: ModelConfig
    parallelism: ParallelismConfig
    choices: dict[str, str]
    """Config-group option chosen for each group (the YAML file name)."""
    overrides: tuple[str, ...]
    """Hydra overrides this run was composed from."""
    option_values: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Plain values of each chosen option without field overrides (an override to the same value keeps
    the option's key, so it re-runs nothing)."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The whole run (token budget) for totals; in no artifact key."""
    framework: FrameworkConfig = dataclasses.field(default_factory=FrameworkConfig)
    """The software stack (conf/framework/), already written into hardware, model and parallelism
    (config/framework.py): it keys artifacts through the values it set there."""
    explicit_fields: tuple[str, ...] = ()
    """Dotted fields set on the command line or by a chosen option file (`parallelism.tp`, ...), sorted: the
    framework decides none of them."""

    def group(self, name: str) -> dict[str, Any]:
        """The plain (JSON-able) values of one config group."""
        return dataclasses.asdict(getattr(self, name))

    def key(self, name: str) -> str:
        """Artifact-path component for a group: the option name, plus a hash when a field was overridden.

        `model=gpt-13b` gives 'gpt-13b'; `model=gpt-13b model.num_layers=20` gives 'gpt-13b-<hash>' (as does a framework
        that changes a field of the group: config/framework.py); an imported
        `model=hf:dir/config.json` gives its written option, 'dir-<hash of the imported fields>'.
        """
        base = self.choices[name]
        if base.startswith(HF_PREFIX):
            base = self.option_values[name]["name"]
        changed = self.option_values.get(name, self.group(name)) != self.group(name)  # overridden or by framework
        return f"{base}-{stable_hash(self.group(name))}" if changed else base

    @property
    def keys(self) -> dict[str, str]:
        return {name: self.key(name) for name in CONFIG_GROUPS}


def explicit_fields(overrides, options: dict[str, Any]) -> tuple[str, ...]:
    """The fields a user stated: on the command line, or in a chosen option file (a value other than the
    schema's default). The framework decides only the others."""
    stated = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    for name, cls in CONFIG_GROUPS.items():
        defaults = dataclasses.asdict(cls())
        stated |= {f"{name}.{k}" for k, v in dataclasses.asdict(options[name]).items() if v != defaults.get(k)}
    return tuple(sorted(stated))


def detect_local_devices(hw: HardwareConfig) -> HardwareConfig:
    """Fill 'detect' (0) fields of a CPU hardware config from this machine."""
    if hw.device_kind != "cpu":
        return hw
    devices = hw.devices_per_node or os.cpu_count() or 1
    memory = hw.memory_capacity_bytes
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices
    return dataclasses.replace(hw, devices_per_node=devices, memory_capacity_bytes=float(memory))


TYPED_NODES: dict[str, type] = {**CONFIG_GROUPS, "train": TrainConfig, "framework": FrameworkConfig}
"""The composed nodes a Run is made of."""


def _compose(conf: Path, overrides: tuple[str, ...]) -> tuple[dict[str, str], dict[str, Any]]:
    """Chosen option per group and the typed groups, and the typed `train` node (cached)."""
    key = composition_key(conf, overrides)
    cached = read_composition(key)
    if cached is not None:
        try:
            return cached["choices"], {name: typed_from_plain(cls, cached["nodes"][name])
                                       for name, cls in TYPED_NODES.items()}
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another shape: compose again and replace it
    choices, typed = _hydra_compose(conf, overrides)
    write_composition(key, {"choices": choices,
                            "nodes": {name: dataclasses.asdict(node) for name, node in typed.items()}})
    return choices, typed


def _hydra_compose(conf: Path, overrides: tuple[str, ...]) -> tuple[dict[str, str], dict[str, Any]]:
    """What `_compose` caches: Hydra's composition (imported here, on a cache miss only)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        detail = f"{exc}" + (f" ({exc.__cause__})" if exc.__cause__ else "")
        raise ConfigError(f"cannot compose config from {conf} with overrides {list(overrides)}: {detail}") from exc
    finally:
        GlobalHydra.instance().clear()
    choices = {name: str(cfg.hydra.runtime.choices[name]) for name in (*CONFIG_GROUPS, "framework")}
    return choices, {name: OmegaConf.to_object(cfg[name]) for name in TYPED_NODES}


def compose_run(
    overrides: list[str] | tuple[str, ...] = (),
    config_dir: Path | None = None,
    check: str = "run",
) -> Run:
    """Compose conf/config.yaml with Hydra overrides and validate.

    `model=hf:path/to/config.json` imports a Hugging Face config (config/imported_models.py); the run's
    choices keep 'hf:path/to/config.json', its model key is the imported option's name.

    check='run' validates hardware, model and layout together; check='layout' only what tracing needs
    (model and parallelism), so a 8192-GPU layout can be traced whatever the default hardware is.
    """
    conf = Path(config_dir or default_config_dir()).resolve()
    if not (conf / "config.yaml").is_file():
        raise ConfigError(f"no config.yaml in config directory {conf}; run from the project root (the directory "
                          "holding conf/), or pass config_dir=")
    imported_overrides, imported_choices = hydra_overrides(overrides)
    choices, typed = _compose(conf, imported_overrides)
    touched = {name for name in CONFIG_GROUPS if any(o.lstrip("+~").startswith(f"{name}.") for o in overrides)}
    options = typed
    if touched:
        search_path = tuple(o for o in imported_overrides if o.startswith("hydra.searchpath="))
        options = _compose(conf, tuple(f"{g}={choices[g]}" for g in CONFIG_GROUPS) + search_path)[1]
    choices |= imported_choices
    explicit = explicit_fields(overrides, options)
    hardware, model, parallelism = apply_framework(typed["framework"], detect_local_devices(typed["hardware"]),
                                                   typed["model"], typed["parallelism"], explicit)
    run = Run(
        hardware=hardware,
        model=model,
        parallelism=parallelism,
        choices=choices,
        overrides=tuple(overrides),
        option_values={name: dataclasses.asdict(detect_local_devices(options[name]) if name == "hardware"
                                                else options[name]) for name in CONFIG_GROUPS},
        train=typed["train"],
        framework=typed["framework"],
        explicit_fields=explicit,
    )
    if not run.train.tokens >= 0:
        raise ConfigError(f"train.tokens={run.train.tokens}: the run's token budget must be >= 0 (0 = no training "
                          "totals), e.g. train.tokens=3e11 for 300 billion tokens")
    if check == "run":
        validate_run(run.hardware, run.model, run.parallelism)
    elif check == "layout":
        validate_layout(run.model, run.parallelism)
    else:
        raise ValueError(f"check={check!r}; accepted: 'run', 'layout'")
    return run


def group_from_plain(name: str, values: dict[str, Any]):
    """Rebuild a typed config group from its plain dict (as handed to a stage), checking the fields."""
    from omegaconf import OmegaConf  # stages only: a cached compose does not import it
    from omegaconf.errors import OmegaConfBaseException

    schema = CONFIG_GROUPS[name]
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {sorted(unknown)}; accepted: {sorted(known)}")
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), values)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{name}: {exc}") from exc
    return OmegaConf.to_object(node)
