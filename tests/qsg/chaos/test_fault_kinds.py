"""A fault kind is one row: its function, number, cost, draw, tags and doc line in its family's file, and the rest
(KINDS, FAULTS, COST_S, the kind lists, docs/chaos.md's table, the package's list of families) agrees with the rows."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import qsg.chaos.faults as faults
from qsg.chaos.faults import (
    CF_LINK_KINDS,
    CLUSTER_SHORT_KINDS,
    COST_S,
    DUPLEX_KINDS,
    FAMILIES,
    FAULTS,
    KINDS,
    ROWS,
    SHORT_KINDS,
    docs_table,
    parse_kinds,
)

ROOT = Path(__file__).resolve().parents[3]
CHAOS_MD = ROOT / "docs" / "chaos.md"
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| (.*) \|$")
HELPERS = {"__init__", "kind", "heal", "restores"}  # the package's files that are no family


def docs_rows() -> list[tuple[str, str]]:
    """(kind, mechanism) of every row of docs/chaos.md's table of fault kinds (the table under '| kind |
    mechanism |')."""
    lines = CHAOS_MD.read_text().splitlines()
    start = lines.index("| kind | mechanism |") + 2
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        m = ROW.match(line)
        assert m, f"docs/chaos.md: a row of the kinds' table that names no single kind: {line[:80]}"
        out.append((m.group(1), m.group(2)))
    return out


def test_every_kind_has_its_docs_row_with_the_rows_doc_line() -> None:
    rows = docs_rows()
    named = [k for k, _ in rows]
    assert len(named) == len(set(named)), f"docs/chaos.md names a kind twice: {sorted(named)}"
    assert set(named) - set(KINDS) == set(), "docs/chaos.md has a row for a kind that does not exist"
    assert set(KINDS) - set(named) == set(), "a kind without its row in docs/chaos.md"
    for kind, doc in rows:
        assert doc == ROWS[kind].doc, f"{kind}: docs/chaos.md and its FaultKind row say different things"
    assert "\n".join(f"| `{k}` | {d} |" for k, d in rows) == "\n".join(docs_table().splitlines()[2:]), \
        "docs/chaos.md's rows in number order (faults.docs_table() prints them)"


def test_every_table_is_derived_from_the_rows() -> None:
    assert tuple(sorted(ROWS, key=lambda k: ROWS[k].number)) == KINDS
    assert [ROWS[k].number for k in KINDS] == list(range(1, len(KINDS) + 1)), "numbers are 1..n without a gap"
    assert set(FAULTS) == set(COST_S) == set(KINDS)
    assert all(FAULTS[k] is ROWS[k].run and COST_S[k] == ROWS[k].cost_s > 0 for k in KINDS)
    for kinds, place in ((SHORT_KINDS, "short"), (CLUSTER_SHORT_KINDS, "cluster_short")):
        assert [getattr(ROWS[k], place) for k in kinds] == list(range(1, len(kinds) + 1)), place
    assert set(CF_LINK_KINDS) == {k for k in KINDS if k.startswith("cf-link-")}
    assert not set(CLUSTER_SHORT_KINDS) & set(CF_LINK_KINDS)
    assert DUPLEX_KINDS == ("cf-kill-duplex-primary",) and not set(parse_kinds("all")) & set(DUPLEX_KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_kinds_row_sits_in_its_family_with_its_function(kind: str) -> None:
    row = ROWS[kind]
    module = inspect.getmodule(row.run)
    assert module in FAMILIES, f"{kind}: its function is in {module}, not in a family's module"
    source = Path(inspect.getfile(module)).read_text()  # type: ignore[arg-type]
    assert f'"{kind}"' in source, f"{kind}: its row is not in {module.__name__}, beside its function"
    assert row.doc and "|" not in row.doc and "\n" not in row.doc, f"{kind}: one docs line, no table cell breaks"


def test_the_package_docstring_lists_every_family() -> None:
    doc = faults.__doc__ or ""
    files = {p.stem for p in Path(faults.__file__).parent.glob("*.py")}
    families = {m.__name__.rsplit(".", 1)[1] for m in FAMILIES}
    assert files - HELPERS == families, "a file of qsg/chaos/faults/ that is neither a family nor a helper"
    for name in families:
        assert f"{name}.py" in doc, f"the package docstring does not list the family {name}.py"
