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


def _folder(module: str) -> str:
    """The folder a module belongs to, for the direction rules: jaxserve's subpackages (models'
    layers/ and loaders/ on their own), "base" for the top-level modules."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "models" and parts[2] in ("layers", "loaders"):
        return f"models.{parts[2]}"
    if len(parts) > 2 or (len(parts) == 2 and os.path.isdir(os.path.join(ROOT, parts[1]))):
        return parts[1]
    return "base"


# Folder -> the folders it must not import (ARCHITECTURE.md, "Which way the imports point"):
# server -> engine -> core / worker (spec_decode, structured) -> models -> pallas_kernels ->
# models/layers.
ABOVE_MODELS = {"worker", "engine", "server", "spec_decode", "structured", "sample", "bench",
                "train_draft", "cli"}
MUST_NOT_IMPORT = {
    "models.layers": ABOVE_MODELS | {"models", "models.loaders", "pallas_kernels", "sharding", "core"},
    "pallas_kernels": ABOVE_MODELS | {"models", "models.loaders", "sharding", "core"},
    "sharding": ABOVE_MODELS | {"models", "models.loaders", "core"},
    "models": ABOVE_MODELS,
    "models.loaders": ABOVE_MODELS,
    "core": ABOVE_MODELS - {"sample"} | {"models", "models.loaders", "pallas_kernels", "sharding"},
    "sample": ABOVE_MODELS - {"sample"} | {"models", "models.loaders", "core"},
    "structured": {"worker", "engine", "server", "spec_decode", "bench", "train_draft", "models",
                   "models.loaders"},
    "worker": {"engine", "server", "spec_decode", "structured", "bench", "train_draft"},
    "spec_decode": {"engine", "server", "structured", "bench", "train_draft"},
    "engine": {"server", "bench", "train_draft"},
    "server": {"bench", "train_draft"},
    # text-only parsers, read by the server and the offline LLM.chat
    "parsers": ABOVE_MODELS | {"models", "models.loaders", "core", "pallas_kernels", "sharding"},
    # adapters' files, slots and requests: below the engine, beside core (which reads its
    # LoRARequest and slot bookkeeping)
    "lora": ABOVE_MODELS | {"models", "models.loaders", "core", "sharding"},
}


def test_the_folders_import_one_way():
    wrong = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                   if _folder(b) in MUST_NOT_IMPORT.get(_folder(a), ()))
    assert not wrong, "imports against the folders' direction:\n" + "\n".join(wrong)


def test_the_direction_check_sees_a_wrong_import():
    assert _folder("jaxserve.worker.runner") == "worker"
    assert _folder("jaxserve.models.layers.mla") == "models.layers"
    assert _folder("jaxserve.config") == "base"
    assert "spec_decode" in MUST_NOT_IMPORT[_folder("jaxserve.worker.runner")]
