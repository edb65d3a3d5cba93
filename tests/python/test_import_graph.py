"""The mixlens package has no import cycle (issue 28 item 4): the modules form layers (errors, _args,
_convert, ... below _inputs / _envoy / _tracer, below _model, below the package), so each can be read and
imported on its own.

Every import of a mixlens module counts, wherever it is written: one inside a function (the way a cycle
used to be held together) is an edge like a module-level one. Imports under ``if TYPE_CHECKING:`` are
annotations only and never run, so they are left out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "mixlens"


def _modules(package: Path) -> dict[str, Path]:
    """{dotted name: file} of the package's Python modules ('mixlens' is its __init__.py)."""
    out = {}
    for f in sorted(package.glob("*.py")):
        out["mixlens" if f.stem == "__init__" else f"mixlens.{f.stem}"] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node of the tree, outside `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the mixlens modules it imports}, from the source (relative and absolute imports)."""
    mods = _modules(package)
    native = {f"mixlens.{f.name.split('.')[0]}" for f in package.glob("*.pyi")}  # _core: a compiled module
    known = set(mods) | native
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert node.level <= 1, f"{path.name}: import from beyond the package ({ast.dump(node)})"
                base = node.module if node.level == 0 else "mixlens" + (f".{node.module}" if node.module else "")
                # `from . import x`: the module x when there is one, else a name of the package's __init__.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                # `import mixlens.x.y` counts as importing x (its parent package is always initialised first).
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t.startswith("mixlens") and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_the_mixlens_modules_import_each_other_without_a_cycle():
    graph = import_graph(PACKAGE)
    assert "mixlens._model" in graph and "mixlens._tracer" in graph["mixlens._model"]  # the graph is read
    cycle = find_cycle(graph)
    assert not cycle, "import cycle among the mixlens modules: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_held_by_an_import_inside_a_function(tmp_path):
    """The check itself: a lower module importing a higher one inside a function is a cycle."""
    pkg = tmp_path / "mixlens"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._model import load\n")
    (pkg / "_args.py").write_text("def check(x):\n    from ._model import Model\n    return isinstance(x, Model)\n")
    (pkg / "_model.py").write_text("from typing import TYPE_CHECKING\nfrom . import _args\n"
                                   "if TYPE_CHECKING:\n    import mixlens\nclass Model: ...\n")
    cycle = find_cycle(import_graph(pkg))
    assert cycle[0] == cycle[-1] and sorted(cycle[1:]) == ["mixlens._args", "mixlens._model"], cycle
    (pkg / "_args.py").write_text("def check(x):\n    return x\n")
    assert find_cycle(import_graph(pkg)) == []


@pytest.mark.parametrize("module", sorted(m for m in _modules(PACKAGE) if m != "mixlens"))
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    """Each module loads first in a new interpreter, with the package's __init__ not run (an empty package
    object over the installed folder), so no import order set up by __init__ hides a cycle."""
    code = ("import importlib.util, sys, types\n"
            "spec = importlib.util.find_spec('mixlens')\n"
            "pkg = types.ModuleType('mixlens')\n"
            "pkg.__path__ = list(spec.submodule_search_locations)\n"
            "sys.modules['mixlens'] = pkg\n"
            f"import {module}\n"
            "assert 'mixlens' in sys.modules and sys.modules['mixlens'] is pkg, 'the package __init__ ran'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
