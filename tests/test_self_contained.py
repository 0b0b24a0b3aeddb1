"""A clone alone works: nothing outside docs/ names the shared folder beside our checkouts, and the data
the project uses is in data/, indexed and with its source."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from trainsim.config.data_path import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


def test_no_file_outside_docs_names_the_shared_folder():
    needle = "../" + "shared"  # spelt in two parts so that this file does not name it
    offenders = [str(p.relative_to(ROOT)) for p in _tracked_files()
                 if p.relative_to(ROOT).parts[0] != "docs" and needle in p.read_bytes().decode(errors="replace")]
    assert offenders == [], f"these files name {needle}, which a user's clone does not have"


def test_every_data_file_the_configs_name_is_in_the_repository():
    named = set()
    for config in (ROOT / "conf").rglob("*.yaml"):
        named |= set(re.findall(r"\bdata/[\w./-]+\.\w+", config.read_text()))
    assert named, "the GPU configs name their calibration and slowdown data"
    assert sorted(n for n in named if not (ROOT / n).is_file()) == []


def _brace_pattern_covers(index: str, relative: str) -> bool:
    """SOURCES.md names families of files as `a100-{2,4,8}gpu-...`."""
    for prefix, choices, suffix in re.findall(r"([\w./-]*)\{([\w.,]+)\}([\w./-]*)", index):
        if any(f"{prefix}{c}{suffix}" == relative for c in choices.split(",")):
            return True
    return False


def test_every_data_file_is_indexed_and_names_its_source():
    index = (DATA_DIR / "SOURCES.md").read_text()
    for path in DATA_DIR.rglob("*"):
        if not path.is_file() or path.name == "SOURCES.md" or path.parent.name == "kineto":
            continue
        relative = path.relative_to(DATA_DIR).as_posix()
        assert relative in index or _brace_pattern_covers(index, relative), f"data/{relative} is not in SOURCES.md"
        head = path.read_text(errors="replace").splitlines()[0].lower()
        assert "source" in head or head.startswith("#"), f"data/{relative} has no source header"
    kineto = (DATA_DIR / "kineto/README.md").read_text()
    assert all(p.name in kineto for p in (DATA_DIR / "kineto").glob("*.json.gz"))
