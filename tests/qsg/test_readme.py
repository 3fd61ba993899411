"""The README's Python snippets and its migration commands, run as written: each Python snippet in a fresh
directory as a program of its own (its embedded CF, its queue managers), the migration commands with bash against a
real local group (`cfemu cluster up`, its backup scheduler running) and a second CF they start. The curl round trip
is tests/sqm/test_rest.py's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = Path(sys.executable).parent


def python_snippets() -> list[str]:
    """The snippets that run on their own; the kombu one runs beside a group (tests/qsg/test_kombu_transport.py)."""
    return [s for s in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
            if "qsg.kombu_transport" not in s]


def migration_commands() -> str:
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), re.DOTALL)
              if "cfemu migrate unload" in b]
    assert len(blocks) == 1, "the README shows the migration in one block"
    return blocks[0]


def clean_env() -> dict[str, str]:
    """What a user's shell has: the venv on PATH, none of the settings variables the test session sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CFEMU_", "SQM_", "REDIS_URL"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


# Each snippet and the last line it prints (its comment says what).
EXPECTED = ["b'order 1'", "PROCESSED True", "[b'part 1', b'part 2']"]


def test_the_readme_has_the_snippets_this_test_runs() -> None:
    assert len(python_snippets()) == len(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("number", range(len(EXPECTED)), ids=["api", "uow", "pubsub"])
def test_a_python_snippet_runs_as_written(number: int, tmp_path: Path) -> None:
    code = python_snippets()[number]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == EXPECTED[number], done.stdout


@pytest.mark.slow
def test_the_python_snippets_run_one_after_another_in_one_directory(tmp_path: Path) -> None:
    """As a reader runs them: each snippet in the same directory as the one before, whose var/ (its CF's data, its
    members' logs) is still there; each runs again there too."""
    for number in (*range(len(EXPECTED)), 0):
        done = subprocess.run([sys.executable, "-c", python_snippets()[number]], cwd=tmp_path, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == EXPECTED[number], done.stdout
    assert (tmp_path / "var").is_dir()


@pytest.mark.slow
def test_the_migration_commands_run_as_written_against_a_local_group(tmp_path: Path) -> None:
    env = clean_env()

    def sh(script: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    try:
        up = sh("cfemu cluster up --managers 1 --backup-interval 1 && cfemu put Q1 one two three")
        assert up.returncode == 0, up.stderr
        done = sh(migration_commands())
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "equal: the" in done.stdout, done.stdout
        status = sh("cfemu migrate status APP1 --json")
        assert '"MIGRATED"' in status.stdout, (status.stdout, status.stderr)
    finally:
        sh("cfemu cf stop --dir var/qsg2 || true; cfemu cluster down --dir var/cluster", timeout=120)
