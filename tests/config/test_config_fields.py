"""Every config field means what it says: something reads it, and a value the model cannot honour stops
composition with the field, the value and what is supported (instead of quietly becoming another)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from trainsim.comm.model import nccl_constants, prior_params, release_constants
from trainsim.config import compose_run
from trainsim.config.schema import RunConfig
from trainsim.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "trainsim"
SCHEMA = SRC / "config" / "schema.py"


def schema_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, field name) of every dataclass field reachable from `cls`, through lists and dicts."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append((path, f.name))
        for inner in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(inner):
                out += schema_fields(inner, f"{path}.")
    return out


def read_names(source: str) -> set[str]:
    """Names a module reads: `x.name` loads, `x["name"]`, `x.get("name")`, `getattr(x, "name")`.

    Docstrings, comments and assignments (`x.name = ...`, `replace(x, name=...)`) do not count."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                names.add(node.slice.value)
        elif isinstance(node, ast.Call):
            key = _looked_up_key(node)
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def _looked_up_key(call: ast.Call) -> ast.expr | None:
    """The key argument of getattr(x, key) / hasattr(x, key) / x.get(key) / x.pop(key), else None."""
    if isinstance(call.func, ast.Name) and call.func.id in ("getattr", "hasattr") and len(call.args) >= 2:
        return call.args[1]
    if isinstance(call.func, ast.Attribute) and call.func.attr in ("get", "pop") and call.args:
        return call.args[0]
    return None


def test_read_names_sees_reads_not_mentions():
    source = '''"""hw.nccl.min_channels is mentioned here only."""
# hw.unused_in_comment
x = hw.nccl.max_channels + d["price"] + d.get("latency") + getattr(hw, "version", "") + g(hw, "not_a_lookup")
hw.written = 1
y = replace(hw, kw_only=2)
'''
    names = read_names(source)
    assert {"nccl", "max_channels", "price", "latency", "version"} <= names
    assert not {"min_channels", "unused_in_comment", "written", "kw_only", "not_a_lookup"} & names


def test_every_schema_field_is_read_outside_the_schema():
    """Reads in the schema and in the validation rules do not count: a field only checked is still unused."""
    declared_or_checked = {SCHEMA, *SCHEMA.parent.glob("validate*.py")}
    read = set()
    for path in SRC.rglob("*.py"):
        if path not in declared_or_checked:
            read |= read_names(path.read_text())
    fields = schema_fields()
    assert len(fields) > 100  # the walk reaches the nested groups (nccl, calibration files, slowdown model ...)
    unread = [path for path, name in fields if name not in read]
    assert not unread, f"config fields nothing in src/trainsim reads (wire them or remove them): {unread}"


