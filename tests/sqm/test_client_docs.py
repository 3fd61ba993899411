"""docs/client.md is kept with the code: its table of errors lists every MQError subclass with its reason code and
name, the packages an application imports ship py.typed, and the guide's snippets run as written against a local
group (`cfemu cluster up`)."""

from __future__ import annotations

import importlib
import importlib.resources
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import sqm.service.client  # noqa: F401 - every class a client may raise is loaded
from cfemu.errors import MQError

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "client.md"
PACKAGES = ("cfemu", "sqm", "backup", "restore", "qsg")


def subclasses(cls: type[MQError]) -> list[type[MQError]]:
    found: list[type[MQError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *subclasses(sub)]
    return found


def error_rows() -> dict[str, tuple[str, str, str]]:
    """The errors table: class name -> (module, reason, reason name)."""
    rows = re.findall(r"^\| `(\w+)` \| ([\w.]+) \| ([^|]+) \| ([^|]+) \|", GUIDE.read_text(), re.MULTILINE)
    return {name: (module, reason.strip(), reason_name.strip()) for name, module, reason, reason_name in rows}


def test_the_errors_table_lists_every_mq_error_with_its_reason_code() -> None:
    rows = error_rows()
    classes: list[type[MQError]] = [MQError, *subclasses(MQError)]
    classes = [c for c in classes if c.__module__.split(".")[0] in PACKAGES]  # not a test's own subclass
    missing = [c.__name__ for c in classes if c.__name__ not in rows]
    assert not missing, f"docs/client.md's errors table lacks {missing}"
    for cls in classes:
        module, reason, reason_name = rows[cls.__name__]
        assert module == cls.__module__, cls
        if cls.__name__ == "BatchError":  # carries its cause's code
            assert (reason, reason_name) == ("its cause's", "its cause's")
            continue
        assert (reason, reason_name) == (str(cls.reason), cls.reason_name), cls
    stale = set(rows) - {c.__name__ for c in classes}
    assert not stale, f"rows for no class: {stale}"


def test_every_error_class_a_reply_may_name_is_in_the_table() -> None:
    from sqm.service.protocol import ERROR_CLASSES

    assert set(ERROR_CLASSES) <= set(error_rows())


def test_the_packages_ship_py_typed() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert "py.typed" in data.get(package, []), f"pyproject's package-data does not ship {package}/py.typed"
        assert importlib.resources.files(importlib.import_module(package)).joinpath("py.typed").is_file(), package


def test_an_application_s_mypy_strict_accepts_the_guide_s_code(tmp_path: Path) -> None:
    """The guide's code, as an application's, under mypy --strict: the client's calls are typed. The packages are
    read from the source tree (MYPYPATH; an editable install's import hook is not followed by mypy), their own
    modules' errors silenced as an installed package's are."""
    app = tmp_path / "app.py"
    app.write_text("\n".join(snippets()))
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir",
                           str(tmp_path / "cache"), str(app)], cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the guide, run as written -------------------------------------------------------------------------------------
def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)


def said_printed() -> list[str]:
    """What the guide says its prints print: each print's comment (on its line, else the comment line after it)."""
    said: list[str] = []
    lines = [line for code in snippets() for line in code.splitlines()]
    for i, line in enumerate(lines):
        if line.lstrip().startswith("print("):
            comment = line.partition("  # ")[2] or lines[i + 1].strip().removeprefix("# ")
            said.append(comment.strip())
    return said


def test_each_print_of_the_guide_says_what_it_prints() -> None:
    assert len(said_printed()) == 10 and all(said_printed()), said_printed()


@pytest.mark.slow
def test_the_guide_runs_as_written_against_a_local_group(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CFEMU_", "SQM_", "REDIS_URL"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    up = subprocess.run([str(bin_dir / "cfemu"), "cluster", "up", "--managers", "2", "--backup-interval", "0"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        done = subprocess.run([sys.executable, "-c", "\n".join(snippets())], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines() == said_printed()
    finally:
        subprocess.run([str(bin_dir / "cfemu"), "cluster", "down"], cwd=tmp_path, env=env, capture_output=True,
                       timeout=120)
