"""Where every number of the configs and of the models comes from, checked by machine.

A number is sourced when a comment tag next to it says where it comes from:

  # cite: <source>     a datasheet, paper, model card, release's code or data file outside this repository's code
  # fit: <command>     the output of a fitting command in this repository (`python -m trainsim.x ...` or
                       `python benchmarks/x.py ...`); the module or script must exist
  # set: <what>        a number that states nothing about hardware or a model, so it has no source to cite:
                       a layout or toy shape a config asks for, a unit, an enum code, a format version, a
                       batch size, a timeout, a fitting method's setting

A trailing tag (a comment on the line of a YAML key or a Python assignment) sources that entry and everything
nested under it. In YAML, a tag among the comment lines right above a key opens a section: it sources that key
and the sibling keys after it, up to the next sibling with comment lines of its own (tagged or not); the block
that opens the file opens the first section of the top level (a model card's shape: one source per file). In
Python, the comment lines right above an assignment, or a line of the constant's docstring, source that constant
only. The nearest tag wins: trailing, then section, then the enclosing entry's. A tag's text runs on over the
comment lines that follow it.

Scope (what `numbers` reads):
  configs        conf/**/*.yaml, and the models' data files src/trainsim/comm/*.yaml (NCCL's constants, the
                 learned network priors): every unquoted numeric scalar
  model code     module-level assignments holding a numeric literal in the packages that turn a trace into
                 time (profile, comm, slowdown, timeline, what_if) and in workloads (the reference step whose
                 constants the trace records)
Not in scope: the schema's defaults (config/schema.py: the values of a field no config sets; every GPU config
sets its kernel model), tests, benchmarks and the validation package's readings of published tables (each
cites its table).
"""

from __future__ import annotations

import ast
import io
import re
import shlex
import tokenize
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainsim.config.data_path import CHECKOUT

CONFIG_GLOBS = ("conf/**/*.yaml", "src/trainsim/comm/*.yaml")
"""YAML files whose numbers need a source (relative to the repository root)."""
MODEL_CODE_GLOBS = ("src/trainsim/profile/*.py", "src/trainsim/comm/*.py", "src/trainsim/slowdown/*.py",
                    "src/trainsim/timeline/*.py", "src/trainsim/what_if.py", "src/trainsim/workloads/*.py")
"""Python modules whose module-level numeric constants need a source."""
TAG = re.compile(r"^\s*#?\s*(cite|fit|set):\s*(\S.*)$")
"""A tag: a comment (or docstring line) that opens with `cite:`, `fit:` or `set:` and says something."""


@dataclass(frozen=True)
class Number:
    """One number in scope and the tag that sources it ('' when none)."""

    path: str
    """file, relative to the repository root"""
    line: int
    """1-based line of the number (YAML) or of its assignment (Python)"""
    name: str
    """dotted field path (YAML) or constant name (Python)"""
    value: str
    source: str
    """'cite: ...', 'fit: ...', 'set: ...' or ''"""

    def where(self) -> str:
        return f"{self.path}:{self.line} {self.name} = {self.value}"


def unsourced_constants(root: Path | None = None) -> list[str]:
    """Every number in scope without a tag, or whose `fit:` names no command of this repository, as
    'file:line name = value (what is missing)'. Empty when every number has a source."""
    root = Path(root) if root is not None else CHECKOUT
    problems = []
    for number in numbers(root):
        if not number.source:
            problems.append(f"{number.where()} (no '# cite:', '# fit:' or '# set:' comment next to it or above "
                            "an enclosing entry)")
        elif number.source.startswith("fit:") and (missing := missing_fit_command(number.source, root)):
            problems.append(f"{number.where()} ({missing})")
    return problems


def numbers(root: Path | None = None) -> list[Number]:
    """Every number in scope with its source, file by file."""
    root = Path(root) if root is not None else CHECKOUT
    found: list[Number] = []
    for pattern in CONFIG_GLOBS:
        for path in sorted(root.glob(pattern)):
            found += yaml_numbers(path, root)
    for pattern in MODEL_CODE_GLOBS:
        for path in sorted(root.glob(pattern)):
            found += python_numbers(path, root)
    return found


