"""The pending commit, through the network door as a coordinator uses it: a member process
(`sqm run`), the client library's prepare and resolve, a real restore of the structure. A unit of work prepared while
its structure's restore loads would be backed out by that restore: its prepare is refused (a no vote), so a
coordinator told its resolve-commit is done always finds the put."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backup.run import run_backup
from cfemu.connection import connect
from cfemu.errors import MQError
from restore.engine import LOAD
from restore.run import run_restore
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, ServerProc, http_get, start_server

S = "APP1"


def pending(srv: ServerProc) -> float:
    """The member's `pending` gauge: decided outcomes still waiting for the CF."""
    status, text = http_get(srv.metrics_port, "/metrics")
    assert status == 200, text
    found = re.search(r"^\w*_pending(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


@pytest.fixture(name="member")
def member_process(fresh_redis: Any, tmp_path: Path) -> Iterator[ServerProc]:
    """One member process (`sqm run`) on a CF of the test's own, its log root under the test's directory."""
    define_group(fresh_redis.url, queues=("Q1", "Q2"))
    srv = start_server(fresh_redis.url, tmp_path, "QM1", "--lease-ms", "60000")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def test_a_coordinator_told_its_resolve_commit_is_done_finds_the_put(member: ServerProc, fresh_redis: Any,
                                                                      tmp_path: Path) -> None:
    cf = connect(fresh_redis.url)
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    with Client(member.endpoint, token=TOKEN, request_timeout=30.0) as app:
        app.put("Q1", b"two-phase")
        run_backup(cf, S, backups, log_root=logs)
        told: list[str] = []

        def during_load(phase: str, done: int, total: int | None) -> None:
            if phase == LOAD and not told:
                try:
                    uow = app.prepare("xid-network-1")
                    told.append("prepared")
                    app.resolve(uow, True, xid="xid-network-1")
                    told.append("committed")
                except MQError as e:
                    told.append(f"{type(e).__name__}: {e}")

        run_restore(cf, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert told, "the restore never reached its load"
        deadline = time.monotonic() + 60  # the member's housekeeping retries its pending outcomes
        while pending(member) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pending(member) == 0
        left = [m.body for m in app.browse("Q1")]
    if told[-1] == "committed":
        assert left == [b"two-phase"], f"resolve-commit answered done, then the queue holds {left} ({told})"
    else:  # a no vote: the unit of work is backed out, its put nowhere
        assert len(told) == 1 and told[0].startswith("BackedOutError: "), told
        assert left == [], f"the prepare was refused, then the queue holds {left}"
