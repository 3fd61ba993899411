"""The partitioned plan's logs read by the worker processes while this process reads the backup (restore.partitioned,
_Background): a backup that fails, a worker killed mid-slice, an interrupt, each while the other side still
reads, comes out as its own error, promptly, leaving no worker process, no thread and no spill file. Real files,
real worker processes, real signals."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from backup.files import Backup, BackupWriter, CorruptFrameError, read_backup
from cfemu.entry import Entry
from restore.engine import READ_BACKUP, LocalEngine
from restore.workers import WorkerError
from tests.restore.test_partitioned import write_input
from tests.support.children import child_pids

S = "APP1"
R = 10**7


def _write(root: Path, n_backup: int, n_log: int) -> tuple[Backup, list[Path]]:
    """A backup of n_backup committed messages, and a log of n_log UOWs each putting and committing one (1 KiB)."""
    write_input(root, n_backup, n_log)
    return read_backup(root / "b"), [root / "logs" / "QM1"]


def _corrupt_frame(backup: Backup, which: float) -> None:
    """Flip a byte in a frame about `which` of the way through the backup's first entry file (its CRC then fails:
    CorruptFrameError when the reader gets there)."""
    path = backup.path / backup.manifest["files"][0]["name"]
    raw = bytearray(path.read_bytes())
    at = max(64, int(len(raw) * which))
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def _ours() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("restore-worker-", "restore-scan-logs")) and t.is_alive()]


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    return errors


def _left_nothing(work: Path, before: set[int], thread_errors: list[BaseException | None]) -> None:
    assert list(work.iterdir()) == []  # the spill directory removed
    assert child_pids() - before == set()  # no worker process left, none a zombie
    time.sleep(0.3)
    assert _ours() == []
    assert thread_errors == []


@pytest.mark.slow
@pytest.mark.parametrize("which", [0.0, 0.5])
def test_a_corrupt_backup_frame_while_the_workers_read_the_logs(tmp_path: Path, which: float,
                                                                thread_errors: list[BaseException | None]) -> None:
    """The backup's reader fails (its first frame, or one half way) while the workers still read the logs'
    slices: the backup's error comes out, at once (not once the workers have read the logs), nothing left."""
    backup, logs = _write(tmp_path, 4000, 30_000)
    _corrupt_frame(backup, which)
    work = tmp_path / "work"
    work.mkdir()
    before = child_pids()
    started = time.monotonic()
    with pytest.raises(CorruptFrameError):
        LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, backup, logs, R, 0)
    failed_after = time.monotonic() - started
    _left_nothing(work, before, thread_errors)
    # The same logs read to the end take longer than the failure took: the workers were stopped, not waited for.
    started = time.monotonic()
    plan = LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, _write(tmp_path / "ok", 10, 0)[0], logs, R, 0)
    full = time.monotonic() - started
    plan.close()
    assert failed_after < full, (failed_after, full)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("error", [_Interrupted, KeyboardInterrupt])
def test_an_interrupt_while_the_backup_is_read_beside_the_workers(tmp_path: Path, error: type[BaseException],
                                                                  thread_errors: list[BaseException | None]) -> None:
    """Ctrl-C (or the progress display failing) while this process reads the backup and the workers read the logs:
    the interrupt comes out as itself, nothing left."""
    backup, logs = _write(tmp_path, 4000, 30_000)
    work = tmp_path / "work"
    work.mkdir()
    before = child_pids()

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == READ_BACKUP and done == 2000:
            raise error

    with pytest.raises(error):
        LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, backup, logs, R, 0, progress)
    _left_nothing(work, before, thread_errors)


def test_a_worker_killed_mid_slice_while_the_backup_is_read(tmp_path: Path,
                                                            thread_errors: list[BaseException | None]) -> None:
    """A worker SIGKILLed while it reads a slice of the logs (this process still reading the backup): the plan
    fails with the worker's error, nothing left (its partner stopped, the spill directory removed)."""
    backup, logs = _write(tmp_path, 4000, 30_000)
    work = tmp_path / "work"
    work.mkdir()
    before = child_pids()
    killed: list[int] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == READ_BACKUP and done == 1000 and not killed:
            workers = sorted(child_pids() - before)
            assert len(workers) == 2
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    with pytest.raises(WorkerError, match=f"pid {killed[0] if killed else ''}"):
        LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, backup, logs, R, 0, progress)
    assert killed
    _left_nothing(work, before, thread_errors)



def test_a_worker_killed_mid_slice_stops_the_plan_before_the_backup_is_read(
        tmp_path: Path, thread_errors: list[BaseException | None]) -> None:
    """The worker's failure comes out while this process still reads the backup, not once the whole backup is read
    (at 10M messages that is minutes later)."""
    _, logs = _write(tmp_path, 0, 30_000)
    w = BackupWriter(tmp_path / "big")
    n = 200_000
    for i in range(n):
        w.add(1, Entry(f"b{i:09d}", "Q1", state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(), b"x")
    w.finish({"id": "big", "group": "G", "structure": S, "entries": n, "bytes": n, "replay_from": R, "gen": 1})
    backup = read_backup(tmp_path / "big")
    work = tmp_path / "work"
    work.mkdir()
    before = child_pids()
    seen: list[int] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase != READ_BACKUP:
            return
        seen.append(done)
        if done == 1000:
            os.kill(sorted(child_pids() - before)[0], signal.SIGKILL)

    with pytest.raises(WorkerError):
        LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, backup, logs, R, 0, progress)
    assert max(seen) < n // 2, max(seen)
    _left_nothing(work, before, thread_errors)


def test_a_backup_copy_that_cannot_be_restored_is_refused_by_name_before_the_cf_is_touched(
        tmp_path: Path, thread_errors: list[BaseException | None]) -> None:
    """A descriptor holding a raw byte the backup kept (surrogateescape: the CF held bytes that are not UTF-8)
    cannot be restored (the load's strict encoding, as redis-py's, refuses it). The plan, which runs before the
    restore claims the structure, says which entry, while the workers read the logs; nothing left. (The encoder's
    own error named no entry.)"""
    _, logs = _write(tmp_path, 0, 20_000)
    w = BackupWriter(tmp_path / "bad")
    for i in range(3000):
        w.add(1, Entry(f"b{i:06d}" + ("\udcff" if i == 2500 else ""), "Q1", state="CP", lrsn=1000 + i,
                       order=(1000 + i, 1000 + i)).wire(), b"x")
    w.finish({"id": "bad", "group": "G", "structure": S, "entries": 3000, "bytes": 3000, "replay_from": R,
              "gen": 1})
    backup = read_backup(tmp_path / "bad")
    work = tmp_path / "work"
    work.mkdir()
    before = child_pids()
    with pytest.raises(ValueError, match=r"^entry 'b002500\\udcff' cannot be written to the CF: .* not UTF-8"):
        LocalEngine(work_dir=work, workers=2, partitions=8).plan(S, backup, logs, R, 0)
    _left_nothing(work, before, thread_errors)
