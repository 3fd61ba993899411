"""The restore point written beside the load (restore.load.Beside), end to end: a real SQM's messages, a real
redis-server, a real restore (restore.run.run_restore) whose load takes three batches.

- The point's writer fails (disk full) at the first, a middle or the last batch, or in its own writing thread
  (backup.files.BackupWriter): the restore fails with that error, the structure stays RECOVERING, no restore point
  is left (nor listed as good), no thread is left, and a restore after it restores every message.
- The load is stopped (a purge takes the structure over; an interrupt) while the point's thread is inside a slow
  write: the point is aborted, nothing hangs, no thread is left.
- A normal restore's point holds exactly what the load put in the CF, and a restore from it gives the same
  content.
- An interrupt while the load waits for the point's last write: the point must not be aborted while its thread
  still writes (RestorePointWriter / BackupWriter are not made for two threads).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.catalog import OK, list_backups
from backup.files import BackupWriter, read_backup
from backup.points import RestorePointWriter, kind_of
from cfemu import bulk, keys
from cfemu.admin import Admin
from restore.run import RestoreStoppedError, run_restore
from tests.restore.test_restore import drain, rejoin
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
BODIES = 6  # of 600 KiB: with a memory limit of 16 MiB a load's batch is 1 MiB, two of them: three batches
OPTIONS = {"memory": 16 << 20}
THREADS = ("restore-load-point", "restore-load-prepare", "backup-write")


@pytest.fixture
def lost(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, Path, Path, list[bytes], Any]]:
    """Six messages of 600 KiB committed by a real SQM, backed up (an empty backup: the logs hold them), then the
    CF lost: (client, log root, backup root, bodies, the queue manager)."""
    from backup.run import run_backup

    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    bodies = [os.urandom(600 << 10) for _ in range(BODIES)]
    try:
        run_backup(client, S, backups, log_root=logs)
        conn = qm.connect()
        for b in bodies:
            conn.put("Q1", b)
        conn.commit()
        lose_cf(client)
        yield client, logs, backups, bodies, qm
    finally:
        qm.stop()


def _threads_left() -> list[str]:
    deadline = time.monotonic() + 5  # a pool's worker ends just after its shutdown returns
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(THREADS) and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _kinds(backups: Path) -> list[tuple[str, str]]:
    return sorted((kind_of(b.manifest or {}), b.state) for b in list_backups(backups, S))


def _assert_failed_cleanly(client: redis.Redis, backups: Path) -> None:
    assert client.hget(keys.meta(S), "state") == b"RECOVERING"
    assert _kinds(backups) == [("fuzzy", OK)]  # the base only: no restore point, good or not
    assert [p.name for p in (backups / S).iterdir() if p.is_dir()] == [list_backups(backups, S)[0].id]
    assert _threads_left() == []


def _restore_all(client: redis.Redis, logs: Path, backups: Path, bodies: list[bytes], qm: Any) -> None:
    Admin(client).set_state(S, "FAILED")
    result = run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
    assert result.loaded_entries == BODIES
    rejoin(qm)
    assert [b for b, _ in drain(qm.connect(), "Q1")] == bodies


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_point_whose_writer_fails_at_a_batch_fails_the_restore_and_leaves_it_recovering(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any], monkeypatch: pytest.MonkeyPatch,
        fail_at: int) -> None:
    client, logs, backups, bodies, qm = lost
    real = RestorePointWriter.add_copies
    calls = []

    def add_copies(self: RestorePointWriter, copies: Any) -> None:
        calls.append(len(copies))
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, copies)

    monkeypatch.setattr(RestorePointWriter, "add_copies", add_copies)
    with pytest.raises(OSError, match="No space left on device"):
        run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
    assert calls[:fail_at] == [2] * fail_at and len(calls) <= 3  # three batches of two
    _assert_failed_cleanly(client, backups)
    monkeypatch.undo()
    _restore_all(client, logs, backups, bodies, qm)


@pytest.mark.parametrize("when", ["first chunk", "every chunk", "last chunk"])
def test_a_full_disk_under_the_points_own_writing_thread_fails_the_restore(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any], monkeypatch: pytest.MonkeyPatch,
        when: str) -> None:
    """The deepest writer: BackupWriter's writing thread, whose error shows at the next hand-over or at the
    file's close (in finish, called before the structure is ACTIVE). A batch of 1.2 MiB is one chunk: the
    last chunk's error shows only in finish."""
    client, logs, backups, bodies, qm = lost
    real = BackupWriter._write_chunk
    state = {"chunks": 0}

    def write_chunk(file: Any, sha: Any, chunk: bytearray) -> None:
        state["chunks"] += 1
        if (when == "every chunk" or (when == "first chunk" and state["chunks"] == 1)
                or (when == "last chunk" and state["chunks"] == 3)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(file, sha, chunk)

    monkeypatch.setattr(BackupWriter, "_write_chunk", staticmethod(write_chunk))
    with pytest.raises(OSError, match="No space left on device"):
        run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
    _assert_failed_cleanly(client, backups)
    monkeypatch.undo()
    _restore_all(client, logs, backups, bodies, qm)


def _slow_point(monkeypatch: pytest.MonkeyPatch, seconds: float,
                before_write: Callable[[int], None] | None = None) -> list[str]:
    """The point's writes take `seconds` each, after before_write(n) for the n-th (from 1); returns the log of the
    point's calls (write, written, abort)."""
    real, real_abort = RestorePointWriter.add_copies, RestorePointWriter.abort
    events: list[str] = []
    calls = [0]

    def add_copies(self: RestorePointWriter, copies: Any) -> None:
        calls[0] += 1
        if before_write is not None:
            before_write(calls[0])
        events.append("write")
        time.sleep(seconds)
        real(self, copies)
        events.append("written")

    def abort(self: RestorePointWriter) -> None:
        events.append("abort")
        real_abort(self)

    monkeypatch.setattr(RestorePointWriter, "add_copies", add_copies)
    monkeypatch.setattr(RestorePointWriter, "abort", abort)
    return events


def test_a_purge_taking_the_structure_over_stops_the_load_and_the_points_thread(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    client, logs, backups, _, _ = lost
    events = _slow_point(monkeypatch, 0.5)

    def purge_after_the_first_batch(phase: str, done: int, total: int | None) -> None:
        if phase == "load" and done == 2:
            bulk.purge(client, Admin(client).structure_def(S), ["Q1"])

    t0 = time.monotonic()
    with pytest.raises(RestoreStoppedError, match="purge took the structure over"):
        run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS,
                    progress=purge_after_the_first_batch)
    assert time.monotonic() - t0 < 30
    assert events[-1] == "abort" and "write" not in events[events.index("abort"):]
    assert [k for k, _ in _kinds(backups)] == ["fuzzy"]
    assert _threads_left() == []


def test_an_interrupt_while_the_point_writes_a_batch_aborts_the_point_once_its_thread_is_done(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    client, logs, backups, bodies, qm = lost
    events = _slow_point(monkeypatch, 0.5)

    def interrupt_at_the_second_batch(phase: str, done: int, total: int | None) -> None:
        if phase == "load" and done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS,
                    progress=interrupt_at_the_second_batch)
    assert events[-1] == "abort", events  # the write under way was waited for, the one queued dropped
    _assert_failed_cleanly(client, backups)
    monkeypatch.undo()
    _restore_all(client, logs, backups, bodies, qm)


def test_a_normal_restores_point_holds_exactly_what_the_load_wrote(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any]) -> None:
    """Three batches written beside the load: the point holds each loaded entry once, with the CF's descriptor
    and data, and a restore from it gives the same messages."""
    client, logs, backups, bodies, qm = lost
    one = run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
    assert one.loaded_entries == BODIES
    point = read_backup(backups / S / one.restore_point)
    copies = list(point.copies())
    assert point.manifest["entries"] == len(copies) == BODIES
    assert point.manifest["bytes"] == sum(len(b) for b in bodies)
    assert sorted(data for _, _, data in copies) == sorted(bodies)
    assert sorted(d["id"] for _, d, _ in copies) == sorted(k.decode() if isinstance(k, bytes) else k for k in client.hkeys(keys.entries(S)))
    assert sorted(data for _, _, data in copies) == sorted(client.hvals(keys.data(S)))
    assert _threads_left() == []
    lose_cf(client)
    two = run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
    assert (two.backup_id, two.base_kind, two.loaded_entries) == (one.restore_point, "restore", BODIES)
    rejoin(qm)
    assert [b for b, _ in drain(qm.connect(), "Q1")] == bodies


