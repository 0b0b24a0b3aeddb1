"""Cache of composed configs: a fresh process skips Hydra (importing and composing take most of a second).

One JSON file per composition under artifacts/config-cache/, named by a hash of everything the
composition reads: the overrides, every file under conf/, the schema's source (its defaults fill the
fields a YAML file leaves out) and the Hydra and OmegaConf versions. Editing any of them changes the
name, so a stale entry is never found, only left behind. An entry also holds a hash of its own values:
a file that is truncated, edited or not JSON reads as absent, and the config is composed again.
Entries are written atomically (a temporary file renamed into place), so concurrent runs never read
half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from trainsim.config import schema

CACHE_DIR = Path("artifacts") / "config-cache"
"""Relative to the working directory, like every artifact (the workflow's project)."""
CACHE_FORMAT = 1
"""Bumped when what an entry holds, or how compose.py derives it, changes."""


def composition_key(conf: Path, overrides: tuple[str, ...]) -> str:
    """Hash of the overrides and of every input of composing them from `conf`."""
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, list(overrides)]).encode())
    for path in sorted(p for p in conf.rglob("*") if p.is_file()):
        digest.update(f"\0{path.relative_to(conf).as_posix()}\0".encode())
        digest.update(path.read_bytes())
    digest.update(Path(schema.__file__).read_bytes())
    for tool in ("hydra-core", "omegaconf"):
        digest.update(f"\0{tool} {metadata.version(tool)}".encode())
    return digest.hexdigest()


def cache_path(key: str, cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / f"{key[:32]}.json"


def _values_hash(values: Any) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def read_composition(key: str, cache_dir: Path = CACHE_DIR) -> Any | None:
    """The values stored under `key`, or None when there is no entry or it is damaged."""
    try:
        entry = json.loads(cache_path(key, cache_dir).read_text())
        if entry["key"] == key and entry["values_sha256"] == _values_hash(entry["values"]):
            return entry["values"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_composition(key: str, values: Any, cache_dir: Path = CACHE_DIR) -> None:
    """Store JSON-able `values` under `key`; a cache that cannot be written is skipped (it only saves time)."""
    path = cache_path(key, cache_dir)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "values_sha256": _values_hash(values), "values": values}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def typed_from_plain(cls: type, values: dict[str, Any]) -> Any:
    """Rebuild a schema dataclass from `dataclasses.asdict` of it (nested dataclasses, lists of them).

    Only for values this cache wrote from a composed config, so nothing is converted or checked beyond the
    field names (a missing or unknown field raises KeyError); `group_from_plain` checks user input."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    if set(values) != fields:
        raise KeyError(f"{cls.__name__}: fields {sorted(set(values) ^ fields)} differ from the schema")
    return cls(**{name: _typed_value(hints[name], value) for name, value in values.items()})


def _typed_value(hint: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return typed_from_plain(hint, value)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return [typed_from_plain(args[0], item) for item in value]
    return value
