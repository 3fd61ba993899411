"""The REST door's POST when the member's log fails as the put's COMMIT is written (its fdatasync answers EIO): the
commit's outcome is not known (MQRC_CONNECTION_BROKEN, OutcomeUnknownError), so the reply must say so (500), not
"refused, try again" (503, which the door answers only after it backed the unit of work out): the COMMIT reached the
page cache, the member's restart commits the put, and the message is there; a client that sent it again on a 503
would have put it twice, and the chaos checker would count the 503 put's message a phantom. A real member serving
REST on a real socket (in this process, so that the failure can be injected at the writer), a real redis-server,
real log files, a plain HTTP client."""

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


def test_a_post_whose_commit_outcome_is_unknown_is_answered_500_not_503(
        member: RunningServer, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = f"http://127.0.0.1:{member.rest_port}/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(log_writer, "_fdatasync", eio)  # the put's COMMIT is written, its force fails
    put = http("POST", base, b"put once", {**basic(TOKEN), **CSRF, **TEXT}, auth=False)
    monkeypatch.undo()
    assert member.server.qm.log_failed
    error = put.error()
    assert put.status == 500, (put.status, put.body)  # not known done, not refused: look for it before sending again
    assert error["reasonCode"] == 2009 and error["msgId"] == "MQWB0303E", error
    member.stop()
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        assert all_bodies(qm) == [b"put once"]  # the COMMIT reached the disk: the put is committed at the restart
    finally:
        qm.stop()
