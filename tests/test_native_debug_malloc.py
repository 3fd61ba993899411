"""The native parts' own tests under Python's debug allocator (PYTHONMALLOC=debug): it stops the process on a
PyMem_Malloc-family call made without the GIL, a write past a block's end and a block freed twice, which the
release allocator lets pass as memory corrupted at random later. The readers, the backup's framing and the bulk
load's reads run parts of their work without the GIL (beside DuckDB's threads, or waiting on a socket)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NATIVE_TESTS = [
    "tests/restore/test_columns.py",
    "tests/backup/test_frames_native.py",
    "tests/cfemu/test_bulk_read_native.py",
    "tests/cfemu/test_bulk_parts_native.py",
]


@pytest.mark.deep
@pytest.mark.timeout(600)
def test_the_native_parts_tests_pass_under_the_debug_allocator(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-x", "--basetemp", str(tmp_path / "t"), *NATIVE_TESTS],
                          cwd=ROOT, capture_output=True, text=True, timeout=580,
                          env={**os.environ, "PYTHONMALLOC": "debug"})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert " passed" in done.stdout and "Fatal Python error" not in done.stderr
