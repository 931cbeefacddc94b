"""The package's shape: no module too big to read as one idea, no import cycle (lazy
imports inside functions count: they are cycles waiting for a refactor), and kernels that
never import mla_tune."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mla_tune"
MAX_LINES = 650


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        if "migrations" in p.parts or "__pycache__" in p.parts:
            continue
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _imports(path: Path) -> set[str]:
    """Every mla_tune module `path` imports, wherever in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in out if n.split(".")[0] == "mla_tune"}


def test_no_module_is_over_the_size_of_one_idea() -> None:
    big = {name: n for name, p in _modules().items()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_no_import_cycle_between_modules() -> None:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for target in _imports(p):
            r = resolve(target)
            # A module may import its own package (its __init__ re-exports it).
            if r and r != m and not m.startswith(r + "."):
                graph[m].add(r)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_kernels_never_import_mla_tune() -> None:
    for p in (ROOT / "kernels").rglob("*.py"):
        assert not _imports(p), p