def test_every_schema_field_has_a_docstring():
    undocumented = []
    for cls in ast.walk(ast.parse(SCHEMA.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        body = cls.body
        for stmt, after in zip(body, [*body[1:], None], strict=True):
            if isinstance(stmt, ast.AnnAssign) and not (
                    isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                undocumented.append(f"{cls.name}.{stmt.target.id}")
    assert not undocumented


@pytest.mark.parametrize(("override", "message"), [
    ("hardware.nccl.algorithms=[pat]",
     "hardware.nccl.algorithms=['pat']: 'pat' not modelled; supported: ring, tree, nvls"),
    ("hardware.nccl.algorithms=[ring,collnet_direct]",
     "hardware.nccl.algorithms=['ring', 'collnet_direct']: 'collnet_direct' not modelled; supported: ring, tree, nvls"),
    ("hardware.nccl.algorithms=[]", "hardware.nccl.algorithms=[]: needs at least one; supported: ring, tree, nvls"),
    ("hardware.network.nvls=false", "includes 'nvls' but hardware.network.nvls is false"),
    ("hardware.nccl.version=2.16.5", "hardware.network.nvls=true needs NCCL 2.17 or later; "
                                     "hardware.nccl.version='2.16.5'"),
    ("hardware.network.transport=ethernet", "hardware.network.transport='ethernet': supported: infiniband, roce, "
                                            "efa, tcp"),
    ("hardware.network.nics_per_node=0", "hardware.network.nics_per_node=0 and hardware.network.nic_bandwidth_bytes_"
                                         "per_s=5e+10: give both"),
    ("hardware.inter_node_bandwidth_bytes_per_s=100e9",
     "hardware.inter_node_bandwidth_bytes_per_s=1e+11 contradicts hardware.network.nics_per_node x "
     "nic_bandwidth_bytes_per_s = 8 x"),
    ("hardware.network.nvlink_domain_size=12", "hardware.network.nvlink_domain_size=12: must be a multiple of "
                                               "devices_per_node=8 (a domain joins whole nodes/trays)"),
    ("hardware.network.placement=spread", "hardware.network.placement='spread': supported: balanced, packed"),
    ("hardware.network.oversubscription=0.5", "hardware.network.oversubscription=0.5: must be >= 1"),
    ("hardware.nccl.protocols=[LL,simple]",
     "hardware.nccl.protocols=['LL', 'simple']: 'simple' not modelled; supported: LL, LL128, Simple"),
    ("hardware.nccl.version=2.10.3", "hardware.nccl.version='2.10.3': no tuning constants before 2.12; "
                                     "supported: a release from 2.12 on"),
    ("hardware.nccl.version=latest", "hardware.nccl.version='latest': not a release number; supported:"),
    ("hardware.nccl.max_channels=-1", "hardware.nccl.max_channels=-1: supported: 1..64"),
    ("hardware.nccl.max_channels=128", "hardware.nccl.max_channels=128: supported: 1..64"),
    ("hardware.nccl.buffer_size_bytes=0", "hardware.nccl.buffer_size_bytes=0: must be positive"),
    ("hardware.inter_node_latency_s=-1e-6", "hardware.inter_node_latency_s=-1e-06: must be >= 0"),
    ("hardware.intra_node_bandwidth_bytes_per_s=-1", "hardware.intra_node_bandwidth_bytes_per_s=-1.0: must be >= 0"),
    ("+hardware.peak_flops_per_s.tf32=494e12",
     "hardware.peak_flops_per_s.tf32=4.94e+14: no op is timed at a 'tf32' rate; supported: fp32, bf16, fp16, fp64"),
    ("+hardware.kernel_model.kind_efficiency.softmax=2",
     "hardware.kernel_model.kind_efficiency.softmax=2.0: supported: a positive efficiency for one of matmul, "),
    ("hardware.kernel_model.fp8_matmul_efficiency=1.2",
     "hardware.kernel_model.fp8_matmul_efficiency=1.2 must be in [0, 1] (a fraction of the dtype's peak"),
    ("hardware.kernel_model.attention_tile_keys=-670",
     "hardware.kernel_model.attention_tile_keys=-670.0 must be >= 0 (0 = none)"),
    ("hardware.kernel_model.attention_dropout_forward_s_per_score=-1e-12",
     "hardware.kernel_model.attention_dropout_forward_s_per_score=-1e-12 must be >= 0"),
    ("hardware.profile_backend=gpu", "hardware.profile_backend='gpu' is not supported; accepted: auto, measure, "
                                     "analytical"),
    ("hardware.slowdown.source=download", "hardware.slowdown.source='download' is not supported; accepted: "
                                          "measure, import"),
    ("hardware.slowdown.use=always", "hardware.slowdown.use='always' is not supported; accepted: auto, model, none"),
])
def test_unmodelled_values_are_rejected_naming_field_value_and_supported(override, message):
    with pytest.raises(ConfigError) as err:
        compose_run(["hardware=h100-sxm-dgx", override])
    assert message in str(err.value)


def test_removed_min_channels_is_an_unknown_field():
    with pytest.raises(ConfigError, match="min_channels"):
        compose_run(["hardware=h100-sxm-dgx", "hardware.nccl.min_channels=4"])


@pytest.mark.parametrize("hardware", ["a100-80g-dgx", "a100-80g-p4de", "h100-sxm-dgx", "h800-dgx", "local-cpu"])
def test_every_hardware_file_composes(hardware):
    assert compose_run([f"hardware={hardware}"]).hardware.name == hardware


def test_hop_latencies_set_the_simple_step_and_scale_the_other_protocols():
    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    table = release_constants(hw.nccl.version)["hw_latency_us"]
    unset = dataclasses.replace(hw, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    # the configured values are NCCL's own Simple constants: the same prior as leaving them unset
    assert prior_params(hw, "all_reduce").values == pytest.approx(prior_params(unset, "all_reduce").values)

    slow = dataclasses.replace(hw, inter_node_latency_s=3 * table["NET"]["ring"]["Simple"] * 1e-6)
    values = prior_params(slow, "all_reduce").values
    for protocol in nccl_constants()["payload_fraction"]:
        assert values[f"latency.inter.{protocol}"] == pytest.approx(3 * table["NET"]["ring"][protocol] * 1e-6)
        assert values[f"latency.intra.{protocol}"] == pytest.approx(table["NVLINK"]["ring"][protocol] * 1e-6)


def test_the_accepted_values_are_the_modelled_ones():
    """config/choices.py's sets agree with the code that acts on them: the kernel model's op kinds, the NCCL
    releases with constants, and the bytes of each training precision's weights."""
    from trainsim.config.choices import OLDEST_NCCL_RELEASE, OP_KINDS, PRECISION_WEIGHT_BYTES, PRECISIONS
    from trainsim.profile.analytical import OP_KIND_PATTERNS
    from trainsim.workloads.model import DTYPES

    assert {*OP_KIND_PATTERNS, "matmul", "elementwise"} == set(OP_KINDS)
    assert nccl_constants()["releases"][0]["from"] == OLDEST_NCCL_RELEASE
    assert set(DTYPES) == set(PRECISIONS)
    assert PRECISION_WEIGHT_BYTES == {name: dtype.itemsize for name, dtype in DTYPES.items()}
