"""No import circle anywhere in the project, counting imports inside functions and under TYPE_CHECKING (an ast
walk of every import statement): import-linter's contracts keep the floors and sqm's layers; this keeps each floor
free of circles inside it too (docs/architecture.md, "The floors")."""

from __future__ import annotations

from pathlib import Path

from tests.support.import_graph import circles, graph, project_graph


def test_the_project_has_no_import_circle() -> None:
    edges = project_graph()
    assert "sqm.core.manager" in edges["sqm.service.server"], "the walk sees imports across packages"
    assert "qsg.group_supervisor" in edges["qsg.local_group"], "and imports inside functions"
    assert circles(edges) == []


def test_the_walk_finds_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("from .c import y\n")
    assert sorted(circles(graph(pkg, root=tmp_path))) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
