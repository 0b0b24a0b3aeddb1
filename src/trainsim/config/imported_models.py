"""Imported models where runs are composed: `model=hf:path/config.json`, conf/model YAML text, and the check
that conf/model agrees with the published config.json of each model.

`model=hf:PATH` becomes a Hydra option like any conf/model file: the import's fields are written to
artifacts/imported-models/model/<name>.yaml, whose name is the file's (its folder's for config.json) plus a
hash of the imported fields, so two different config.json files never share artifacts and editing one re-runs
what depends on it. Hydra finds that folder through hydra.searchpath, so field overrides
(`model.seq_length=8192`) apply on top as usual.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import textwrap
import uuid
from pathlib import Path
from typing import Any

from trainsim.config.hf_import import ImportedModel, import_hf_config
from trainsim.config.schema import ModelConfig

HF_PREFIX = "hf:"
"""How a `model=` override names a Hugging Face config.json instead of a conf/model option."""
IMPORT_DIR = Path("artifacts") / "imported-models"
"""Where `model=hf:` imports are written for Hydra (relative to the working directory, like every artifact)."""
COMPARE_SKIPPED = {
    "name": "the option's name, not the model",
    "seq_length": "the training length: an argument of the import, not in config.json",
    "moe_aux_loss_coeff": "the load-balancing loss weight is the training recipe's (Megatron --moe-aux-loss-coeff); "
                          "config.json states the reference code's fine-tuning default",
}
"""Fields `import_mismatches` does not compare between an import and conf/model, with the reason."""


def hf_source(override: str) -> str | None:
    """The path of a `model=hf:PATH` override, else None."""
    key, sep, value = override.partition("=")
    value = re.sub(r"\\(.)", r"\1", value)  # a sweep axis hands values over escaped: hf\:dir/config.json
    return value[len(HF_PREFIX):] if sep and key == "model" and value.startswith(HF_PREFIX) else None


def content_name(imported: ImportedModel) -> str:
    """The imported model's option name: the file's name plus a hash of the imported fields."""
    fields = {k: v for k, v in imported.fields.items() if k != "name"}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
    return f"{imported.fields['name']}-{digest}"


def hydra_overrides(overrides: tuple[str, ...] | list[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Overrides for Hydra with each `model=hf:PATH` replaced by its written option, and the choices to report
    (`{"model": "hf:PATH"}`, so a run re-composed from its choices imports the file again)."""
    out: list[str] = []
    choices: dict[str, str] = {}
    for override in overrides:
        source = hf_source(override)
        if source is None:
            out.append(override)
            continue
        imported = import_hf_config(source)
        name = content_name(imported)
        imported.fields["name"] = name
        _write_if_changed(IMPORT_DIR / "model" / f"{name}.yaml", model_yaml(imported))
        out += [f"model={name}", f"hydra.searchpath=['file://{IMPORT_DIR.resolve()}']"]
        choices["model"] = f"{HF_PREFIX}{source}"
    return tuple(out), choices


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def model_yaml(imported: ImportedModel, seq_length_note: str = "") -> str:
    """A conf/model YAML of an import: a `# cite:` header naming the source, then every mapped field in the
    schema's order, the training sequence length last with its own `# set:` tag."""
    import yaml

    order = [f.name for f in dataclasses.fields(ModelConfig)]
    fields = {k: imported.fields[k] for k in order if k in imported.fields and k != "seq_length"}
    ignored = "; ".join(f"{key} ({why})" for key, why in imported.ignored.items())
    header = [f"# cite: Hugging Face config.json of {imported.fields['name']} (model_type {imported.model_type}), "
              f"read from {imported.source} by trainsim's import (config/hf_import.py).",
              f"# Keys left out as irrelevant to step time: {ignored}." if ignored else "",
              "# What trainsim models differently is listed under `approximations`; every prediction repeats it."]
    body = yaml.safe_dump(fields, sort_keys=False, default_flow_style=False, width=1000)
    note = seq_length_note or ("the training sequence length, not in config.json (max_position_embeddings is the "
                               "model's limit): the import's default; override it with model.seq_length")
    def comment(lines: list[str]) -> str:
        return "".join(f"{wrapped}\n" for line in lines if line
                       for wrapped in textwrap.wrap(line, 116, subsequent_indent="# ", break_on_hyphens=False))

    return (comment(header) + "defaults:\n  - model_schema\n  - _self_\n" + body + comment([f"# set: {note}"])
            + f"seq_length: {imported.fields['seq_length']}\n")


def import_mismatches(fixtures_dir: str | Path, conf_dir: str | Path) -> list[tuple[str, str, Any, Any]]:
    """(model, field, imported, configured) for every field where the import of fixtures_dir/<model>/config.json
    differs from conf_dir/model/<model>.yaml (models with both files; COMPARE_SKIPPED fields left out).
    The recipes benchmark's `figure recipes_import_mismatches <n>` counts import_mismatches(fixtures, "conf")."""
    import yaml

    defaults = dataclasses.asdict(ModelConfig())
    conf_dir = Path(conf_dir)
    conf_dir = conf_dir.parent if conf_dir.name == "model" else conf_dir  # conf/ or conf/model
    out = []
    for path in sorted(Path(fixtures_dir).glob("*/config.json")):
        model = path.parent.name
        conf = Path(conf_dir) / "model" / f"{model}.yaml"
        if not conf.is_file():
            continue
        configured = defaults | {k: v for k, v in yaml.safe_load(conf.read_text()).items() if k != "defaults"}
        imported = defaults | import_hf_config(path).fields
        out += [(model, name, imported[name], configured[name]) for name in defaults
                if name not in COMPARE_SKIPPED and imported[name] != configured[name]]
    return out
