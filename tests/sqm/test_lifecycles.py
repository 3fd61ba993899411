"""Puts and gets outside syncpoint of many applications run together (sqm.core.lifecycles), in process on a real
redis-server and a real log: one batch, each call's own outcome, one CF round trip for the scripts and one for the
commits, one fsync; what the batch leaves to the plain path is left untouched."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import (
    BadRequestError,
    NoMessageError,
    OutcomePendingError,
    StructureFailedError,
    StructureFullError,
    UnknownObjectError,
)
from sqm.core.config import QueueManagerConfig
from sqm.core.connection import Message, PutSpec
from sqm.core.lifecycles import Call, Lifecycles, OneGet, OnePut
from sqm.core.manager import QueueManager
from sqm.wings import WINGS
from tests.support.group import define_group, start_qm


def test_one_batch_gives_each_call_its_own_outcome_in_two_round_trips_and_one_fsync(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    srv = redis_factory()
    client = define_group(srv.url, queues=("Q1", "Q2", "Q3"))
    Admin(client).ensure_structure("TINY", ("FULLQ",), max_entries=1)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        c = qm.connect()
        c.put("Q2", b"waiting", syncpoint=False)
        c.put("FULLQ", b"fills TINY", syncpoint=False)
        with pytest.raises(NoMessageError):  # get.lua loaded in the CF (its first call would load it: a call more)
            c.get("Q3", syncpoint=False)
        assert qm.log is not None
        trips, fsyncs = qm.cf.round_trips, qm.log.stats.fsyncs
        calls: list[Call] = [
            OnePut(PutSpec("Q1", b"new")),
            OnePut(PutSpec("NOSUCH", b"x")),
            OnePut(PutSpec("FULLQ", b"x")),
            OnePut(PutSpec("Q1", b"x", priority=12)),
            OneGet("Q2"),
            OneGet("Q3"),
            OneGet("Q3", wait_ms=1000),
        ]
        out = Lifecycles(qm).run(calls)
        assert isinstance(out[0], Message) and out[0].body == b"new"
        assert isinstance(out[1], UnknownObjectError)
        assert isinstance(out[2], StructureFullError)
        assert isinstance(out[3], BadRequestError)  # refused before anything was sent
        assert isinstance(out[4], Message) and out[4].body == b"waiting"
        assert isinstance(out[5], NoMessageError)
        assert out[6] is None  # nothing there and it may wait: left to the plain path, which waits
        assert qm.cf.round_trips - trips == 2  # the scripts, then the two commits
        assert qm.log.stats.fsyncs - fsyncs == 1
        assert not qm.uows  # every unit of work of the batch is finished (committed, or abandoned)
        assert c.get("Q1", syncpoint=False).body == b"new"
        for queue in ("Q1", "Q2", "Q3"):
            assert not c.browse(queue)
        assert [m.body for m in c.browse("FULLQ")] == [b"fills TINY"]
    finally:
        qm.stop()


def test_an_empty_batch_and_one_all_refused_force_nothing(redis_factory: Callable[..., EmbeddedRedis],
                                                          tmp_path: Path) -> None:
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        assert qm.log is not None
        fsyncs = qm.log.stats.fsyncs
        assert Lifecycles(qm).run([]) == []
        out = Lifecycles(qm).run([OnePut(PutSpec("NOSUCH", b"x")), OneGet("NOSUCH")])
        assert all(isinstance(o, UnknownObjectError) for o in out)
        assert qm.log.stats.fsyncs == fsyncs
        assert not qm.uows
    finally:
        qm.stop()


def test_a_commit_the_batch_leaves_to_its_own_path_is_counted_once(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """A batch's commit that its round trip cannot apply (the structure is being restored: RECOVERING) goes on by
    complete's path, pending until the structure is back: one commit decided, counted once."""
    srv = redis_factory()
    client = define_group(srv.url, queues=("Q1",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        lifecycles = Lifecycles(qm)
        begun = lifecycles.begin([OnePut(PutSpec("Q1", b"pending"))])
        commits = qm.counters["commits"]
        Admin(client).set_state("APP1", "RECOVERING")
        lifecycles.finish([begun])
        assert isinstance(begun.out[0], OutcomePendingError), begun.out
        assert qm.counters["commits"] - commits == 1
    finally:
        Admin(client).set_state("APP1", "ACTIVE")
        qm.stop()


def test_a_batch_whose_checkpoint_fails_backs_out_every_call_and_answers_each(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LOGLOAD checkpoint that deciding the batch's commits takes first fails on a CF error (once: a blip),
    after the batch's scripts ran: each unit of work is backed out (the message got stays on its queue, the put
    vanishes) and each call hears the CF's failure, as its own call would."""
    srv = redis_factory()
    define_group(srv.url, queues=("Q1", "Q2"))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        c = qm.connect()
        c.put("Q2", b"stays", syncpoint=False)

        checkpoint = qm.checkpoint
        failed: list[str] = []

        def checkpoint_fails_once(why: str) -> None:
            if not failed:
                failed.append(why)
                raise redis.exceptions.ConnectionError("the CF went away during the checkpoint")
            checkpoint(why)

        monkeypatch.setattr(qm, "checkpoint", checkpoint_fails_once)
        qm.activity = qm.config.logload  # the next decision takes a checkpoint first
        out = Lifecycles(qm).run([OnePut(PutSpec("Q1", b"vanishes")), OneGet("Q2")])
        assert all(isinstance(o, StructureFailedError) and "went away" in str(o) for o in out), out
        assert not qm.uows  # none left open: nothing stays locked
        assert failed == ["logload"]
        assert not c.browse("Q1")
        assert c.get("Q2", syncpoint=False).body == b"stays"
    finally:
        qm.stop()


def test_commits_a_hung_cf_cannot_take_wait_pending_after_one_timeout_not_one_each(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """The CF stops answering (SIGSTOP) between a batch's scripts and its commits: the commits' round trip times
    out once and every commit, on disk, waits pending (OutcomePendingError at once); none is made again alone,
    each waiting out its own timeout. Once the CF answers again, the pending commits complete."""
    qm, pid = hung_cf_member(redis_factory, tmp_path, ("Q1",))
    n = 6
    try:
        lifecycles = Lifecycles(qm)
        begun = lifecycles.begin([OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(n)])
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            lifecycles.finish([begun])
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(o, OutcomePendingError) for o in begun.out), begun.out
        # one timeout (and cf_call's own retry at most), not one more per commit: n commits alone took > n timeouts
        assert took < 3 * HUNG_TIMEOUT_S, took
        assert len(qm.pending) == n
        assert qm.retry_pending() == n
        c = qm.connect()
        assert sorted(m.body for m in c.browse("Q1")) == [b"m%d" % k for k in range(n)]
    finally:
        qm.stop()


@pytest.mark.parametrize("known", [True, False], ids=["queues-known", "queue-to-look-up"])
def test_a_batch_whose_scripts_a_hung_cf_does_not_answer_waits_one_timeout_not_one_each(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, known: bool) -> None:
    """The CF stops answering (SIGSTOP) before a batch's scripts: their round trip (or the look-up of a queue the
    member has not used yet) times out once and each call hears the CF's failure at once; each unit of work (what
    ran of it is unknown) is backed out once the CF answers again (pending work), not now, one at a time, each
    waiting out its own timeout. Nothing is left locked."""
    qm, pid = hung_cf_member(redis_factory, tmp_path, ("Q1", "Q2"))
    n = 6
    try:
        c = qm.connect()
        for k in range(n // 2):
            c.put("Q2", b"stays%d" % k, syncpoint=False)
        if known:
            assert not c.browse("Q1")  # its definition read
        calls: list[Call] = [OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(n // 2)]
        calls += [OneGet("Q2") for _ in range(n // 2)]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            out = Lifecycles(qm).run(calls)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(o, StructureFailedError) for o in out), out
        assert took < 3 * HUNG_TIMEOUT_S, took
        qm.retry_pending()
        assert not qm.uows and not qm.pending
        assert not c.browse("Q1")
        assert sorted(m.body for m in c.browse("Q2")) == [b"stays%d" % k for k in range(n // 2)]
    finally:
        qm.stop()


HUNG_TIMEOUT_S = 1.0  # the CF socket timeout of hung_cf_member's member (30 s by default)


def hung_cf_member(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path,
                   queues: tuple[str, ...]) -> tuple[QueueManager, int]:
    """QM1 on a CF of its own that defines `queues`, its CF socket timing out after HUNG_TIMEOUT_S, no housekeeping
    thread; and the CF's pid (to SIGSTOP it)."""
    srv = redis_factory()
    define_group(srv.url, queues=queues)
    assert srv.pid is not None
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=srv.url,
                                         lease_ms=60_000, background=False),
                      connect(srv.url, socket_timeout=HUNG_TIMEOUT_S), wings=WINGS)
    qm.start()
    return qm, srv.pid
