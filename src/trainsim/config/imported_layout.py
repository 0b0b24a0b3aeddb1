"""A parallel layout imported from another framework's launch settings, and how it is written out.

`trainsim import-layout` reads Megatron-LM arguments (config/megatron_layout.py) or a torchtitan TOML job
(config/torchtitan_layout.py) into ImportedLayout: the ParallelismConfig fields they set, the model-shape
arguments met (they belong to conf/model, not to a layout) and the settings not known. It is written as a
conf/parallelism YAML file or as Hydra overrides; both name every field, so the result does not depend on
the parallelism preset it is applied over.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainsim.config.compose import group_from_plain
from trainsim.config.schema import ParallelismConfig
from trainsim.errors import ConfigError

CONTRACT_FIELDS = {
    "first_stage_layers": 0,
    "last_stage_layers": 0,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "pipeline_layout": "",
    "dp_shard_size": 0,
    "fp8_param_gather": False,
}
"""Fields of issue 48's shared contract, with their defaults: written only when an import sets them to something
else, so a layout that does not need them still composes with a schema that does not have them yet."""

ONE_BUCKET_BYTES = 2 ** 50  # set: above any stage's gradients (1 PiB): one bucket, reduced after the backward
"""parallelism.dp_bucket_size_bytes of Megatron-Core without --overlap-grad-reduce, which reduces all gradients in
one bucket after the backward (DistributedDataParallel sets bucket_size to None)."""

@dataclass
class ImportedLayout:
    """What an import found: the layout's fields and the settings it did not turn into one."""

    fields: dict[str, object]
    """ParallelismConfig field -> value, every schema field plus the contract fields the source sets."""
    source: str
    """What was read, for the header of the written file (e.g. "Megatron-LM arguments: --tensor-...")."""
    model_arguments: list[str] = field(default_factory=list)
    """Model-shape settings met (--num-layers 80, ...): they belong to conf/model, not imported here."""
    unknown: list[str] = field(default_factory=list)
    """Settings not known to the importer, kept when allowed (--allow-unknown) and listed in the output."""
    notes: list[str] = field(default_factory=list)
    """Settings read that trainsim does not price (e.g. torch.compile): listed, so nothing is dropped silently."""
    framework: str = ""
    """The conf/framework option of the stack the arguments belong to ('megatron-core', 'torchtitan')."""

    def parallelism(self) -> ParallelismConfig:
        """The layout as the schema's dataclass (ConfigError for a contract field the schema does not have)."""
        known = {f.name for f in dataclasses.fields(ParallelismConfig)}
        missing = sorted(set(self.fields) - known)
        if missing:
            raise ConfigError(f"parallelism fields {missing} are not in this trainsim's ParallelismConfig "
                              f"(config/schema.py); accepted fields: {sorted(known)}")
        return ParallelismConfig(**self.fields)

    def overrides(self) -> list[str]:
        """Hydra overrides that set the framework and every field (`parallelism.tp=8`, ...)."""
        return ([f"framework={self.framework}"] if self.framework else []) + [
            f"parallelism.{key}={_override_value(value)}" for key, value in self.fields.items()]

    def yaml_text(self) -> str:
        """A conf/parallelism file: a `# cite:` header naming the source, the schema defaults and every field."""
        lines = [f"# cite: imported by `trainsim import-layout` from {self.source}"]
        if self.model_arguments:
            lines.append(f"# model arguments, not imported by import-layout: {'; '.join(self.model_arguments)}")
        if self.unknown:
            lines.append(f"# not known to import-layout, left out: {'; '.join(self.unknown)}")
        lines += [f"# note: {note}" for note in self.notes]
        if self.framework:
            lines.append(f"# compose with framework={self.framework} (the stack these arguments belong to)")
        lines += ["defaults:", "  - parallelism_schema", "  - _self_"]
        lines += [f"{key}: {_yaml_value(value)}" for key, value in self.fields.items()]
        return "\n".join(lines) + "\n"


def read_parallelism_file(path: Path) -> ParallelismConfig:
    """A conf/parallelism YAML file as the schema's dataclass, without composing a run (no model to check it
    against): the presets the Megatron round trip is run on."""
    import yaml

    values = yaml.safe_load(Path(path).read_text()) or {}
    values.pop("defaults", None)
    return group_from_plain("parallelism", values)


def layout_fields(values: dict[str, object], name: str) -> dict[str, object]:
    """Every schema field (name first) with the imported `values` over ParallelismConfig's defaults, then the
    contract fields that differ from their defaults. Raises on a field that is neither."""
    unknown = set(values) - {f.name for f in dataclasses.fields(ParallelismConfig)} - set(CONTRACT_FIELDS)
    if unknown:
        raise ConfigError(f"import-layout produced unknown parallelism fields {sorted(unknown)}")
    defaults = ParallelismConfig()
    out: dict[str, object] = {"name": name or default_layout_name(values)}
    for f in dataclasses.fields(ParallelismConfig):
        if f.name != "name":
            out[f.name] = values.get(f.name, getattr(defaults, f.name))
    for key, default in CONTRACT_FIELDS.items():
        if key not in out and values.get(key, default) != default:
            out[key] = values[key]
    return out


def default_layout_name(values: dict[str, object]) -> str:
    """A preset-style name from the degrees that are not 1 (`tp8-sp-pp4-dp16`), as conf/parallelism names them."""
    parts = []
    for key in ("tp", "cp", "ep", "etp", "pp", "dp"):
        degree = values.get(key, 1)
        if (degree != 1 or key == "dp") and (key != "etp" or values.get("ep", 1) > 1):
            parts.append(f"{key}{degree}")
        if key == "tp" and values.get("sequence_parallel"):
            parts.append("sp")
    return "-".join(parts)


def _override_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "''" if value == "" else str(value)


def _yaml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(value)


def refuse(argument: str, value: object, accepted: str) -> ConfigError:
    """The error for a setting trainsim cannot model: names the argument, its value and what is accepted (and why)."""
    return ConfigError(f"{argument} {value!r} cannot be imported; accepted: {accepted}")
