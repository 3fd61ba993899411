"""Batches of puts and gets in one request (put_batch, get_batch): real redis-server, real `sqm run` servers.

A batch means what N single calls in one unit of work mean: order and priorities kept, under syncpoint or not,
a commit in the same request, a refusal part-way leaving the unit of work open with what was done, MAXUMSGS
counting each message, bounds on the request and the reply. And a member killed (SIGKILL, a failpoint after the
batch's CF calls and before its force) loses no acknowledged message and applies no unacknowledged one, once a
peer has recovered its work."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import (
    BadRequestError,
    OutcomeUnknownError,
    StructureFullError,
    SyncpointLimitError,
)
from cfemu.limits import CF_STEP
from sqm.service.client import BatchError, Client
from sqm.service.protocol import MIN_FRAME
from tests.support.group import define_group
from tests.support.killed_member import killed_by_failpoint
from tests.support.service_proc import OP_TOKEN, TOKEN, ServerProc, start_server


@pytest.fixture(scope="module")
def server(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    client = redis_server.client()
    client.flushall()
    client.close()
    define_group(redis_server.url, queues=("B1", "B2", "B3", "B4", "B5", "B6"))
    admin = Admin(connect(redis_server.url))
    admin.ensure_structure("TINY", ("FULLQ",), max_entries=3)
    srv = start_server(redis_server.url, tmp_path_factory.mktemp("batch"), "QM1", "--max-umsgs", "20")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def redis_url(fresh_redis: Any) -> str:
    """A CF of the test's own: the module's server keeps the shared one for its group."""
    return str(fresh_redis.url)


def client(srv: ServerProc, **kw: Any) -> Client:
    return Client(srv.endpoint, token=TOKEN, **kw)


def drain(c: Client, queue: str) -> list[bytes]:
    out: list[bytes] = []
    while True:
        got = c.get_batch(queue, 10, commit=True)
        if not got:
            return out
        out += [m.body for m in got]


def test_order_priorities_and_a_commit_in_the_same_request(server: ServerProc) -> None:
    with client(server) as c, client(server) as other:
        msgs = [{"body": b"m%d" % i, "priority": i % 3} for i in range(12)]
        done = c.put_batch(msgs, queue="B1", commit=True)
        assert [m.body for m in done] == [b"m%d" % i for i in range(12)]
        assert all(m.msgid and m.entry_id and m.queue == "B1" for m in done)
        assert not c.uow_open
        got = other.get_batch("B1", 100, commit=True)
        # Priority first, then the order of the batch within a priority.
        want = [b"m%d" % i for p in (2, 1, 0) for i in range(12) if i % 3 == p]
        assert [m.body for m in got] == want
        assert [m.msgid for m in got] == [m.msgid for p in (2, 1, 0) for i, m in enumerate(done) if i % 3 == p]
        assert other.get_batch("B1", 5) == []


def test_under_syncpoint_the_batch_is_the_unit_of_works_until_it_commits(server: ServerProc) -> None:
    with client(server) as c, client(server) as other:
        c.put("B2", b"single")
        c.put_batch([b"a", b"b"], queue="B2")
        assert c.uow_open
        assert other.get_batch("B2", 10) == []  # nothing committed yet
        c.backout()
        assert other.get_batch("B2", 10) == []
        c.put_batch([b"c", b"d"], queue="B2")
        c.commit()
        got = other.get_batch("B2", 10)
        assert [m.body for m in got] == [b"c", b"d"]
        assert other.uow_open
        other.backout()  # the gets backed out: the messages are back, their backout counts raised
        again = other.get_batch("B2", 10, commit=True)
        assert [(m.body, m.backout_count) for m in again] == [(b"c", 1), (b"d", 1)]


def test_outside_syncpoint_the_batch_commits_on_its_own(server: ServerProc) -> None:
    with client(server) as c, client(server) as other:
        c.put("B3", b"held")  # the connection's own unit of work is not the batch's
        c.put_batch([b"x", b"y"], queue="B3", syncpoint=False)
        assert [m.body for m in other.get_batch("B3", 10, commit=True)] == [b"x", b"y"]
        c.backout()
        assert other.get_batch("B3", 10) == []


def test_a_refusal_part_way_leaves_what_was_done_in_the_open_unit_of_work(server: ServerProc) -> None:
    with client(server) as c, client(server) as other:
        with pytest.raises(BatchError) as e:
            c.put_batch([b"1", b"2", b"3", b"4", b"5"], queue="FULLQ", commit=True)
        assert isinstance(e.value.cause, StructureFullError)
        assert e.value.reason == StructureFullError.reason
        assert [m.body for m in e.value.done] == [b"1", b"2", b"3"] and not e.value.committed
        assert c.uow_open  # the commit asked for was not made: the caller decides
        assert other.get_batch("FULLQ", 10) == []
        c.commit()
        assert drain(other, "FULLQ") == [b"1", b"2", b"3"]
        # Outside syncpoint the messages before the refusal are committed, as single puts would be.
        with pytest.raises(BatchError) as e:
            c.put_batch([b"6", b"7", b"8", b"9"], queue="FULLQ", syncpoint=False)
        assert e.value.committed and [m.body for m in e.value.done] == [b"6", b"7", b"8"]
        assert not c.uow_open
        assert drain(other, "FULLQ") == [b"6", b"7", b"8"]
        # A message the checks refuse before anything runs refuses the whole batch: nothing is done.
        with pytest.raises(BadRequestError, match="priority"):
            c.put_batch([{"body": b"ok"}, {"body": b"bad", "priority": 10}], queue="FULLQ")
        assert not c.uow_open and other.get_batch("FULLQ", 10) == []


def test_maxumsgs_counts_each_message(server: ServerProc) -> None:
    with client(server) as c, client(server) as other:
        with pytest.raises(SyncpointLimitError):
            c.put_batch([b"%d" % i for i in range(21)], queue="B4")  # the limit is 20: refused whole
        assert not c.uow_open
        c.put_batch([b"%d" % i for i in range(15)], queue="B4")
        with pytest.raises(SyncpointLimitError):
            c.put_batch([b"%d" % i for i in range(6)], queue="B4")
        c.put_batch([b"%d" % i for i in range(5)], queue="B4", commit=True)  # 20: within the limit
        for _ in range(2):  # outside syncpoint a batch is its own unit of work: not counted
            c.put_batch([b"o"] * 10, queue="B4", syncpoint=False)
        assert len(other.get_batch("B4", 100)) == 20  # up to the limit, no more
        with pytest.raises(SyncpointLimitError):
            other.get_batch("B4", 1)
        other.commit()
        assert len(drain(other, "B4")) == 20


def test_a_get_batch_behind_a_long_run_of_expired_messages_takes_the_live_ones_in_order(server: ServerProc) -> None:
    """More expired messages at the head of the queue than the batch's gets move in one CF round (each get moves
    at most CF_STEP and takes nothing then): the batch still takes the live messages behind them, in get order."""
    with client(server) as c, client(server) as other:
        expired = 4 * CF_STEP + 76
        for i in range(0, expired, 1000):
            c.put_batch([{"body": b"x", "persistent": False, "expiry_ms": 1}] * min(1000, expired - i),
                        queue="B6", syncpoint=False)
        c.put_batch([b"L%d" % i for i in range(6)], queue="B6", commit=True)
        time.sleep(0.01)  # every expiry passed
        assert [m.body for m in other.get_batch("B6", 4, commit=True)] == [b"L0", b"L1", b"L2", b"L3"]
        assert not other.uow_open
        assert drain(other, "B6") == [b"L4", b"L5"]


def test_bounds(server: ServerProc) -> None:
    with client(server) as c:
        with pytest.raises(BadRequestError, match="1-1000"):
            c.put_batch([], queue="B5")
        with pytest.raises(BadRequestError, match="1-1000"):
            c.put_batch([b"x"] * 1001, queue="B5")
        with pytest.raises(BadRequestError, match="max_messages"):
            c.get_batch("B5", 0)
        with pytest.raises(BadRequestError, match="max_messages"):
            c.get_batch("B5", 1001)
        with pytest.raises(BadRequestError, match="outside syncpoint"):
            c.put_batch([b"x"], queue="B5", syncpoint=False, commit=True)
        assert not c.uow_open
    with client(server, max_frame=MIN_FRAME) as small:  # replies of 4 KiB: room for few messages
        with pytest.raises(BadRequestError, match="fewer"):
            small.get_batch("B5", 100)
        with pytest.raises(BadRequestError, match="fewer"):
            small.put_batch([b"x"] * 100, queue="B5")
    with client(server, max_frame=8192) as c:
        c.put_batch([b"a" * 3000, b"b" * 3000, b"c" * 10], queue="B5", commit=True)
        # Each of 5 messages may have a fifth of the reply: the first is longer, so it comes alone.
        assert [len(m.body) for m in c.get_batch("B5", 5, commit=True)] == [3000]
        assert [len(m.body) for m in c.get_batch("B5", 2, commit=True)] == [3000, 10]


def test_an_operator_and_an_application_may_batch_a_companion_queue_is_refused(server: ServerProc) -> None:
    with Client(server.endpoint, token=OP_TOKEN, role="operator") as op:
        op.put_batch([b"by the operator"], queue="B5", syncpoint=False)
        assert [m.body for m in op.get_batch("B5", 10, commit=True)] == [b"by the operator"]


# --- kill -9 inside a batch --------------------------------------------------------------------------------------
def test_kill_9_inside_a_get_batch_redelivers_only_the_unacknowledged(redis_url: str, tmp_path: Path) -> None:
    """The member dies (SIGKILL) after its third batch's CF calls and log appends, before that batch's force.
    The acknowledged gets never come back; the killed batch's come back (backed out by the peer, their backout
    counts raised); nothing is lost."""
    with killed_by_failpoint(redis_url, tmp_path, "K1", "batch-before-force=3") as killed:
        with client(killed.peer) as feeder:
            feeder.put_batch([b"g%d" % i for i in range(30)], queue="K1", syncpoint=False)
        c = client(killed.victim, reconnect_timeout=1)
        acked = [m.body for _ in range(2) for m in c.get_batch("K1", 10, commit=True)]
        with pytest.raises(OutcomeUnknownError):  # lost while it committed: the client cannot know
            c.get_batch("K1", 10, commit=True)
        c.close()
        killed.recovered()
        with client(killed.peer) as check:
            left = check.get_batch("K1", 1000, commit=True)
        assert acked == [b"g%d" % i for i in range(20)]
        assert [(m.body, m.backout_count) for m in left] == [(b"g%d" % i, 1) for i in range(20, 30)]


def test_kill_9_inside_a_put_batch_keeps_the_acknowledged_and_applies_none_of_it(redis_url: str, tmp_path: Path) -> None:
    """Two acknowledged batches of puts, a third killed before its force: after peer recovery the queue holds
    exactly the acknowledged messages, in order, and none of the killed batch."""
    with killed_by_failpoint(redis_url, tmp_path, "K2", "batch-before-force=3") as killed:
        c = client(killed.victim, reconnect_timeout=1)
        acked = [m.body for b in range(2)
                 for m in c.put_batch([b"p%d-%d" % (b, i) for i in range(10)], queue="K2", commit=True)]
        with pytest.raises(OutcomeUnknownError):
            c.put_batch([b"lost%d" % i for i in range(10)], queue="K2", commit=True)
        c.close()
        killed.recovered()
        with client(killed.peer) as check:
            assert [m.body for m in check.get_batch("K2", 1000, commit=True)] == acked


@pytest.mark.slow
def test_kill_9_inside_a_force_shared_by_concurrent_batches_loses_no_acknowledged_one(redis_url: str,
                                                                                      tmp_path: Path) -> None:
    """Eight clients commit batches of puts at once on one member, whose committers share fsyncs (group commit).
    The member dies (SIGKILL) inside the third force that other committers wait on, before its leader writes
    their records. After peer recovery: every acknowledged batch is on the queue, whole; every batch on the queue
    was acknowledged or had its outcome unknown to its client, and is whole (none half-applied); and the batches
    of the killed force are not there."""
    clients, per, most = 8, 10, 200
    acked: list[list[bytes]] = []
    unknown: list[list[bytes]] = []
    lock = threading.Lock()

    def commit_batches(victim: ServerProc, k: int) -> None:
        with client(victim, reconnect_timeout=1) as c:
            for b in range(most):
                batch = [b"c%d-b%d-m%d" % (k, b, i) for i in range(per)]
                try:
                    c.put_batch(batch, queue="K3", commit=True)
                except (OutcomeUnknownError, ConnectionError, OSError):
                    with lock:
                        unknown.append(batch)
                    return
                with lock:
                    acked.append(batch)

    with killed_by_failpoint(redis_url, tmp_path, "K3", "group-force=3") as killed:
        killed.run_clients(commit_batches, clients, join_timeout=120,
                           what="the member was not killed inside a shared force")
        with client(killed.peer) as check:
            left = {m.body for m in check.get_batch("K3", 1000, commit=True)}
        assert all(set(batch) <= left for batch in acked)  # nothing acknowledged is lost
        known = {body for batch in acked + unknown for body in batch}
        assert left <= known  # nothing that was never sent
        for batch in unknown:  # a batch whose outcome its client could not know is applied whole or not at all
            assert set(batch) <= left or not set(batch) & left, batch
        # The killed force's leader and the committer(s) waiting on it had their COMMIT records only in the
        # member's memory: their batches are not applied.
        assert any(not set(batch) & left for batch in unknown)
