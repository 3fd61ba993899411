"""A backup or restore whose disk fills: one line naming the directory it wrote under and what that leaves, where the
system's "[Errno 28] No space left on device" named neither. The kernel's own ENOSPC: /dev/full for the rule, and a
real 1 MiB tmpfs under the backup directory for cfbackup (as root, which mounting needs; CI runs as root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.durable import DiskFullError, disk_full_named
from tests.support.cfbackup import cfbackup, group_to_back_up


def test_a_full_disk_is_said_with_the_directory_and_what_it_leaves(tmp_path: Path) -> None:
    with pytest.raises(DiskFullError) as e, disk_full_named(tmp_path, "nothing was kept"), \
            open("/dev/full", "wb", buffering=0) as full:
        full.write(b"x")
    assert str(e.value) == f"no space left on the device of {tmp_path} (No space left on device): nothing was kept"
    assert isinstance(e.value, OSError) and e.value.errno == 28
    with pytest.raises(PermissionError), disk_full_named(tmp_path, "-"):  # any other error is left as it is
        raise PermissionError(13, "denied")


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root (CI runs as root)")
def test_cfbackup_into_a_full_disk_names_it_and_keeps_nothing(redis_url: str, tmp_path: Path) -> None:
    env = group_to_back_up(redis_url, tmp_path, 3000)
    with small_disk(tmp_path / "small", "256k") as small:
        run = cfbackup("run", "APP1", "--backup-dir", str(small), env=env)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert f"no space left on the device of {small / 'APP1'}" in run.stderr, run.stderr
        assert "the backup was not kept" in run.stderr
        assert not (small / "APP1").exists() or not any((small / "APP1").iterdir()), "the partial backup is gone"
    again = cfbackup("run", "APP1", env=env)  # its mark was cleared: the next backup is not refused
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root (CI runs as root)")
def test_cfrestore_whose_backup_directory_fills_names_it(redis_url: str, tmp_path: Path) -> None:
    """The restore writes its spill files and its restore point under the backup directory."""
    env = group_to_back_up(redis_url, tmp_path, 3000)
    assert cfbackup("run", "APP1", env=env).returncode == 0
    with small_disk(tmp_path / "small", "2m") as small:
        shutil.copytree(tmp_path / "bk", small, dirs_exist_ok=True)
        free = shutil.disk_usage(small).free
        (small / "filler").write_bytes(b"\0" * max(0, free - 16 * 1024))  # 16 KiB left for the restore's writes
        done = subprocess.run([sys.executable, "-m", "restore.cli", "run", "APP1", "--mark-failed", "--backup-dir", str(small)],
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"no space left on the device of {small}" in done.stderr, done.stderr
    assert "structure APP1 is not restored" in done.stderr
