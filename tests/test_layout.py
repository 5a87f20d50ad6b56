"""The house's rules, checked on the sources (ARCHITECTURE.md, "The folders"): no import cycle
among the product's modules (function-level imports included), dependencies pointing one way
between the folders, and every product file readable in one sitting."""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "jaxserve")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """jaxserve's module names -> their files."""
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxserve modules it imports anywhere in its file (module level, inside
    functions, under TYPE_CHECKING). `from pkg import name` counts as importing pkg.name when
    that is a module, else pkg; a module's own ancestor packages (imported implicitly by
    Python) are not counted."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:      # relative: from the package up level - 1 parents
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                if t in mods and t != name and not name.startswith(t + "."):
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_products_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_product_file_over_500_lines():
    long = {}
    for path in _modules().values():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[os.path.relpath(path, os.path.dirname(ROOT))] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"
