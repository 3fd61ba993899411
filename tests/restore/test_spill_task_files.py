"""Spill files written by another process's task into a spill directory it shares (restore.spill.share and
TaskFiles): a task that shares it writes its files whole, one that does not is told so, and a task run twice leaves
one whole file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from restore.spill import SHARED, SpillDir, TaskFiles, read_frames, share


def test_a_task_that_shares_the_directory_writes_its_files_whole(tmp_path: Path) -> None:
    with SpillDir(tmp_path) as spill:
        token = share(spill)
        files = TaskFiles.open(spill.path, token, 3)
        assert files is not None
        files.limit = 64  # several writes of the part file before it is renamed
        for n in range(100):
            files.add("run", [n, "x" * 10])
        files.add("gone", ["e1", "consumed"])
        assert not (spill.path / "run-3").exists()  # nothing under the final name before commit
        sizes = files.commit()
        assert [f[0] for f in read_frames(spill.file("run-3"))] == list(range(100))
        assert list(read_frames(spill.file("gone-3"))) == [["e1", "consumed"]]
        assert sizes == {"run": spill.file("run-3").stat().st_size, "gone": spill.file("gone-3").stat().st_size}
        assert not list(spill.path.glob("*.part"))
        assert oct(spill.file("run-3").stat().st_mode & 0o777) == oct(0o600)  # message bodies: the owner's only


def test_a_task_run_twice_leaves_one_whole_file_and_a_failed_one_none(tmp_path: Path) -> None:
    with SpillDir(tmp_path) as spill:
        token = share(spill)
        first, second, failed = (TaskFiles.open(spill.path, token, 0) for _ in range(3))
        assert first is not None and second is not None and failed is not None
        for files in (first, second, failed):
            files.limit = 16
        for n in range(50):  # the two attempts interleaved, as a retry beside a lost first attempt may be
            first.add("run", n)
            second.add("run", n)
            failed.add("run", n)
        first.commit()
        second.commit()
        failed.abort()
        assert list(read_frames(spill.file("run-0"))) == list(range(50))
        assert not list(spill.path.glob("*.part"))


@pytest.mark.parametrize("how", ["another token", "no token file", "no such directory"])
def test_a_task_that_does_not_share_the_directory_is_told_so(tmp_path: Path, how: str) -> None:
    with SpillDir(tmp_path) as spill:
        token = share(spill)
        path = spill.path
        if how == "another token":
            token = "another restore's"
        elif how == "no token file":
            os.unlink(spill.file(SHARED))
        else:
            path = tmp_path / "elsewhere" / spill.path.name
        assert TaskFiles.open(path, token, 0) is None
