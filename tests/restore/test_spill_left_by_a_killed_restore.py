"""A restore killed with SIGKILL (the OOM killer, an operator) never removes its spill directory; the next restore
removes those their makers left behind, and never one a live restore is using (its maker's flock on the lock file
inside says so: the kernel lets go of it when the maker dies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backup.run import run_backup
from restore import spill as spill_module
from restore.run import WORK_DIR, run_restore
from restore.spill import MAKING, SpillDir
from tests.restore.test_group_history import settings_env
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
PREFIX = ".restore-spill-"

pytestmark = pytest.mark.slow


def _spill_dirs(work: Path) -> list[Path]:
    return sorted(work.glob(f"{PREFIX}*")) if work.is_dir() else []


def _made_or_making(work: Path) -> list[Path]:
    return sorted([*work.glob(f"{PREFIX}*"), *work.glob(f"{MAKING}*")]) if work.is_dir() else []


def test_the_next_restore_removes_the_spill_directory_of_a_restore_killed_with_sigkill(redis_url: str,
                                                                                        tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    c = qm.connect()
    run_backup(client, S, backups, log_root=logs)
    for i in range(6000):
        c.put("Q1", f"M{i:05d}".encode() + b"." * 100)
        if i % 500 == 499:
            c.commit()
    c.commit()
    truth = sorted(m.body for m in c.browse("Q1", limit=10_000))
    qm.stop()
    lose_cf(client)
    work = backups / WORK_DIR
    env = {**os.environ, **settings_env(redis_url, logs, backups)}
    killed: list[Path] = []
    for _ in range(3):  # a restore that ends before its spill directory is seen is run again
        p = subprocess.Popen([sys.executable, "-m", "restore.cli", "run", S], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not _spill_dirs(work) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            killed = _spill_dirs(work)
            if killed:
                break
        lose_cf(client)
    assert killed, "no restore was caught with its spill directory"
    r = run_restore(client, S, backup_root=backups, log_root=logs)
    assert r.records_by_member is not None
    assert _made_or_making(work) == []
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        assert sorted(m.body for m in qm.connect().browse("Q1", limit=10_000)) == truth
    finally:
        qm.stop()


def test_a_spill_directory_in_use_by_a_live_process_is_left_alone(tmp_path: Path) -> None:
    work = tmp_path / "work"
    maker = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from restore.spill import SpillDir; "
                               f"s = SpillDir(Path({str(work)!r})); print(s.path, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None
        theirs = Path(maker.stdout.readline().strip())
        with SpillDir(work) as mine:
            assert theirs.is_dir() and mine.removed == []
        os.kill(maker.pid, signal.SIGKILL)
        maker.wait()
        with SpillDir(work) as mine:
            assert mine.removed == [theirs] and not theirs.exists()
    finally:
        if maker.poll() is None:
            maker.kill()
            maker.wait()


def test_a_spill_directory_is_never_seen_under_its_name_before_its_lock_is_held(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore killed between making its directory and locking it would leave one that looks in use for
    UNLOCKED_GRACE_S: the directory takes its name only once locked."""
    work = tmp_path / "work"
    seen: list[list[Path]] = []
    hold = spill_module._hold

    def watching(path: Path) -> int:
        seen.append(_spill_dirs(work))
        return hold(path)

    monkeypatch.setattr(spill_module, "_hold", watching)
    with SpillDir(work) as s:
        assert s.path.name.startswith(PREFIX) and (s.path / ".owner").exists()
    assert seen == [[]]


def test_a_directory_left_while_being_made_is_removed_by_a_restore_once_old(tmp_path: Path) -> None:
    """A directory still under its making name may be one another restore is making (its lock not taken yet): a
    restore removes it only once older than UNLOCKED_GRACE_S, whatever its lock file says."""
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    young, left = work / f"{MAKING}new", work / f"{MAKING}old"
    for d in (young, left):
        d.mkdir(mode=0o700)
        (d / ".owner").touch()
    past = time.time() - spill_module.UNLOCKED_GRACE_S - 60
    os.utime(left, (past, past))
    with SpillDir(work) as mine:
        assert mine.removed == [left] and not left.exists() and young.exists()


def test_a_restore_making_its_directory_is_not_removed_by_another_restore(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another restore's clean-up between the lock file's creation and its flock: the lock could be taken then, and
    the directory was removed under its maker, which failed (FileNotFoundError at its rename)."""
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    removed_by_the_other: list[list[Path]] = []

    def slow_hold(path: Path) -> int:
        fd = spill_module.open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # the lock file, not locked yet
        removed_by_the_other.append(spill_module.remove_left_behind(work, keep=work / "none"))
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    monkeypatch.setattr(spill_module, "_hold", slow_hold)
    with SpillDir(work) as mine:
        assert mine.path.is_dir() and (mine.path / ".owner").exists()
    assert removed_by_the_other == [[]]
