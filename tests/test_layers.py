"""The packages read bottom-up (docs/architecture.md): no import goes up a layer, no two packages import each
other, and no module imports another module's private names. Imports inside functions count too."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
"""(importing module, imported module) -> why it may go up. At most 2; none is needed today."""
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {}
"""(importing module, private name) -> why, until the named rewrite lands."""
FORBIDDEN_PEERS = {("comm", "slowdown"), ("comm", "workloads")}
"""Imports the layers allow but the design does not: the collective model stands without the slowdown model
and without the torch training code (issue 47)."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    names: tuple[str, ...]
    """Names taken from `imported` (empty for `import x` or when the names are modules themselves)."""
    line: int
    in_function: bool

    def where(self) -> str:
        scope = "inside a function" if self.in_function else "at module level"
        return f"{self.importer} line {self.line} imports {self.imported} ({scope})"


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p, SOURCE): p for p in sorted((SOURCE / "trainsim").rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every `trainsim` import in the file at `path`, `from a import b` resolved to module `a.b` where it is one."""
    tree = ast.parse(path.read_text(), str(path))
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              for node in ast.walk(fn) if node is not fn}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, (), node.lineno, id(node) in inside)
                      for alias in node.names if alias.name.split(".")[0] == "trainsim"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "trainsim":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    found.append(Import(name, submodule, (), node.lineno, id(node) in inside))
                else:
                    found.append(Import(name, base, (alias.name,), node.lineno, id(node) in inside))
    return found


def unit(module: str) -> str:
    """The package (or top-level module) of src/trainsim a module belongs to; 'trainsim' for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def documented_layers(text: str) -> dict[str, int]:
    """unit -> layer number from the numbered list under '## Layers': the backticked names before each item's
    first colon."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, item in re.findall(r"^(\d+)\. (.*)$", section, re.M):
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", item.split(":", 1)[0]):
            assert name not in layers, f"docs/architecture.md lists `{name}` in layers {layers[name]} and {number}"
            layers[name] = int(number)
    return layers


def all_imports() -> list[Import]:
    modules = source_modules()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, set(modules))]


def upward_imports(imports: list[Import], layers: dict[str, int]) -> list[Import]:
    return [imp for imp in imports if layers[unit(imp.imported)] > layers[unit(imp.importer)]
            and (imp.importer, imp.imported) not in ALLOWED_UPWARD]


def package_circles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one package in the package import graph (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        a, b = unit(imp.importer), unit(imp.imported)
        graph.setdefault(a, set())
        if a != b:
            graph[a].add(b)
    index, low, stack, circles = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def private_imports(imports: list[Import]) -> list[str]:
    return [f"{imp.where()}: {name}" for imp in imports for name in imp.names
            if name.startswith("_") and not name.startswith("__") and imp.importer != imp.imported
            and (imp.importer, name) not in ALLOWED_PRIVATE]


def test_every_package_has_a_layer():
    layers = documented_layers(ARCHITECTURE.read_text())
    missing = sorted({unit(m) for m in source_modules()} - set(layers))
    assert not missing, f"docs/architecture.md places no layer for {missing}; add each to the numbered list"


def test_no_import_goes_up_a_layer():
    assert len(ALLOWED_UPWARD) <= 2
    layers = documented_layers(ARCHITECTURE.read_text())
    bad = [f"{imp.where()}: layer {layers[unit(imp.importer)]} -> {layers[unit(imp.imported)]}"
           for imp in upward_imports(all_imports(), layers)]
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_no_circle_between_packages():
    assert package_circles(all_imports()) == []


def test_design_forbidden_peer_imports_are_absent():
    bad = [imp.where() for imp in all_imports() if (unit(imp.importer), unit(imp.imported)) in FORBIDDEN_PEERS]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules():
    known = set(source_modules())
    tests = [imp for path in sorted((ROOT / "tests").rglob("*.py"))
             for imp in imports_of(module_name(path, ROOT), path, known)]
    bad = private_imports(all_imports() + tests)
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_below_workloads_torch_stays_inside_functions():
    """The torch-free bottom: modules below `workloads` import torch only where a function needs it."""
    layers = documented_layers(ARCHITECTURE.read_text())
    bad = []
    for name, path in source_modules().items():
        if layers[unit(name)] >= layers["workloads"]:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{name} line {node.lineno}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """An upward import, a circle and a private import, written into a scratch module, are each found."""
    layers = {"config": 3, "timeline": 8}
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from trainsim.timeline.compose import _private\n")
    found = imports_of("trainsim.config.bad", bad, set())
    assert [i.imported for i in upward_imports(found, layers)] == ["trainsim.timeline.compose"]
    assert private_imports(found) and found[0].in_function
    back = Import("trainsim.timeline.compose", "trainsim.config.schema", (), 1, False)
    assert package_circles([*found, back]) == [["config", "timeline"]]
