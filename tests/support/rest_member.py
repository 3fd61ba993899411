"""A member serving the REST API in the test's process (tests.support.inprocess_server), on a fresh group with queue
Q1: its internals stay within the test's reach (a failure injected at the log's writer, its log lines in caplog)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqm.service.config import ServerConfig
from tests.support.group import define_group
from tests.support.inprocess_server import RunningServer

TOKEN = "app-token"


@contextmanager
def serving_rest(redis_url: str, tmp_path: Path) -> Iterator[RunningServer]:
    """Member QM1 (application token TOKEN) serving REST on a free port, logging under ``tmp_path``/logs."""
    define_group(redis_url, queues=("Q1",))
    running = RunningServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_url, token=TOKEN,
                                         port=0, rest_port=0, lease_ms=1000, ready_file=tmp_path / "QM1.ready"))
    try:
        yield running
    finally:
        if running.thread.is_alive():
            running.stop()


def rest_url(member: RunningServer, queue: str = "Q1", qmgr: str = "QM1", resource: str = "message") -> str:
    """The URL of a queue's ``resource`` (message, messagelist) on the member; queue and qmgr go in as given."""
    return f"http://127.0.0.1:{member.rest_port}/ibmmq/rest/v3/messaging/qmgr/{qmgr}/queue/{queue}/{resource}"


@contextmanager
def rest_member_of_its_own(redis_server: Any, tmp_path: Path) -> Iterator[RunningServer]:
    """serving_rest on the session's CF emptied first: a module's tests share it as a group of their own."""
    client = redis_server.client()
    client.flushall()
    client.close()
    with serving_rest(redis_server.url, tmp_path) as running:
        yield running
