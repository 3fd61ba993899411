"""Code, tests and the user's docs state rules, not the history of the issue tracker: an issue's or a hole's number means
nothing to a reader of the repository (the tracker is not part of it). The dated logs at the root (BENCHMARKS.md,
CHAOS-RESULTS.md) record when and why, and may name them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("cfemu", "sqm", "backup", "restore", "qsg", "bench", "tests", "docs", "examples")
CITATION = re.compile(r"\bissue [0-9]+|\bhole [0-9]+|\breview R[0-9]", re.IGNORECASE)


def citations(files: list[Path], root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{n}" for p in files
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if CITATION.search(line)]


def checked_files() -> list[Path]:
    return sorted(p for top in CHECKED if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*")
                  if p.suffix in (".py", ".md", ".lua", ".c", ".h") and "__pycache__" not in p.parts)


def test_no_issue_or_hole_number_in_code_tests_or_docs() -> None:
    assert citations(checked_files()) == [], "state the rule and point at the doc that states it instead"


def test_the_check_sees_a_citation(tmp_path: Path) -> None:
    cited = tmp_path / "cited.py"
    cited.write_text("x = 1\n# the fix of Issue " + "7\n")
    assert citations([cited], tmp_path) == ["cited.py:2"]


def test_a_word_that_ends_in_hole_or_issue_is_not_a_citation(tmp_path: Path) -> None:
    prose = tmp_path / "prose.md"
    prose.write_text("closed unless its request head is whole 5 s after its accept\na reissue 3 times\n")
    assert citations([prose], tmp_path) == []
