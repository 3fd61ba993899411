"""Seed 003's "Behavior of Conversation at Broker Restart" and "UOWs and Replicated Servers" on real processes: the
member whose server instance holds deliveries is killed with SIGKILL, and either started again (its restart settles
what it held) or recovered by a live peer; or the CF is lost (redis-server killed, started empty) and the structure
restored from a backup taken before the work plus the members' logs (the restore fold settles it).

Two conversations, received by instance X (user ``server``, token ``instance-1``) on the doomed member:

  conv-a   its first UOW DELIVERED to X at the kill: the assignment is dropped, any instance receives it (NEW)
  conv-b   its first UOW received and committed by X, its second DELIVERED to X at the kill: the link is kept; the
           second is ACCEPTED again and only X (logged on again, anywhere) receives it, by OLD

Instance Y (token ``instance-2``) is on a member that lives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from restore.run import run_restore
from tests.support.uow_member import MemberError, UowMember, start_members

S, SVC = "APP1", "SVC"


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def receive(m: UowMember, conv: str, convid: str, wait_ms: int = 0) -> dict[str, object] | None:
    try:
        return dict(m.call(conv, "receive", SVC, option="SYNC", convid=convid, wait_ms=wait_ms))
    except MemberError as e:
        if e.kind == "NoMessageError":
            return None
        raise


@pytest.mark.slow
@pytest.mark.parametrize("event", ["restart", "peer-recovery", "cf-restore"])
def test_a_killed_member_unbinds_a_first_uows_conversation_and_keeps_a_settled_one(tmp_path: Path,
                                                                                     event: str) -> None:
    cf = EmbeddedRedis(data_dir=tmp_path / "cf").start()
    members: dict[str, UowMember] = {}
    try:
        admin = Admin(connect(cf.url))
        admin.ensure_structure(S, ())
        admin.define_queue(SVC, S, uow={"status_lifetime": 5})
        # restart: no peer steps in; cf-restore: a lease renewed every second, which is when a member finds the CF
        # lost and joins the restored one
        lease = {"restart": 60_000, "peer-recovery": 1000, "cf-restore": 3000}[event]
        for m in start_members(cf.url, tmp_path / "logs", ["QM1", "QM2"], lease_ms=lease):
            members[m.name] = m
        doomed, live = members["QM1"], members["QM2"]
        if event == "cf-restore":  # a backup before the work: the bindings are in the members' logs only
            run_backup(cf.client(), S, tmp_path / "backups", log_root=tmp_path / "logs")
        live.conv("snd", "alice", "tok-a")
        doomed.conv("x", "server", "instance-1")
        doomed.conv("x2", "server", "instance-1")
        live.conv("y", "server", "instance-2")

        b1 = live.call("snd", "send", SVC, b"b1", conversation="conv-b", commit=True)
        got = receive(doomed, "x", "NEW")
        assert got is not None and got["body"] == b"b1"
        doomed.call("x", "commit")  # conv-b is X's for good
        b2 = live.call("snd", "send", SVC, b"b2", conversation="conv-b", commit=True)
        a1 = live.call("snd", "send", SVC, b"a1", conversation="conv-a", commit=True)
        assert receive(doomed, "x", "OLD")["uow"] == b2["uow"]  # type: ignore[index]
        assert receive(doomed, "x2", "NEW")["uow"] == a1["uow"]  # type: ignore[index]
        assert receive(live, "y", "ANY") is None  # both conversations are X's while it holds them
        assert b1["conversation"] == "conv-b"

        if event == "cf-restore":  # the CF lost with every binding in it; the members live on
            cf.kill()
            cf.start()
            run_restore(cf.client(), S, backup_root=tmp_path / "backups", log_root=tmp_path / "logs")
            wait_for("the members back on the restored structure",
                     lambda: set(Admin(cf.client()).members()) >= {"QM1", "QM2"})
        else:
            doomed.kill()
            del members["QM1"]
        if event == "restart":
            members["QM1"] = UowMember(cf.url, tmp_path / "logs", "QM1", lease_ms=lease).wait_started()
        elif event == "peer-recovery":
            wait_for("QM2 recovered QM1", lambda: "QM1" not in Admin(cf.client()).members())

        # conv-a: its first UOW was never settled by X: the assignment is dropped, Y receives it as NEW
        wait_for("a1 ACCEPTED again", lambda: live.query(a1["uow"]) == "ACCEPTED")
        got = receive(live, "y", "NEW", wait_ms=5000)
        assert got is not None and (got["uow"], got["deliveries"]) == (a1["uow"], 1)
        live.call("y", "commit")
        # conv-b: X settled its first UOW: b2 is ACCEPTED again but bound to X, which Y never gets
        wait_for("b2 ACCEPTED again", lambda: live.query(b2["uow"]) == "ACCEPTED")
        assert receive(live, "y", "ANY", wait_ms=1000) is None
        where = members.get("QM1", live)
        where.conv("x-again", "server", "instance-1")  # X logs on again with its user id and token
        got = receive(where, "x-again", "OLD", wait_ms=5000)
        assert got is not None and (got["uow"], got["body"], got["conversation"]) == (b2["uow"], b"b2", "conv-b")
        where.call("x-again", "commit")
        assert live.query(b2["uow"]) == "PROCESSED"
    finally:
        for m in members.values():
            m.stop()
        cf.stop()