def missing_fit_command(source: str, root: Path) -> str:
    """'' when a `fit:` tag's command exists in the repository, else what is wrong. The command is the tag's
    first `backquoted` span, else its text up to ' (', ';' or ','."""
    text = source.removeprefix("fit:").strip()
    quoted = re.search(r"`([^`]+)`", text)
    command = quoted.group(1) if quoted else re.split(r" \(|;|,", text)[0]
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
        module = root / "src" / Path(*words[2].split("."))
        if module.with_suffix(".py").is_file() or (module / "__main__.py").is_file():
            return ""
        return f"fit command {command!r}: no module {words[2]} under src/ (accepted: `python -m trainsim.<module>` " \
               "or `python <script in this repository>`)"
    if len(words) >= 2 and words[0] in ("python", "python3"):
        if (root / words[1]).is_file():
            return ""
        return f"fit command {command!r}: no script {words[1]} in the repository"
    return (f"fit command {command!r} is neither `python -m trainsim.<module> ...` nor `python <script> ...` "
            "(accepted: those two forms, naming a module or script of this repository)")


def _tag_in(lines: list[str]) -> str:
    """The last tag among comment lines, with its continuation lines joined."""
    tag, parts = "", []
    for line in lines:
        match = TAG.match(line)
        if match:
            tag, parts = match.group(1), [match.group(2).strip()]
        elif tag:
            parts.append(line.strip().lstrip("#").strip())
    return f"{tag}: {' '.join(p for p in parts if p)}" if tag else ""


def _block_above(lines: list[str], index: int) -> list[str]:
    """The comment-only lines right above 0-based line `index`, top first."""
    block = []
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
        block.insert(0, lines[index])
    return block


def _trailing_comment(line: str) -> str:
    """A YAML line's comment after its content ('' when none); a '#' opens one after a blank, outside quotes."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[i:]
    return ""


def _trailing_tag(lines: list[str], index: int) -> str:
    trailing = _trailing_comment(lines[index])
    return _tag_in([trailing]) if trailing and TAG.match(trailing) else ""


def _sections(lines: list[str], starts: list[int], enclosing: str) -> list[str]:
    """The tag of each sibling entry starting on 0-based lines `starts`: its trailing tag, else the section it
    is in (opened by the comment lines above it or above an earlier sibling), else the enclosing entry's."""
    section, tags = "", []
    for index in starts:
        block = _block_above(lines, index)
        if block:
            section = _tag_in(block)
        tags.append(_trailing_tag(lines, index) or section or enclosing)
    return tags


def _is_number(node: yaml.ScalarNode) -> bool:
    if node.style is not None:  # quoted or block text
        return False
    if node.tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        return True
    try:
        float(node.value)
    except ValueError:
        return False
    return node.value.strip().lower().lstrip("+-.") not in ("inf", "nan", "infinity")


def yaml_numbers(path: Path, root: Path) -> list[Number]:
    """The numeric scalars of one YAML file with their sources."""
    text = path.read_text()
    lines = text.splitlines()
    relative = str(path.relative_to(root))
    tree = yaml.compose(text)
    if tree is None:
        return []
    found: list[Number] = []

    def walk(node, name: str, tag: str) -> None:
        if isinstance(node, yaml.MappingNode):
            tags = _sections(lines, [key.start_mark.line for key, _ in node.value], tag)
            for (key, value), entry_tag in zip(node.value, tags):
                walk(value, f"{name}.{key.value}" if name else str(key.value), entry_tag)
        elif isinstance(node, yaml.SequenceNode):
            tags = _sections(lines, [item.start_mark.line for item in node.value], tag)
            for i, (item, entry_tag) in enumerate(zip(node.value, tags)):
                walk(item, f"{name}[{i}]", entry_tag)
        elif isinstance(node, yaml.ScalarNode) and _is_number(node):
            found.append(Number(relative, node.start_mark.line + 1, name, node.value, tag))

    walk(tree, "", "")
    return found


def _comments_by_line(source: str) -> dict[int, str]:
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def _has_number(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
               for n in ast.walk(node))


def python_numbers(path: Path, root: Path) -> list[Number]:
    """The module-level numeric constants of one Python module with their sources."""
    source = path.read_text()
    lines = source.splitlines()
    comments = _comments_by_line(source)
    relative = str(path.relative_to(root))
    body = ast.parse(source).body
    found = []
    for i, statement in enumerate(body):
        if not isinstance(statement, (ast.Assign, ast.AnnAssign)) or statement.value is None:
            continue
        if not _has_number(statement.value):
            continue
        own = [comments[n] for n in range(statement.lineno, statement.end_lineno + 1) if n in comments]
        tag = _tag_in([c for c in own if TAG.match(c)][-1:])
        following = body[i + 1] if i + 1 < len(body) else None
        if not tag and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str):
            tag = _tag_in(following.value.value.splitlines())
        if not tag:
            tag = _tag_in(_block_above(lines, statement.lineno - 1))
        target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
        found.append(Number(relative, statement.lineno, ast.unparse(target),
                            ast.unparse(statement.value)[:80], tag))
    return found
