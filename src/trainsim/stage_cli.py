"""What every stage entry point in stages/ shares: its arguments and how its config is resolved.

Snakemake hands a stage the resolved config groups as JSON (--config-json); DVC and people hand it
Hydra overrides. Upstream artifacts come as `--input NAME=DIR`, a shared database as `--database DIR`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainsim.config import compose_run, group_from_plain
from trainsim.config.compose import detect_local_devices
from trainsim.config.validate import validate_hardware, validate_layout
from trainsim.errors import ConfigError
from trainsim.registry import RUN_FIELDS


def stage_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", required=True, type=Path, help="artifact directory to publish")
    parser.add_argument("--config-json", help="resolved config groups and their keys as JSON (from Snakemake)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=DIR",
                        help="an upstream artifact, e.g. trace=artifacts/traces/gpt-tiny/dp2")
    parser.add_argument("--database", type=Path, help="shared append-only database directory")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-small parallelism=tp2")
    return parser


def stage_inputs(args: argparse.Namespace) -> dict[str, Path]:
    inputs = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            raise ConfigError(f"--input {item!r}: expected NAME=DIR, e.g. --input trace=artifacts/traces/gpt-tiny/dp2")
        inputs[name] = Path(path)
    return inputs


def resolve_groups(args: argparse.Namespace, groups: tuple[str, ...],
                   settings: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """Typed config of `groups` and their artifact keys, validated as far as those groups allow; with the
    root config nodes `settings` names (registry.Stage.settings) typed beside them, keying nothing."""
    if args.config_json:
        plain = json.loads(args.config_json)
        typed = {group: group_from_plain(group, plain[group]) for group in groups}
        typed |= {name: type(RUN_FIELDS[name].default_factory())(**plain.get(name, {})) for name in settings}
        keys = plain["keys"]
        if "hardware" in typed:
            typed["hardware"] = detect_local_devices(typed["hardware"])
    else:
        run = compose_run(args.overrides, check="layout")
        typed = {name: getattr(run, name) for name in (*groups, *settings)}
        keys = {group: run.key(group) for group in groups}
    if "model" in typed and "parallelism" in typed:
        validate_layout(typed["model"], typed["parallelism"])
    if "hardware" in typed:
        validate_hardware(typed["hardware"])
    return typed, keys

