"""The chaos package's modules form no import circle, counting imports inside functions and under TYPE_CHECKING
(an ast walk of every import statement, wherever it is); and its comments state rules, not the history of issues."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "qsg" / "chaos"
PREFIX = "qsg.chaos"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """Module -> the qsg.chaos modules it names in any import statement (a name imported from a package that is
    a module of it counts as that module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if not node.level else ".".join(m.split(".")[:-node.level] + [node.module])
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


def test_no_import_circle_among_the_chaos_modules() -> None:
    edges = graph()
    assert "qsg.chaos.history" in edges["qsg.chaos.uowcheck"], "the walk sees the checkers' imports"
    assert circles(edges) == []


def test_the_checkers_are_siblings() -> None:
    edges = graph()
    checkers = {"qsg.chaos.checker", "qsg.chaos.uowcheck", "qsg.chaos.pubsubcheck"}
    assert not edges["qsg.chaos.uowcheck"] & checkers and not edges["qsg.chaos.pubsubcheck"] & checkers


def test_a_fault_family_imports_no_other_family_nor_the_package() -> None:
    edges = graph()
    families = {f"{PREFIX}.faults.{n}" for n in ("cf_loss", "clients", "links", "members", "pstore")}
    for f in families:
        assert not edges[f] & (families | {f"{PREFIX}.faults"}), f


def test_comments_cite_rules_not_issue_numbers() -> None:
    cited = [f"{p.relative_to(PACKAGE)}:{n}" for p in sorted(PACKAGE.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"issue [0-9]+|hole [0-9]+", line,
                                                                                    re.IGNORECASE)]
    assert cited == [], "state the rule and point at docs/chaos.md or docs/invariants.md instead"
