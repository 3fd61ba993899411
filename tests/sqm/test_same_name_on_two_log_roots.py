"""The same --name started from a second log while the first incarnation is alive and serving (sqm.core.own_log):
host B has a copy of the log volume (a snapshot restored onto a standby host, including _group/, so the
repository's id matches the one the CF records), or a shared volume whose locks do not cross hosts. The log's writer
lock cannot see the first incarnation, and the CF's join takes any start for a restart: it gave B a new epoch, which
fenced A at its next CF call, and B's restart recovery backed out, from its stale copy, units of work A was
committing: A's log said COMMIT where the CF and B's log said BACKOUT, two histories for one member. A start while
the member's lease is live from another host or log is refused, naming them, and fences no one; on the same host
and log (a restart after kill -9, the writer lock held) it goes on at once. Real redis-server, real logs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cfemu.admin import Admin
from sqm.core import own_log
from sqm.core.own_log import RunsElsewhereError
from tests.support.crash import crash
from tests.support.group import define_group, start_qm


def test_a_second_incarnation_of_a_live_member_on_another_log_root_is_refused(redis_url: str, tmp_path: Path) -> None:
    a, b = tmp_path / "hostA" / "logs", tmp_path / "hostB" / "logs"
    define_group(redis_url, queues=("Q1",))
    qm_a = start_qm(redis_url, a, "QM1", background=False)
    try:
        conn = qm_a.connect()
        conn.put("Q1", b"committed")
        conn.commit()
        shutil.copytree(a, b, ignore=shutil.ignore_patterns("writer.lock"))  # host B's copy of the volume
        conn.put("Q1", b"in flight on A")
        epoch = Admin(qm_a.redis).members()["QM1"]["epoch"]
        with pytest.raises(RunsElsewhereError, match=r"QM1: another incarnation holds a live lease .* with its log "
                                                     rf"at {a / 'QM1'}"):
            start_qm(redis_url, b, "QM1", background=False).stop(checkpoint=False)
        assert Admin(qm_a.redis).members()["QM1"]["epoch"] == epoch  # nobody fenced
        conn.commit()  # A was not fenced: its unit of work commits
        assert sorted(m.body for m in conn.browse("Q1")) == [b"committed", b"in flight on A"]
    finally:
        qm_a.stop()


def test_another_host_with_the_same_log_path_is_refused_and_a_restart_here_is_not(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same path on two hosts (one volume mounted alike on both) is told apart by the host; a restart on the
    same host and log right after kill -9, its lease still live, starts at once."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    crash(qm)
    monkeypatch.setattr(own_log, "HOST", "standby-host")
    with pytest.raises(RunsElsewhereError, match="joined from host"):
        start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    monkeypatch.undo()
    start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000).stop()  # the lease still live: goes on


def test_the_host_a_member_runs_on_is_in_its_join_and_in_cfemu_status(redis_url: str, tmp_path: Path) -> None:
    """Where each member runs is what the operator reads first when a start is refused: cfemu status shows it."""
    from qsg.status_cli import gather_status

    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        assert Admin(qm.redis).members()["QM1"]["host"] == own_log.HOST
        (member,) = gather_status(Admin(qm.redis), tmp_path / "logs")["members"]
        assert (member["name"], member["host"], member["pid"]) == ("QM1", own_log.HOST, os.getpid())
    finally:
        qm.stop()
