"""The project's import graph as an ast walk sees it: every import statement, wherever it is (inside functions and
under TYPE_CHECKING too), so that a circle hidden in a function body is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cfemu", "sqm", "backup", "restore", "qsg")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(*package_dirs: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules (of the packages in ``package_dirs``) it names in any import statement; a name
    imported from a package that is a module of it counts as that module."""
    modules = {module_name(p, root): p for d in package_dirs for p in d.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    base = ".".join(up[: len(up) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges[m] |= {t for t in targets if t in modules and t != m}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def project_graph() -> dict[str, set[str]]:
    return graph(*(ROOT / p for p in PACKAGES))