def test_an_interrupt_while_the_load_waits_for_the_points_last_write_does_not_abort_it_under_the_writer(
        lost: tuple[redis.Redis, Path, Path, list[bytes], Any], monkeypatch: pytest.MonkeyPatch,
        ctrl_c_raises: None) -> None:
    """Every batch is in the CF; the loading thread waits (Beside.__exit__, the normal way out: thread.join())
    for the point's thread to write the last one, which is slow (a busy disk). The operator presses Ctrl-C once:
    the KeyboardInterrupt leaves Beside.__exit__ from its join, without stopping or waiting for the thread, and
    restore.run aborts the point (BackupWriter.abort: its pending writes, its file, rmtree) while that thread
    still writes into it: the writer used from two threads at once, a thread left running after run_restore
    raised. Beside must wait for the write under way first, however it is
    left."""
    client, logs, backups, _, _ = lost
    release = threading.Event()
    in_last = threading.Event()

    def hold_the_last(n: int) -> None:
        if n == 3:
            in_last.set()
            release.wait(10)

    events = _slow_point(monkeypatch, 0.0, hold_the_last)

    def ctrl_c() -> None:
        in_last.wait(10)
        time.sleep(0.5)  # the loading thread has sent every batch and waits in Beside.__exit__
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        release.set()  # the slow write ends (a fixed Beside waits for it before the point is aborted)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_restore(client, S, backup_root=backups, log_root=logs, engine_options=OPTIONS)
        alive = [t.name for t in threading.enumerate() if t.name == "restore-load-point"]
    finally:
        release.set()
    time.sleep(0.5)
    assert alive == [], f"the point's thread still ran when run_restore raised: {events}"
    assert "abort" in events
    assert events[events.index("abort"):] == ["abort"], f"the point was written after it was aborted: {events}"
