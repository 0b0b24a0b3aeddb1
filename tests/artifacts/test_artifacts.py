"""Artifacts are published atomically; half-written or corrupt ones are reported by name."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainsim.artifacts import atomic_artifact, read_manifest, read_table
from trainsim.errors import ArtifactError


def _write(path: Path, value: int) -> None:
    with atomic_artifact(path, stage="test", config={"value": value}, config_keys={"k": "v"}) as tmp:
        pq.write_table(pa.table({"value": [value] * 1000}), tmp / "table.parquet")


def test_manifest_records_config_files_and_versions(tmp_path):
    _write(tmp_path / "a", 1)
    manifest = read_manifest(tmp_path / "a")
    assert manifest["config"] == {"value": 1} and manifest["config_keys"] == {"k": "v"}
    assert set(manifest["files"]) == {"table.parquet"}
    assert {"python", "torch", "pyarrow"} <= set(manifest["tool_versions"])
    assert manifest["code_version"].startswith("0.") and manifest["wall_time_s"] >= 0
    assert read_table(tmp_path / "a", "table.parquet").num_rows == 1000


def test_inputs_are_recorded_by_content_hash(tmp_path):
    _write(tmp_path / "upstream", 1)
    upstream = [tmp_path / "upstream"]
    with atomic_artifact(tmp_path / "down", stage="t", config={}, config_keys={}, inputs=upstream) as tmp:
        (tmp / "x.txt").write_text("x")
    inputs = read_manifest(tmp_path / "down")["inputs"]
    assert list(inputs) == [str(tmp_path / "upstream")] and len(next(iter(inputs.values()))) == 64


def test_failed_stage_leaves_nothing_behind(tmp_path):
    _write(tmp_path / "a", 1)
    with pytest.raises(RuntimeError):
        with atomic_artifact(tmp_path / "a", stage="test", config={}, config_keys={}) as tmp:
            (tmp / "table.parquet").write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert read_table(tmp_path / "a", "table.parquet").column("value")[0].as_py() == 1  # old one intact
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_half_written_artifact_is_not_taken_for_finished(tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    pq.write_table(pa.table({"value": [1]}), half / "table.parquet")
    with pytest.raises(ArtifactError, match=r"half.*manifest.json is missing"):
        read_table(half, "table.parquet")


def test_corrupt_file_and_manifest_are_named(tmp_path):
    _write(tmp_path / "a", 1)
    (tmp_path / "a" / "table.parquet").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match=r"table.parquet does not match the SHA-256"):
        read_manifest(tmp_path / "a")
    _write(tmp_path / "b", 1)
    (tmp_path / "b" / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupt"):
        read_manifest(tmp_path / "b")
    _write(tmp_path / "c", 1)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["files"]["gone.parquet"] = "0" * 64
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"gone.parquet listed in .* is missing"):
        read_manifest(tmp_path / "c")


def test_concurrent_writers_leave_one_complete_artifact(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write, args=(tmp_path / "shared", i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    manifest = read_manifest(tmp_path / "shared")
    value = read_table(tmp_path / "shared", "table.parquet").column("value")[0].as_py()
    assert manifest["config"] == {"value": value}  # manifest and data come from the same writer
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_an_artifact_is_current_only_for_the_same_config_inputs_and_committed_code(tmp_path, monkeypatch):
    """A cached compose reuses its timeline only when composing again would write the same one."""
    from trainsim.artifacts import is_current, store

    _write(tmp_path / "upstream", 1)
    monkeypatch.setattr(store, "code_version", lambda: "0.1.0+0123456789ab")  # a clean checkout at one commit
    with atomic_artifact(tmp_path / "down", stage="t", config={"a": [1.0]}, config_keys={"k": "v"},
                         inputs=[tmp_path / "upstream"]) as tmp:
        (tmp / "x.txt").write_text("x")

    def current(**changes) -> bool:
        return is_current(tmp_path / "down", **{"stage": "t", "config": {"a": (1.0,)}, "config_keys": {"k": "v"},
                                                "inputs": [tmp_path / "upstream"], **changes})

    assert current()
    assert not current(stage="other") and not current(config={"a": [2.0]}) and not current(config_keys={"k": "w"})
    assert not current(inputs=[])
    _write(tmp_path / "upstream", 2)  # an input of other content
    assert not current()
    _write(tmp_path / "upstream", 1)
    assert current()
    for version in ("0.1.0+0123456789ab-dirty", "0.1.0+ba9876543210", "0.1.0"):  # edited, other commit, unknown
        monkeypatch.setattr(store, "code_version", lambda v=version: v)
        assert not current()
    monkeypatch.setattr(store, "code_version", lambda: "0.1.0+0123456789ab")
    (tmp_path / "down" / "x.txt").write_text("edited")
    assert not current()
