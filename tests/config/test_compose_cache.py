"""The composed-config cache (config/compose_cache.py) gives exactly what Hydra composes, follows every edit of
conf/ and of the overrides, and never hands out a damaged entry."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainsim.config import compose_run
from trainsim.config.compose_cache import CACHE_DIR

POINTS = [
    [],
    ["hardware=a100-80g-selene", "model=gpt-175b", "parallelism=pp16-tp8-dp8"],
    ["hardware=h100-sxm-dgx", "model=mixtral-8x7b", "parallelism=ep8-pp4-dp16", "parallelism.micro_batch_size=2"],
    ["hardware=a100-80g-dgx", "model=gpt-13b", "parallelism=tp2", "hardware.stragglers=[{ranks: [1], factor: 1.5}]",
     "train.tokens=3e11"],
]
"""Defaults; a calibrated cluster; a mixture of experts with a field override (two compositions: the point
and its options); a list of nested dataclasses set by an override."""


@pytest.fixture
def project(tmp_path: Path, repo: Path, monkeypatch) -> Path:
    """A working directory with its own conf/ and an empty cache."""
    shutil.copytree(repo / "conf", tmp_path / "conf")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def entries(project: Path) -> list[Path]:
    return sorted((project / CACHE_DIR).glob("*.json"))


def test_a_cached_composition_is_what_hydra_composes(project):
    """A fresh process finds every point in the cache (Hydra never imported) and rebuilds the same Run, field
    types included (repr tells 1 from 1.0)."""
    composed = [repr(compose_run(overrides, check="layout")) for overrides in POINTS]
    assert len(entries(project)) == len(POINTS) + 2  # each point with field overrides also composed its options
    code = ("import sys\nfrom trainsim.config import compose_run\n"
            f"runs = [repr(compose_run(o, check='layout')) for o in {POINTS!r}]\n"
            "print(repr([runs, 'hydra' in sys.modules, 'omegaconf' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=project).stdout
    cached, hydra_imported, omegaconf_imported = eval(out)  # noqa: S307 (our own repr)
    assert cached == composed
    assert not hydra_imported and not omegaconf_imported


def test_an_edited_conf_file_or_override_composes_again(project):
    overrides = ["model=gpt-tiny", "parallelism=dp2"]
    layers = compose_run(overrides).model.num_layers
    assert compose_run([*overrides, f"model.num_layers={layers + 2}"]).model.num_layers == layers + 2
    path = project / "conf/model/gpt-tiny.yaml"
    path.write_text(path.read_text().replace(f"num_layers: {layers}\n", f"num_layers: {layers + 1}\n"))
    assert compose_run(overrides).model.num_layers == layers + 1
    (project / "conf/hardware/new-cluster.yaml").write_text((project / "conf/hardware/local-cpu.yaml").read_text())
    assert compose_run([*overrides, "hardware=new-cluster"]).choices["hardware"] == "new-cluster"


@pytest.mark.parametrize("damage", ["truncated", "not json", "edited value", "another shape"])
def test_a_damaged_entry_is_composed_again_and_replaced(project, damage):
    overrides = ["hardware=a100-80g-selene", "model=gpt-175b", "parallelism=pp16-tp8-dp8"]
    expected = repr(compose_run(overrides))
    (path,) = entries(project)
    text = path.read_text()
    entry = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff")
    elif damage == "edited value":  # a plausible config whose hash no longer matches
        entry["values"]["nodes"]["model"]["num_layers"] += 1
        path.write_text(json.dumps(entry))
    else:  # consistent hash, but not the fields of the schema
        entry["values"] = {"choices": entry["values"]["choices"], "nodes": {"model": {"num_layers": 1}}}
        path.write_text(json.dumps({**entry, "values_sha256": _sha256(entry["values"])}))
    assert repr(compose_run(overrides)) == expected
    assert json.loads(path.read_text()) == json.loads(text)


def _sha256(values) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
