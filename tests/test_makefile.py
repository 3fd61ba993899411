"""The Makefile on a fresh clone: every target that runs something from the virtualenv makes the virtualenv first."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def phony_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^\.PHONY:(.*)$", text, re.MULTILINE)
    assert match, "the Makefile declares its targets .PHONY"
    return [t for t in match[1].split() if t not in ("venv", "clean")]


def stamp_prerequisites() -> list[str]:
    """The files the venv's stamp depends on (pyproject.toml and the C sources its build compiles)."""
    match = re.search(r"^\$\(STAMP\):([^|\n]*)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile has a rule for $(STAMP)"
    return match[1].split()


def test_the_venv_is_remade_when_any_c_source_the_build_compiles_changes() -> None:
    compiled = re.findall(r'"([\w/]+\.c)"', (ROOT / "pyproject.toml").read_text())
    assert compiled, "pyproject.toml lists the C sources of its extension modules"
    assert set(compiled) <= set(stamp_prerequisites())


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", phony_targets())
def test_a_target_on_a_fresh_clone_makes_the_venv_before_using_it(target: str, tmp_path: Path) -> None:
    # a fresh clone (what the venv is built from: the stamp's prerequisites): no .venv
    for name in ["Makefile", *stamp_prerequisites()]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    done = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    uses = [i for i, line in enumerate(lines) if ".venv/bin/" in line]
    if not uses:
        return
    made = [i for i, line in enumerate(lines) if "-m venv .venv" in line]
    assert made and made[0] < uses[0], f"make {target} uses .venv before making it:\n{done.stdout}"


def test_make_test_names_the_durations_file_in_one_word() -> None:
    """`--durations-file PATH` as two words: on the second run PATH exists, pytest takes it for the tests to run
    before the plugin that knows the option is loaded, and the run stops with 'unrecognized arguments'."""
    text = (ROOT / "Makefile").read_text()
    assert "--durations-file=" in text and "--durations-file " not in text


def test_ci_runs_every_tier_the_default_suite_leaves_out_for_length() -> None:
    """The e2e and deep tests are left out of `make test` for its length only: .ci/run runs their targets, and each
    target selects its marker (a dropped line or a mistyped -m would leave them run by nobody)."""
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    addopts = re.search(r"^addopts = (.*)$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert addopts
    for marker, target in (("e2e", "e2e-test"), ("deep", "deep-test")):
        assert f"not {marker} " in addopts[1], f"the default suite leaves {marker} out"
        assert re.search(rf"^make {target}$", ci, re.MULTILINE), f".ci/run runs make {target}"
        recipe = re.search(rf"^{target}: venv\n((?:\t.*\n)+)", makefile, re.MULTILINE)
        assert recipe, f"the Makefile has a {target} recipe"
        marks = re.search(r"^E2E_MARKS := (.*)$", makefile, re.MULTILINE) if marker == "e2e" else None
        selected = marks[1] if marks else recipe[1]
        assert re.search(rf"(^|-m |'){marker}\b", selected), f"make {target} selects the tests marked {marker}"
