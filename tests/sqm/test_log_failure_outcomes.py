"""What the application hears when its member's log fails during a commit (docs/pstore.md, "When a member's log
cannot be written"): a put whose COMMIT's write was attempted has an unknown outcome (OutcomeUnknownError), never
"refused" (LogFailedError), since the COMMIT may be on disk; a put the CF applied is never reported refused. In
process, against a real redis-server, with real log files (the failures injected at the writer's write or fsync)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import LogFailedError, OutcomeUnknownError
from sqm.core.lifecycles import Lifecycles, OneGet
from sqm.log import writer as log_writer
from sqm.log.writer import LogFullError
from sqm.service.client import Client
from sqm.service.config import ServerConfig
from tests.sqm.test_put_committed_recovery import all_bodies, crash, warm
from tests.support.group import define_group, start_qm
from tests.support.inprocess_server import RunningServer


@pytest.fixture
def log_root(redis_url: str, tmp_path: Path) -> Path:
    define_group(redis_url, queues=("Q1",))
    return tmp_path / "logs"


def bodies_after_restart(redis_url: str, log_root: Path) -> list[bytes]:
    """What the queues hold once QM1 has restarted from its log (its restart recovery decided what was unknown)."""
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        return all_bodies(qm)
    finally:
        qm.stop()


def fail_fsyncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fdatasync of the log answers EIO (a failing disk) until the monkeypatch is undone."""
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")
    monkeypatch.setattr(log_writer, "_fdatasync", eio)


@pytest.mark.parametrize("fused", [True, False])
def test_a_put_whose_commit_fsync_failed_is_told_its_outcome_is_unknown_and_the_log_decides_it(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        if fused:
            warm(qm)  # the member knows the structure's generation: the put is committed in one CF call
        real = log_writer._fdatasync
        fail_fsyncs(monkeypatch)
        with pytest.raises(OutcomeUnknownError, match="may have reached the disk"):
            qm.connect().put("Q1", b"unknown", syncpoint=False)
        monkeypatch.setattr(log_writer, "_fdatasync", real)
        assert all_bodies(qm) == []  # not applied: the log decides it at the restart
        with pytest.raises(LogFailedError):  # nothing attempted: refused
            qm.connect().put("Q1", b"refused", syncpoint=False)
    finally:
        crash(qm)
    # The COMMIT was written (the page cache holds it): the restart commits the put, once; the refused one is
    # in no log.
    assert bodies_after_restart(redis_url, log_root) == [b"unknown"]


def fail_writes_of(monkeypatch: pytest.MonkeyPatch, kind: bytes) -> None:
    """The disk fills exactly when a record of this kind is written out: every append is written at once, and the
    write that carries one fails with ENOSPC (as a full disk fails it)."""
    write_all = log_writer._write_all
    packed = bytes([0xA0 + len(kind)]) + kind  # the kind as msgpack packs it (a short string)

    def write_all_or_enospc(fd: int, data: Any) -> None:
        if packed in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        write_all(fd, data)
    monkeypatch.setattr(log_writer, "WRITE_THRESHOLD", 0)
    monkeypatch.setattr(log_writer, "_write_all", write_all_or_enospc)


@pytest.mark.parametrize("fused", [True, False])
def test_a_put_applied_on_the_cf_is_acknowledged_when_its_end_cannot_be_written(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        if fused:
            warm(qm)
        qm.checkpoint("every earlier record on disk")  # the next write that carries an END is the put's
        fail_writes_of(monkeypatch, b"END")
        qm.connect().put("Q1", b"applied", syncpoint=False)  # acknowledged: no error
        assert b"applied" in all_bodies(qm)
        assert qm.log_failed and not qm.uows  # the log failed; the applied UOW is not kept
    finally:
        crash(qm)
    monkeypatch.undo()
    # the restart completes it again from its COMMIT, once
    assert bodies_after_restart(redis_url, log_root).count(b"applied") == 1


def test_a_get_after_the_log_failed_is_refused_through_the_service_not_delivered_twice(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the member's log has failed, a get outside syncpoint through the service (the batch loop's path) has
    its COMMIT refused by the writer, never written: it hears LogFailedError and its message is not delivered (the
    restart backs the get out and the message is there again, delivered once then). Were it told "unknown" with the
    message, the message would be delivered twice."""
    member = RunningServer(ServerConfig(name="QM1", log_root=log_root, redis_url=redis_url, token="app-token",
                                        port=0, lease_ms=1000, ready_file=log_root.parent / "QM1.ready"))
    try:
        with Client(member.endpoint, token="app-token") as c:
            for body in (b"A", b"B"):
                c.put("Q1", body, syncpoint=False)

            fail_fsyncs(monkeypatch)
            with pytest.raises(OutcomeUnknownError):
                c.put("Q1", b"X", syncpoint=False)
            monkeypatch.undo()
            assert member.server.qm.log_failed
            for _ in range(2):
                with pytest.raises(LogFailedError) as refused:
                    c.get("Q1", syncpoint=False)
                assert getattr(refused.value, "message", None) is None
    finally:
        member.stop()
    assert bodies_after_restart(redis_url, log_root) == [b"A", b"B", b"X"]  # each there once: none was delivered


def test_a_batch_whose_finish_fails_keeps_the_refusal_of_a_get_whose_commit_was_never_written(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log failed; then a get outside syncpoint through the service has its COMMIT refused (LogFailedError),
    and the batch's finish fails unexpectedly after: the get still hears it was refused, without the message (the
    restart backs it out and the message is there again). Told "unknown" with the message, it would be delivered
    twice."""
    member = RunningServer(ServerConfig(name="QM1", log_root=log_root, redis_url=redis_url, token="app-token",
                                        port=0, lease_ms=1000, ready_file=log_root.parent / "QM1.ready"))
    try:
        with Client(member.endpoint, token="app-token") as c:
            c.put("Q1", b"A", syncpoint=False)

            fail_fsyncs(monkeypatch)
            with pytest.raises(OutcomeUnknownError):
                c.put("Q1", b"X", syncpoint=False)
            monkeypatch.undo()
            qm = member.server.qm
            real_apply = qm.apply_many

            def apply_then_fail(batches: Any, **kw: Any) -> None:
                real_apply(batches, **kw)
                raise RuntimeError("an unexpected failure after the batch was decided (injected)")
            monkeypatch.setattr(qm, "apply_many", apply_then_fail)
            with pytest.raises(LogFailedError) as refused:
                c.get("Q1", syncpoint=False)
            assert getattr(refused.value, "message", None) is None
    finally:
        monkeypatch.undo()
        member.stop()
    assert bodies_after_restart(redis_url, log_root) == [b"A", b"X"]


def test_a_get_whose_commit_a_full_ring_refused_is_refused_not_delivered(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A circular log whose ring is full refuses the COMMIT before buffering it (LogFullError): the batched get
    hears that it was refused, without its message, which is never on disk and is there again after the restart."""
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        qm.connect().put("Q1", b"A", syncpoint=False)
        assert qm.log is not None
        real_append = qm.log.append

        def full_at_commit(record: Any) -> Any:
            if record.get("k") == "COMMIT":
                raise LogFullError("circular log full (injected): every segment holds a needed record")
            return real_append(record)
        monkeypatch.setattr(qm.log, "append", full_at_commit)
        [out] = Lifecycles(qm).run([OneGet("Q1")])
        monkeypatch.undo()
        assert isinstance(out, LogFailedError) and not isinstance(out, OutcomeUnknownError), out
        assert getattr(out, "message", None) is None
    finally:
        crash(qm)
    assert bodies_after_restart(redis_url, log_root) == [b"A"]
