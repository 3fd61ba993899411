"""Units of work sent to services at their edges (docs/uow.md, invariant 9 in docs/invariants.md): a UOW is never
received in part, never held for good, its statuses are never lost or reordered, and no user changes another's;
and the races that hold (two members' receivers and sweepers on the same UOWs)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin, AdminError
from cfemu.connection import connect
from cfemu.errors import EndOfUowError, MQError, NoMessageError, StructureFailedError, UowStatusError
from sqm.conversations import conversation as convmod
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import BOTH, SYNC, Conversation
from sqm.conversations.uowstatus import restore_control_entry, status_letter_hex
from sqm.conversations.uowsweeper import Sweeper
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS
from tests.support.group import two_members

S, SVC = "APP1", "SVC"


@pytest.fixture
def admin(redis_url: str) -> Admin:
    a = Admin(connect(redis_url))
    a.ensure_structure(S, ("BQ", "PLAIN"))
    a.define_queue(SVC, S, uow={"status_lifetime": 2, "max_messages": 4}, backout_queue="BQ", max_msg_length=1000)
    a.define_queue("OTHER", S, uow={"status_lifetime": 2, "lifetime_s": 1})
    a.define_queue("NP", S, uow={"store": False})
    a.define_queue("RACE", S, uow={"status_lifetime": 254, "lifetime_s": 1})
    return a


@pytest.fixture
def qms(admin: Admin, redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair


def sent(snd: Conversation, n: int = 3, service: str = SVC) -> str:
    uow = ""
    for i in range(n):
        uow = snd.send(service, b"m%d" % i).uow
    snd.commit()
    return uow


def test_a_refused_first_get_does_not_let_a_uow_be_received_in_part(admin: Admin,
                                                                    qms: tuple[QueueManager, QueueManager]) -> None:
    """The first get of a receive refused by the CF (structure FAILED a moment) ended the scope's idle unit of work
    under the session, which went on under a new one: the sweeper then gave the UOW back while the session read it,
    and a second receiver got m1 as RECV_FIRST while the first held m0."""
    qm1, qm2 = qms
    snd, rcv, other = Conversation(qm1, "alice"), Conversation(qm2, "bob"), Conversation(qm1, "carol")
    uow = sent(snd, 3)
    real = rcv.scope.get

    def refused_once(*a: Any, **k: Any) -> Any:
        del rcv.scope.get
        admin.set_state(S, "FAILED")
        try:
            return real(*a, **k)
        finally:
            admin.set_state(S, "ACTIVE")
    rcv.scope.get = refused_once  # type: ignore[method-assign]
    with pytest.raises(StructureFailedError):
        rcv.receive(SVC, option=SYNC)
    assert rcv.receiving is None and snd.query(uow)["status"] == "ACCEPTED"  # given back at once
    first = rcv.receive(SVC, option=SYNC)
    assert (first.uow, first.body, first.recv) == (uow, b"m0", "RECV_FIRST")
    sweeper = Sweeper(qm2)
    sweeper.sweep()
    sweeper.sweep()
    with pytest.raises(NoMessageError):
        other.receive(SVC, option=SYNC)
    assert [rcv.receive(SVC).body for _ in range(2)] == [b"m1", b"m2"]
    rcv.commit()


def test_a_real_lost_reply_on_delivery_does_not_leave_an_idle_session_holding_the_uow(
        redis_server: Any, admin: Admin, redis_url: str, tmp_path: Path) -> None:
    """A reply lost for real (the CF busy past the member's socket timeout) on the commit of ACCEPTED -> DELIVERED:
    the settle escaped with a raw redis error, and the idle scope held the UOW DELIVERED for as long as it lived."""
    qm = QueueManager(QueueManagerConfig(name="QM3", log_root=tmp_path / "l3", redis_url=redis_url,
                                         background=False), client=connect(redis_url, socket_timeout=0.3), wings=WINGS)
    qm.start()
    try:
        Conversation(qm, "alice").send("NP", b"a", commit=True)
        bob = Conversation(qm, "bob")
        harness = redis_server.client()
        from sqm.core.connection import Connection
        real = Connection.commit
        fired: list[int] = []

        def commit(self: Connection) -> None:
            if not fired and self is not bob.scope:
                fired.append(1)
                threading.Thread(target=lambda: harness.execute_command("DEBUG", "SLEEP", "1.0")).start()
                time.sleep(0.1)
            real(self)
        Connection.commit = commit  # type: ignore[method-assign]
        try:
            with pytest.raises(MQError):
                bob.receive("NP", option=SYNC)
        finally:
            Connection.commit = real  # type: ignore[method-assign]
        time.sleep(1.2)
        qm.retry_pending()
        sw = Sweeper(qm)
        sw.sweep()
        sw.sweep()
        assert not ctl.peek_status(qm, ctl.service(qm, "NP"), "DELIVERED")
        assert bob.receiving is None
    finally:
        qm.stop()


def test_a_foreign_entry_on_one_control_queue_does_not_stop_every_services_timeouts(
        qms: tuple[QueueManager, QueueManager]) -> None:
    qm1, _ = qms
    a = Conversation(qm1, "alice")
    a.send("OTHER", b"x")
    uow = a.commit()["uow"]
    qm1.connect().put(SVC + ".UOWCTL", b"\x01\x02", syncpoint=False, correlid=b"A")  # in process, nothing stops it
    time.sleep(1.2)
    Sweeper(qm1).sweep()
    assert a.query(uow)["status"] == "TIMEOUT"


def test_the_restore_fold_restores_a_foreign_entry_on_a_control_queue_as_it_was() -> None:
    entry = {"q": SVC + ".UOWCTL", "cid": status_letter_hex("ACCEPTED"), "st": "CP"}
    assert restore_control_entry(entry, b"\x01\x02") == (entry, b"\x01\x02")  # it failed the whole restore


def test_redefining_a_service_keeps_it_a_service(admin: Admin, qms: tuple[QueueManager, QueueManager]) -> None:
    """Redefined to change its backout queue, without the UOW attributes, a service became a plain queue and its
    UOWs were stranded (never swept, never receivable)."""
    uow = sent(Conversation(qms[0], "alice"), 1)
    admin.define_queue(SVC, S, backout_queue="PLAIN", max_msg_length=1000, replace=True)
    qms[1].forget_queue_def(SVC)
    assert admin.queue_def(SVC).uow["status_lifetime"] == 2 and admin.queue_def(SVC).backout_queue == "PLAIN"
    assert Conversation(qms[1], "bob").receive(SVC, option=SYNC).uow == uow
    with pytest.raises(AdminError, match="cannot change what kind of queue"):
        admin.define_queue("PLAIN", S, uow={}, replace=True)


def test_commit_both_after_a_refused_commit_both_succeeds(qms: tuple[QueueManager, QueueManager]) -> None:
    qm1, qm2 = qms
    rcv_uow = sent(Conversation(qm1, "alice"), 1)
    bob = Conversation(qm2, "bob")
    assert bob.receive(SVC, option=SYNC).uow == rcv_uow
    with pytest.raises(MQError):
        bob.send(SVC, b"x" * 2000)  # over the service's max length: the sent UOW exists and holds no message
    with pytest.raises(UowStatusError, match="holds no message"):
        bob.commit(BOTH)
    bob.send(SVC, b"reply")
    assert bob.commit(BOTH)["received"]["status"] == "PROCESSED"


def test_last_is_not_decided_by_a_members_wall_clock(admin: Admin, qms: tuple[QueueManager, QueueManager],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    admin.define_queue("SVC2", S, uow={"status_lifetime": 2})
    qm1, qm2 = qms
    real = convmod.now_ms
    monkeypatch.setattr(convmod, "now_ms", lambda: real() + 3_600_000)  # QM1's clock runs an hour ahead
    Conversation(qm1, "alice", "t").send(SVC, b"1", commit=True)
    monkeypatch.setattr(convmod, "now_ms", real)
    b = Conversation(qm2, "alice", "t")
    second = b.send("SVC2", b"2", commit=True).uow
    assert b.last()["uow"] == second


def test_setustatus_needs_the_token(qms: tuple[QueueManager, QueueManager]) -> None:
    uow = sent(Conversation(qms[0], "alice", "secret"), 1)
    with pytest.raises(UowStatusError, match="with this token"):
        Conversation(qms[1], "alice", "forged").set_user_status(uow, b"pwned")


def test_last_while_the_cf_lost_the_service_says_the_structure_failed(
        admin: Admin, qms: tuple[QueueManager, QueueManager], tmp_path: Path) -> None:
    """The CF came back empty: LAST answered 2085 "no unit of work", and an application took it for "nothing in
    progress" and started over (the chess example). The group repository still knows the service."""
    from cfemu import repository
    qm1, _ = qms
    repo = repository.open_group_repository(admin, tmp_path / "logs", who="test")
    repository.define_queue(admin, repo, "KEPT", S, uow={"status_lifetime": 2})
    alice = Conversation(qm1, "alice", "t")
    sent(alice, 1, "KEPT")
    admin.redis.hdel("{ADMIN}:queues", "KEPT", "KEPT.UOWCTL", "KEPT.UOWDATA")  # what the CF lost
    admin.set_state(S, "FAILED")
    qm1._queue_cache.clear()
    with pytest.raises(StructureFailedError):
        Conversation(qm1, "alice", "t").last()


@pytest.mark.slow
def test_receivers_on_two_members_and_both_sweepers_race_every_uow_ends_once(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """Held: 40 UOWs (lifetime 1 s), 4 receivers on 2 members committing, backing out or cancelling at random, both
    sweepers running: each UOW PROCESSED whole exactly once or ended TIMEOUT/CANCELLED, nothing left behind."""
    qm1, qm2 = qms
    snd = Conversation(qm1, "alice")
    uows = {}
    for i in range(40):
        u = ""
        for j in range(3):
            u = snd.send("RACE", b"%d-%d" % (i, j)).uow
        snd.commit()
        uows[u] = [b"%d-%d" % (i, j) for j in range(3)]
    processed: Counter[str] = Counter()
    bodies: dict[str, list[bytes]] = {}
    stop = time.monotonic() + 3
    lock = threading.Lock()

    def receiver(qm: QueueManager, name: str, seed: int) -> None:
        rnd = random.Random(seed)
        c = Conversation(qm, name)
        while time.monotonic() < stop:
            try:
                g = c.receive("RACE", option=SYNC)
            except NoMessageError:
                time.sleep(0.01)
                continue
            got = [g.body]
            try:
                while True:
                    got.append(c.receive("RACE").body)
            except EndOfUowError:
                pass
            r = rnd.random()
            try:
                if r < 0.6:
                    c.commit()
                    with lock:
                        processed[g.uow] += 1
                        bodies[g.uow] = got
                elif r < 0.9:
                    c.backout()
                else:
                    c.cancel()
            except MQError:
                c.close()
                c = Conversation(qm, name)

    def sweeper(qm: QueueManager) -> None:
        sw = Sweeper(qm)
        while time.monotonic() < stop + 2:
            sw.sweep()
            time.sleep(0.05)
    ts = [threading.Thread(target=receiver, args=(qm, f"r{i}", i)) for i, qm in enumerate([qm1, qm2, qm1, qm2])]
    ts += [threading.Thread(target=sweeper, args=(qm,)) for qm in (qm1, qm2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    final = {u: snd.query(u)["status"] for u in uows}
    assert not [u for u, n in processed.items() if n > 1]
    assert all(bodies[u] == uows[u] for u in processed)
    assert all(final[u] == "PROCESSED" for u in processed)
    assert set(final.values()) <= {"PROCESSED", "TIMEOUT", "CANCELLED"}, Counter(final.values())
    assert not qm1.connect().browse("OTHER.UOWDATA", 1000)


def test_a_sweep_reads_a_bounded_batch_and_a_short_lifetime_behind_long_ones_still_times_out(
        admin: Admin, qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sweep reads a bounded batch per status (peek_scan.lua, never a sort of every kept status, which blocks
    the CF: 294 ms per status for 20,000 kept statuses), and a pass goes round them all, so a 1 s UOW behind 1,000
    long-lived ones still times out."""
    from cfemu.cf import Structure
    from sqm.conversations.uowstatus import Control
    admin.define_queue("BIG", S, uow={"max_uows": 5000, "status_lifetime": 1})
    qm1, _ = qms
    svc = ctl.service(qm1, "BIG")
    conn = qm1.connect()
    for i in range(1200):
        ctl.put_control(conn, svc, Control(uow="%032x" % (i + 1), service="BIG", status="ACCEPTED", persistent=False,
                                           lifetime_ms=10**9))
        if i % 400 == 399:
            conn.commit()
    conn.commit()
    a = Conversation(qm1, "alice")
    a.send("BIG", b"x", lifetime_s=1)
    uow = a.commit()["uow"]
    read: list[int] = []
    real = Structure.peek_scan

    def counting(self: Structure, *args: Any, **kw: Any) -> Any:
        out = real(self, *args, **kw)
        read.append(len(out[1]))
        return out
    monkeypatch.setattr(Structure, "peek_scan", counting)
    time.sleep(1.2)
    sweeper = Sweeper(qm1)
    for _ in range(6):  # a pass over 1,201 ACCEPTED ones in batches of about 500
        read.clear()
        sweeper.sweep()
        assert max(read) <= 2 * Sweeper.BATCH
        if a.query(uow)["status"] == "TIMEOUT":
            break
    assert a.query(uow)["status"] == "TIMEOUT"
