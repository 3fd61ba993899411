"""native/check_built.py: a native part the build could not compile is named, and fails the run where required."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "native" / "check_built.py"

PYPROJECT = """
[tool.setuptools]
ext-modules = [
    {name = "alpha._fast", sources = ["alpha/_fast.c"], optional = true},
    {name = "beta._quick", sources = ["beta/_quick.c"], optional = true},
]
"""


@pytest.fixture
def check_built():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_built", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a_tree(root: Path, built: list[str]) -> Path:
    (root / "pyproject.toml").write_text(PYPROJECT)
    for name in built:
        *package, leaf = name.split(".")
        folder = root.joinpath(*package)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / (leaf + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    return root


def test_a_part_the_build_left_out_is_named_and_fails_where_required(
        check_built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    root = a_tree(tmp_path, built=["alpha._fast"])
    assert check_built.missing(root) == ["beta._quick"]
    monkeypatch.setenv("NATIVE_REQUIRED", "1")
    assert check_built.main(root) == 1
    err = capsys.readouterr().err
    assert "native part not built from its source: beta._quick" in err and "alpha._fast" not in err
    # outside CI the package still installs: the part falls back to its slower path, and the line says so
    monkeypatch.setenv("NATIVE_REQUIRED", "0")
    assert check_built.main(root) == 0
    assert "native part not built from its source: beta._quick" in capsys.readouterr().err


def test_a_complete_build_passes_quietly(check_built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = a_tree(tmp_path, built=["alpha._fast", "beta._quick"])
    monkeypatch.setenv("NATIVE_REQUIRED", "1")
    assert check_built.main(root) == 0
    out = capsys.readouterr()
    assert out.err == "" and "2 of 2" in out.out


def test_make_venv_runs_the_check_after_the_install() -> None:
    text = (ROOT / "Makefile").read_text()
    install = text.index("pip install -q --disable-pip-version-check -e")
    check = text.index("native/check_built.py", install)
    assert check < text.index("touch $(STAMP)", install)
    assert "export NATIVE_REQUIRED=1" in (ROOT / ".ci" / "run").read_text()



def test_a_part_older_than_its_source_is_named_as_not_built(check_built, tmp_path: Path) -> None:
    """A build that fails leaves the last one that worked in place: a compiled file older than the source (or a
    header it depends on) is not the source's."""
    root = a_tree(tmp_path, built=["alpha._fast", "beta._quick"])
    source = root / "beta" / "_quick.c"
    source.write_text("int broken(")
    built = root / "beta" / ("_quick" + importlib.machinery.EXTENSION_SUFFIXES[0])
    os.utime(built, (built.stat().st_mtime - 60, built.stat().st_mtime - 60))
    assert check_built.missing(root) == ["beta._quick"]
