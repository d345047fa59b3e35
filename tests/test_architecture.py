"""The package's import graph: no circles between modules, and arrows between rooms one way only.

Imports are read from the source (`ast`), function-level ones included: a circle hidden inside a
function is still a circle. The allowed arrows are the ones docs/ARCHITECTURE.md draws.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raypipe"

# room -> the rooms it may import (besides itself). Entry points at the top, leaves at the bottom.
ALLOWED = {
    "cli": {"jobs", "serve", "bench", "gpucheck", "batch", "config", "models", "inputs", "errors"},  # bench: importlib by name
    # gpucheck: no Ray below it (tests/test_gpucheck.py runs it with Ray unimportable)
    "gpucheck": {"bench", "testing", "encode", "decode", "models", "inputs", "runtime", "errors"},
    "bench": {"testing", "serve", "batch", "pipeline", "config", "encode", "parallel", "decode", "models", "inputs",
              "runtime", "storage", "errors", "face"},
    "jobs": {"testing", "batch", "pipeline", "config", "inputs", "models", "runtime", "storage", "errors", "face"},
    "serve": {"pipeline", "config", "parallel", "decode", "models", "inputs", "runtime", "errors"},
    "testing": {"errors"},
    "face": {"pipeline", "inputs", "errors"},  # raypipe/__init__.py
    "batch": {"config", "encode", "parallel", "decode", "models", "inputs", "runtime", "storage", "errors"},
    "pipeline": {"config", "encode", "parallel", "decode", "models", "inputs", "runtime", "errors"},
    "config": {"decode", "encode", "models", "inputs", "errors"},
    "encode": {"models", "inputs", "runtime", "errors"},
    "parallel": {"decode", "models", "runtime", "errors"},
    "decode": {"models", "inputs", "runtime", "errors"},
    "models": {"inputs", "storage", "errors"},
    "inputs": {"errors"},
    "runtime": {"errors"},
    "storage": {"errors"},
    "errors": set(),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    parts = module.split(".")
    return "face" if len(parts) == 1 else parts[1]


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """raypipe modules `path` imports (a `from package import name` of a submodule counts as that submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "raypipe"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "raypipe":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(path, modules) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_arrows_between_rooms_run_one_way():
    wrong = sorted(f"{source} -> {target}" for source, targets in import_graph().items() for target in targets
                   if room(target) != room(source) and room(target) not in ALLOWED[room(source)])
    assert wrong == []


def test_every_room_is_declared():
    assert {room(module) for module in import_graph()} <= set(ALLOWED)


def test_the_rooms_themselves_form_no_circle():
    assert cycles({name: set(targets) for name, targets in ALLOWED.items()}) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
