"""Every number of the configs and of the models says where it comes from (config/provenance.py)."""

from __future__ import annotations

from pathlib import Path

from trainsim.config.provenance import unsourced_constants


def test_every_number_of_the_configs_and_models_has_a_source():
    unsourced = unsourced_constants()
    assert unsourced == [], f"{len(unsourced)} numbers without a source:\n" + "\n".join(unsourced)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


HARDWARE = """\
# A made-up GPU.
defaults:
  - hardware_schema
name: made-up
# cite: its datasheet
peak_flops_per_s: {bf16: 1.0e15}
memory_bandwidth_bytes_per_s: 3.0e12
# The node: no tag here, so the datasheet's section ends.
devices_per_node: 8
num_nodes: 4   # set: a cluster size
kernel_model:
  # fit: python benchmarks/fit.py
  matmul_efficiency: 0.7
  memory_half_bytes: 1.0e5
  launch_overhead_s: 4.0e-6   # fit: python -m trainsim.no_such_module
version: "2.21"
"""

MODULE = '''\
"""A model."""

SOURCED = 0.5
"""A rate.
cite: a paper"""
# set: a code
CODE = 3
GUESS = 0.9
NAME = "no number"
'''


def test_a_number_without_a_source_is_named_with_its_file_line_and_value(tmp_path):
    root = _tree(tmp_path, {"conf/hardware/made-up.yaml": HARDWARE, "benchmarks/fit.py": "",
                            "src/trainsim/profile/model.py": MODULE})
    unsourced = unsourced_constants(root)
    assert [u.split(" (")[0] for u in unsourced] == [
        "conf/hardware/made-up.yaml:9 devices_per_node = 8",
        "conf/hardware/made-up.yaml:15 kernel_model.launch_overhead_s = 4.0e-6",
        "src/trainsim/profile/model.py:8 GUESS = 0.9",
    ]
    assert "no module trainsim.no_such_module" in unsourced[1]


def test_a_fit_names_a_command_of_this_repository(tmp_path):
    root = _tree(tmp_path, {"conf/hardware/made-up.yaml": HARDWARE.replace("# set: a cluster size", ""),
                            "src/trainsim/profile/model.py": 'GUESS = 0.9  # fit: python benchmarks/fit.py\n'})
    unsourced = [u.split(" (")[0] for u in unsourced_constants(root)]
    assert "conf/hardware/made-up.yaml:10 num_nodes = 4" in unsourced  # the untagged comment block's section
    assert "conf/hardware/made-up.yaml:13 kernel_model.matmul_efficiency = 0.7" in unsourced  # no benchmarks/fit.py
    assert "src/trainsim/profile/model.py:1 GUESS = 0.9" in unsourced
    (root / "benchmarks").mkdir()
    (root / "benchmarks/fit.py").write_text("")
    assert "src/trainsim/profile/model.py:1 GUESS = 0.9" not in [u.split(" (")[0] for u in unsourced_constants(root)]
