"""The REST door's DELETE when the member's log fails as the get's COMMIT is written (its fdatasync answers EIO):
the commit's outcome is not known, so the 200 still carries the message, with ``ibm-mq-outcome: unknown``, and the
member's restart decides the get from its log (the COMMIT reached the page cache: committed, the message gone). The
message is delivered once, never consumed for nobody. A real member serving REST on a real socket (in this process,
so that the failure can be injected at the writer), a real redis-server, real log files, a plain HTTP client."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from sqm.log import writer as log_writer
from sqm.service.config import ServerConfig
from tests.sqm.test_put_committed_recovery import all_bodies
from tests.sqm.test_rest import CSRF, TEXT, basic, http
from tests.support.group import define_group, start_qm
from tests.support.inprocess_server import RunningServer

TOKEN = "app-token"


@pytest.fixture
def member(redis_url: str, tmp_path: Path) -> Iterator[RunningServer]:
    define_group(redis_url, queues=("Q1",))
    running = RunningServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_url, token=TOKEN,
                                         port=0, rest_port=0, lease_ms=1000, ready_file=tmp_path / "QM1.ready"))
    try:
        yield running
    finally:
        if running.thread.is_alive():
            running.stop()


def test_a_delete_whose_commit_outcome_is_unknown_delivers_the_message_and_says_so(
        member: RunningServer, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = f"http://127.0.0.1:{member.rest_port}/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"
    put = http("POST", base, b"taken once", {**basic(TOKEN), **CSRF, **TEXT}, auth=False)
    assert put.status == 201, (put.status, put.body)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(log_writer, "_fdatasync", eio)  # the get's COMMIT is written, its force fails
    got = http("DELETE", base, headers={**basic(TOKEN), **CSRF}, auth=False)
    monkeypatch.undo()
    assert got.status == 200, (got.status, got.body)
    assert got.body == b"taken once"
    assert got.headers.get("ibm-mq-outcome") == "unknown"
    assert member.server.qm.log_failed
    member.stop()
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        assert all_bodies(qm) == []  # the COMMIT reached the disk: the get is committed at the restart, once
    finally:
        qm.stop()
