"""Artifacts: a directory of files plus manifest.json, published atomically.

A stage writes into a hidden temporary sibling directory; the manifest (config, input hashes, code
and tool versions, wall time, and a SHA-256 of every file) is written last; then the directory is
renamed into place under a lock. A reader trusts a directory only if its manifest exists and every
file matches its hash, so a half-written or corrupted artifact is reported, never used.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trainsim.errors import ArtifactError
from trainsim.version import __version__

MANIFEST = "manifest.json"
TOOLS = ("torch", "hydra-core", "omegaconf", "pyarrow", "pandas", "xgboost", "snakemake", "dvc")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "trainsim": __version__}
    for tool in TOOLS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[tool] = metadata.version(tool)
    return versions


def code_version() -> str:
    """trainsim version plus the git commit of the checkout (with '-dirty' for local edits)."""
    repo = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "stages"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+{commit}{'-dirty' if dirty else ''}"


def read_manifest(artifact_dir: Path) -> dict[str, Any]:
    """The verified manifest of a finished artifact; ArtifactError names what is missing or corrupt."""
    artifact_dir = Path(artifact_dir)
    manifest_path = artifact_dir / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{artifact_dir} is not a finished artifact: {MANIFEST} is missing "
                            "(the stage did not complete; re-run it)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{manifest_path} is corrupt ({exc}); delete {artifact_dir} and re-run the stage") from exc
    for name, expected in files.items():
        path = artifact_dir / name
        if not path.is_file():
            raise ArtifactError(f"{path} listed in {manifest_path} is missing; re-run the stage")
        if file_sha256(path) != expected:
            raise ArtifactError(f"{path} does not match the SHA-256 in {manifest_path} (corrupt or edited); "
                                "re-run the stage")
    return manifest


def read_table(artifact_dir: Path, name: str) -> pa.Table:
    """One Parquet table of a verified artifact."""
    read_manifest(artifact_dir)
    return pq.read_table(Path(artifact_dir) / name)


def content_hash(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def is_current(artifact_dir: Path, *, stage: str, config: dict[str, Any], config_keys: dict[str, str],
               inputs: list[Path] = ()) -> bool:
    """True if running `stage` again would write the artifact that `artifact_dir` holds, so it can be reused.

    Its manifest must record this stage, config and keys, inputs of the same content, the same tool
    versions, and the same commit of a git checkout without local edits under src/ or stages/: code of
    unknown version, or edited since its commit, always runs again. A damaged artifact is not current."""
    version = code_version()
    if "+" not in version or version.endswith("-dirty"):
        return False
    try:
        manifest = read_manifest(artifact_dir)
        return (manifest.get("stage") == stage and manifest.get("code_version") == version
                and manifest.get("config_keys") == config_keys
                and manifest.get("config") == json.loads(json.dumps(config))
                and manifest.get("inputs") == {str(p): content_hash(read_manifest(p)) for p in inputs}
                and manifest.get("tool_versions") == tool_versions())
    except ArtifactError:
        return False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Swap `tmp` into `final` (replacing an older artifact) so readers never see a partial one."""
    with _lock(final.parent / f".{final.name}.lock"):
        trash = None
        if final.exists():
            trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
        os.rename(tmp, final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_artifact(final: Path, *, stage: str, config: dict[str, Any], config_keys: dict[str, str],
                    inputs: list[Path] = ()) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success publish it with its manifest, else delete it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    start = time.perf_counter()
    try:
        yield tmp
        files = {p.relative_to(tmp).as_posix(): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "stage": stage,
            "config_keys": config_keys,
            "config": config,
            "config_hash": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
            "inputs": {str(p): content_hash(read_manifest(p)) for p in inputs},
            "files": files,
            "code_version": code_version(),
            "tool_versions": tool_versions(),
            "wall_time_s": round(time.perf_counter() - start, 3),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
