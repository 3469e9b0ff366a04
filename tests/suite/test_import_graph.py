"""Seams between files: no circle of modules that import each other, no private name read across modules.

Every import of the package is read from the source (module level, inside functions, under `TYPE_CHECKING`):
an import hidden in a function hides a circle from Python, not from a reader. A name used in another file is an
interface, so it is public (no leading underscore) and documented where it lives. The checker runs on the real
tree and on planted trees, so each rule is shown to fail when broken.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("utils", "kernels", "core_parallel", "diffusion", "fastfold", "recipes", "suite")


@dataclass
class Graph:
    """Modules by dotted name (`fastfold.data.parsers`; a package is its folder's name), the modules each one
    imports, and each private name one module takes from another (`where`: file and line)."""

    files: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[str] = field(default_factory=list)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _owner(files: dict[str, Path], dotted: str) -> str | None:
    """The module a dotted name lives in: the longest prefix that is a module of the tree."""
    while dotted and dotted not in files:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a relative `from ... import` names (absolute imports name no project module here:
    test_namespace checks that imports inside the project are relative)."""
    if node.level == 0:
        return node.module or ""
    parts = name.split(".") if name else []
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _read(graph: Graph, root: Path, name: str, path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    edges = graph.edges.setdefault(name, set())
    bound: dict[str, str] = {}  # local name -> project module it stands for (for `module._name` reads)
    where = path.relative_to(root).as_posix()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _base(name, is_package, node)
        for alias in node.names:
            if f"{base}.{alias.name}" in graph.files:  # `from . import module`
                target = f"{base}.{alias.name}"
                bound[alias.asname or alias.name] = target
            else:
                target = _owner(graph.files, base)
                if target is None:
                    continue
                if target != name and alias.name.startswith("_") and not alias.name.startswith("__"):
                    graph.private.append(f"{where}:{node.lineno}: {name} imports {alias.name} from {target}")
            if target != name:
                edges.add(target)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            target = bound[node.value.id]
            if target != name and node.attr.startswith("_") and not node.attr.startswith("__"):
                graph.private.append(f"{where}:{node.lineno}: {name} reads {target}.{node.attr}")


def read_graph(root: Path, folders: tuple[str, ...]) -> Graph:
    graph = Graph()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            graph.files[_module_name(root, path)] = path
    for name, path in graph.files.items():
        _read(graph, root, name, path)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph.files:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: Graph, component: list[str]) -> str:
    members = set(component)
    arrows = [f"{a} -> {b}" for a in component for b in sorted(graph.edges.get(a, ())) if b in members]
    return f"circle of {len(component)} modules: " + "; ".join(arrows)


@pytest.fixture(scope="module")
def project() -> Graph:
    return read_graph(ROOT, FOLDERS)


def test_the_checker_reads_the_whole_package(project):
    assert len(project.files) > 150
    assert "fastfold" in project.files and "core_parallel.gemini" in project.files
    assert sum(len(e) for e in project.edges.values()) > 300


def test_no_circle_of_files(project):
    found = circles(project)
    assert not found, "\n".join(_describe(project, c) for c in found)


def test_no_private_name_taken_across_modules(project):
    assert not project.private, "\n".join(project.private)


# --------------------------------------------------------------------------------- the checker on planted trees


def _plant(root: Path, files: dict[str, str]) -> Graph:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return read_graph(root, ("pkg",))


def test_a_planted_circle_through_a_lazy_import_fails(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/sub/__init__.py": "",
        "pkg/b.py": "def g():\n    from .sub.c import h\n    return h()\n",
        "pkg/sub/c.py": "def h():\n    from ..a import f\n    return f\n",
        "pkg/d.py": "from .a import f\n",  # imports into the circle, not part of it
    })
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert "pkg.sub.c -> pkg.a" in _describe(graph, circles(graph)[0])


def test_a_package_and_its_module_importing_each_other_is_a_circle(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "from .m import public\nCONSTANT = 1\n",
        "pkg/m.py": "from . import CONSTANT\n\npublic = CONSTANT\n",
    })
    assert circles(graph) == [["pkg", "pkg.m"]]


def test_a_planted_private_import_and_attribute_read_fail(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "_secret = 1\n__version__ = '1'\n\ndef _helper():\n    return _secret\n",
        "pkg/b.py": "from .a import __version__, _secret\n",
        "pkg/c.py": "from . import a\n\ndef f():\n    return a._helper(), a.__name__\n",
        "pkg/e.py": "def _own():\n    return 1\n\ndef f():\n    from .e import _own as o\n    return o()\n",
    })
    assert len(graph.private) == 2, graph.private
    assert "pkg.b imports _secret from pkg.a" in graph.private[0]
    assert "pkg.c reads pkg.a._helper" in graph.private[1]
    assert circles(graph) == []
