"""The REST door when the member's log fails as a unit of work's COMMIT is written (its fdatasync answers EIO): the
commit's outcome is not known, and the reply says so, never "refused, try again" (503, which the door answers only
after it backed the unit of work out). The COMMIT reached the page cache, so the member's restart decides the work
from its log: committed.

- A DELETE: the 200 still carries the message, with ``ibm-mq-outcome: unknown``; the message is delivered once,
  never consumed for nobody.
- A POST: 500 with MQRC_CONNECTION_BROKEN (OutcomeUnknownError), not 503: a client that sent it again on a 503 would
  have put it twice, and the chaos checker would count the 503 put's message a phantom.

A real member serving REST on a real socket (in this process, so that the failure can be injected at the writer), a
real redis-server, real log files, a plain HTTP client."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from sqm.log import writer as log_writer
from tests.sqm.test_put_committed_recovery import all_bodies
from tests.sqm.test_rest import CSRF, TEXT, basic, http
from tests.support.group import start_qm
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_url, serving_rest


@pytest.fixture
def member(redis_url: str, tmp_path: Path) -> Iterator[RunningServer]:
    with serving_rest(redis_url, tmp_path) as running:
        yield running


def fail_log_forces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's next forces answer EIO: a COMMIT written then is in the page cache, its outcome not known."""
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(log_writer, "_fdatasync", eio)


def bodies_after_restart(member: RunningServer, redis_url: str, tmp_path: Path) -> list[bytes]:
    """The member stopped and started again: the messages on its queues once its restart decided its log."""
    member.stop()
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        return all_bodies(qm)
    finally:
        qm.stop()


def test_a_delete_whose_commit_outcome_is_unknown_delivers_the_message_and_says_so(
        member: RunningServer, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = rest_url(member)
    put = http("POST", base, b"taken once", {**basic(TOKEN), **CSRF, **TEXT}, auth=False)
    assert put.status == 201, (put.status, put.body)
    fail_log_forces(monkeypatch)  # the get's COMMIT is written, its force fails
    got = http("DELETE", base, headers={**basic(TOKEN), **CSRF}, auth=False)
    monkeypatch.undo()
    assert got.status == 200, (got.status, got.body)
    assert got.body == b"taken once"
    assert got.headers.get("ibm-mq-outcome") == "unknown"
    assert member.server.qm.log_failed
    # The COMMIT reached the disk: the get is committed at the restart, once.
    assert bodies_after_restart(member, redis_url, tmp_path) == []


def test_a_post_whose_commit_outcome_is_unknown_is_answered_500_not_503(
        member: RunningServer, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_log_forces(monkeypatch)  # the put's COMMIT is written, its force fails
    put = http("POST", rest_url(member), b"put once", {**basic(TOKEN), **CSRF, **TEXT}, auth=False)
    monkeypatch.undo()
    assert member.server.qm.log_failed
    error = put.error()
    assert put.status == 500, (put.status, put.body)  # not known done, not refused: look for it before sending again
    assert error["reasonCode"] == 2009 and error["msgId"] == "MQWB0303E", error
    # The COMMIT reached the disk: the put is committed at the restart.
    assert bodies_after_restart(member, redis_url, tmp_path) == [b"put once"]
