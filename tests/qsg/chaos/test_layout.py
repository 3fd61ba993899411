"""The chaos package's modules form no import circle, counting imports inside functions and under TYPE_CHECKING
(an ast walk of every import statement, wherever it is)."""

from __future__ import annotations

from pathlib import Path

from tests.support import import_graph
from tests.support.import_graph import circles

PACKAGE = Path(__file__).resolve().parents[3] / "qsg" / "chaos"
PREFIX = "qsg.chaos"


def graph() -> dict[str, set[str]]:
    return import_graph.graph(PACKAGE)


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
