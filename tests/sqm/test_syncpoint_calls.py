"""Puts, gets and commits under syncpoint of many applications run together (sqm.core.syncpoint_calls, through
sqm.core.lifecycles), in process on a real redis-server and a real log: the puts' and gets' scripts in one round
trip with nothing forced, the commits' standing checks in one round trip, their COMMITs forced by one fsync and
applied in one more round trip; each call's own outcome; each unit of work its connection's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import (
    BackedOutError,
    LogFailedError,
    NoMessageError,
    OutcomePendingError,
    StructureFailedError,
    StructureFullError,
    UnknownObjectError,
)
from sqm.core.connection import Message, PutSpec
from sqm.core.lifecycles import Call, Lifecycles, OnePut
from sqm.core.syncpoint_calls import DONE, SyncCommit, SyncGet, SyncPut
from sqm.operations import APPLICATION
from sqm.service import queue_ops
from sqm.service.config import ServerConfig
from sqm.service.server import SQMServer
from sqm.service.session import Session
from tests.sqm.test_lifecycles import HUNG_TIMEOUT_S, hung_cf_member
from tests.support.group import define_group, start_qm


def test_commits_of_many_connections_are_one_fsync_and_two_round_trips(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    srv = redis_factory()
    define_group(srv.url, queues=("Q1",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        warm = qm.connect()  # put.lua, standing.lua and commit.lua loaded in the CF (a first call loads its script)
        warm.put("Q1", b"warm")
        warm.commit()
        assert warm.get("Q1", syncpoint=False).body == b"warm"
        conns = [qm.connect() for _ in range(5)]
        for k, c in enumerate(conns):
            c.put("Q1", b"m%d" % k)
        doomed = qm.connect()
        doomed.put("Q1", b"doomed")
        assert doomed.uow is not None
        doomed.uow.doomed = "a CF call of it failed (the test says so)"
        held = doomed.uow
        assert qm.log is not None
        trips, fsyncs, commits = qm.cf.round_trips, qm.log.stats.fsyncs, qm.counters["commits"]
        out = Lifecycles(qm).run([*(SyncCommit(c) for c in conns), SyncCommit(None), SyncCommit(qm.connect()),
                                  SyncCommit(doomed)])
        assert out[:7] == [DONE] * 7  # five committed, two with nothing to commit
        assert out[7] is None and doomed.uow is held  # left to its own path, its unit of work still its connection's
        assert qm.cf.round_trips - trips == 2  # the five standing checks, then the five commits
        assert qm.log.stats.fsyncs - fsyncs == 1
        assert qm.counters["commits"] - commits == 5
        assert all(c.uow is None for c in conns)
        assert list(qm.uows) == [held.id]
        assert sorted(m.body for m in warm.browse("Q1")) == [b"m%d" % k for k in range(5)]
        with pytest.raises(BackedOutError):
            doomed.commit()
        assert not qm.uows
    finally:
        qm.stop()


def test_puts_and_gets_under_syncpoint_run_in_one_round_trip_and_force_nothing(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    srv = redis_factory()
    client = define_group(srv.url, queues=("Q1", "Q2"))
    Admin(client).ensure_structure("TINY", ("FULLQ",), max_entries=1)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        other = qm.connect()
        other.put("Q2", b"waiting", syncpoint=False)
        other.put("FULLQ", b"fills TINY", syncpoint=False)
        other.put("Q1", b"loads put.lua")
        other.backout()
        with pytest.raises(NoMessageError):  # get.lua loaded too
            other.get("Q1")
        c1, c2, c3, c4 = (qm.connect() for _ in range(4))
        assert qm.log is not None
        trips, fsyncs = qm.cf.round_trips, qm.log.stats.fsyncs
        out = Lifecycles(qm).run([SyncPut(c1, PutSpec("Q1", b"mine")), SyncPut(c2, PutSpec("NOSUCH", b"x")),
                                  SyncPut(c3, PutSpec("FULLQ", b"x")), SyncGet(c4, "Q2")])
        assert isinstance(out[0], Message) and out[0].body == b"mine"
        assert isinstance(out[1], UnknownObjectError)
        assert isinstance(out[2], StructureFullError)
        assert isinstance(out[3], Message) and out[3].body == b"waiting"
        assert qm.cf.round_trips - trips == 1
        assert qm.log.stats.fsyncs == fsyncs  # a put or get under syncpoint is forced by its commit only
        assert c1.uow is not None and c1.uow.operations == 1 and c1.uow.persistent
        assert c4.uow is not None and c4.uow.operations == 1
        assert not other.browse("Q1") and not other.browse("Q2")  # neither committed yet
        c4.backout()  # the unit of work is the connection's: its own backout puts the message back
        assert [m.body for m in other.browse("Q2")] == [b"waiting"]
        out = Lifecycles(qm).run([SyncCommit(c1)])
        assert out == [DONE]
        assert [m.body for m in other.browse("Q1")] == [b"mine"]
    finally:
        qm.stop()


def test_a_hung_cf_mid_batch_ends_each_unit_of_work_as_alone_within_two_timeouts(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """The CF stops answering (SIGSTOP) before a batch of commits, a put and a get under syncpoint: the commits'
    standing checks time out (left to the commit, as alone), their COMMITs are forced and they wait pending; the
    put and the get hear the CF's failure and their units of work, doomed, stay their connections' (their commit
    backs them out). Two timeouts in all, not two a commit; once the CF answers, the commits complete."""
    qm, pid = hung_cf_member(redis_factory, tmp_path, ("Q1", "Q2"))
    try:
        other = qm.connect()
        other.put("Q2", b"waiting", syncpoint=False)
        committers = [qm.connect() for _ in range(4)]
        for k, c in enumerate(committers):
            c.put("Q1", b"m%d" % k)
        putter, getter = qm.connect(), qm.connect()
        putter.put("Q1", b"first")  # a unit of work open before the CF hangs
        calls: list[Call] = [*(SyncCommit(c) for c in committers), SyncPut(putter, PutSpec("Q1", b"doomed")),
                             SyncGet(getter, "Q2")]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            out = Lifecycles(qm).run(calls)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(o, OutcomePendingError) for o in out[:4]), out
        assert isinstance(out[4], StructureFailedError) and isinstance(out[5], StructureFailedError), out
        assert took < 4 * HUNG_TIMEOUT_S, took
        assert putter.uow is not None and putter.uow.doomed and getter.uow is not None and getter.uow.doomed
        assert all(c.uow is None for c in committers)
        assert qm.retry_pending() == 4
        for c in (putter, getter):  # what ran of their calls is unknown: backed out, as alone
            with pytest.raises(BackedOutError):
                c.commit()
        assert not qm.uows and not qm.pending
        assert sorted(m.body for m in other.browse("Q1")) == [b"m%d" % k for k in range(4)]
        assert [m.body for m in other.browse("Q2")] == [b"waiting"]
    finally:
        qm.stop()


def test_a_commit_left_to_its_own_path_is_untouched_when_its_batch_fails_before_deciding(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two commits in one batch: one whose structure says its persistent store is disconnected (left to its own
    path, its unit of work back on its connection) and one the batch decides, when the batch fails before deciding
    it (the LOGLOAD checkpoint cannot be written: the log failed). The one left to its own path is made there, as
    alone: its unit of work untouched by the batch's failure, then backed out for the disconnected store."""
    srv = redis_factory()
    client = define_group(srv.url, queues=("Q1",))
    Admin(client).ensure_structure("S2", ("Q3",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        left, decided = qm.connect(), qm.connect()
        left.put("Q1", b"left")
        decided.put("Q3", b"decided")
        held = left.uow
        CF(client).structure("APP1").pstore("disconnect")

        def refused(why: str) -> None:
            raise LogFailedError(f"the checkpoint could not be written ({why}; the test says so)")

        monkeypatch.setattr(qm, "checkpoint", refused)
        qm.activity = qm.config.logload  # the batch's decision takes a LOGLOAD checkpoint first
        out = Lifecycles(qm).run([SyncCommit(left), SyncCommit(decided)])
        assert out[0] is None, out  # its own path makes it
        assert isinstance(out[1], LogFailedError), out
        assert left.uow is held and held is not None and not held.doomed and held.id in qm.uows
        monkeypatch.undo()
        with pytest.raises(BackedOutError, match="persistent store is disconnected"):
            left.commit()
        assert held.id not in qm.uows
    finally:
        monkeypatch.undo()
        qm.stop()


def test_a_force_that_fails_whole_tells_no_put_under_syncpoint_it_failed(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch holding a commit, a put under syncpoint and a commit its own path makes (a disconnected persistent
    store), whose force fails as a whole (an error no path expects): the commit hears it; the put, in its
    connection's unit of work whatever the force did, is told so (its commit commits it); the other commit goes to
    its own path, as it would have."""
    srv = redis_factory()
    client = define_group(srv.url, queues=("Q1",))
    Admin(client).ensure_structure("S2", ("Q3",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    server = SQMServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=srv.url, token="app-token"),
                       qm=qm)
    pool = ThreadPoolExecutor(1)
    try:
        sessions = [Session(k, "127.0.0.1:1", pool, authenticated=True, request_limit=2**20, reply_limit=2**20,
                            peer_ip="127.0.0.1", role=APPLICATION) for k in range(3)]
        committer, putter, left = (queue_ops._connection(server, s) for s in sessions)
        committer.put("Q3", b"committed?")
        left.put("Q1", b"left")
        CF(client).structure("APP1").pstore("disconnect")

        def broken(batches: Any, **kw: Any) -> None:
            raise RuntimeError("the force broke")

        monkeypatch.setattr(qm, "apply_many", broken)
        t = server.begin_together([(sessions[0], 1, "commit", {}),
                                   (sessions[1], 2, "put", {"queue": "Q3", "body": b"mine"}),
                                   (sessions[2], 3, "commit", {})])
        server.finish_together([t])
        monkeypatch.undo()
        first, second, third = t.replies
        assert first is not None and first["error"]["type"] == "OutcomeUnknownError", first  # its COMMIT appended
        assert second is not None and second["ok"], second  # the put is in its unit of work
        assert third is None  # its own path makes it
        assert putter.uow is not None and putter.uow.operations == 1
        putter.commit()
        CF(client).structure("APP1").pstore("connect")
        assert b"mine" in [m.body for m in qm.connect().browse("Q3")]
    finally:
        monkeypatch.undo()
        pool.shutdown(wait=False)
        qm.stop()


def test_a_call_of_the_batch_that_fails_unexpectedly_leaves_every_put_under_syncpoint_taken_once(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's put outside syncpoint fails unexpectedly once its script ran (its store report breaks: an error
    no path expects), before a put under syncpoint of the same round trip is taken: the put under syncpoint, whose
    script ran too, is taken into its unit of work all the same (its record appended), never left to its own path
    to be made a second time (a second message in the unit of work, one of them with no record in the log)."""
    srv = redis_factory()
    define_group(srv.url, queues=("Q1",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        c = qm.connect()
        real, broken = qm.note_store, [False]

        def note_store(uow: Any, rec: Any) -> None:
            if not broken[0]:
                broken[0] = True
                raise RuntimeError("the store report broke")
            real(uow, rec)

        monkeypatch.setattr(qm, "note_store", note_store)
        out = Lifecycles(qm).run([OnePut(PutSpec("Q1", b"other")), SyncPut(c, PutSpec("Q1", b"mine"))])
        monkeypatch.undo()
        assert broken[0]
        assert not isinstance(out[0], Message), out  # its own unit of work backed out
        assert isinstance(out[1], Message), out  # None would send it to its own path: put a second time
        c.commit()
        assert [m.body for m in c.browse("Q1")] == [b"mine"]
        assert qm.log is not None
        assert [r["d"] for _, r in qm.log.records() if r["k"] == "PUT"] == [b"mine"]
    finally:
        monkeypatch.undo()
        qm.stop()


def test_a_get_whose_batch_s_finish_fails_unexpectedly_is_delivered_with_its_unknown_outcome(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's force and commit (Lifecycles.finish) raise an error no path expects, after a get outside
    syncpoint took its message and appended its COMMIT: the get's reply says its outcome is unknown and carries
    the message (the restart commits the get when the COMMIT reached the disk): never consumed for nobody."""
    srv = redis_factory()
    define_group(srv.url, queues=("Q1",))
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    server = SQMServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=srv.url, token="app-token"),
                       qm=qm)
    pool = ThreadPoolExecutor(1)
    try:
        qm.connect().put("Q1", b"taken", syncpoint=False)
        session = Session(0, "127.0.0.1:1", pool, authenticated=True, request_limit=2**20, reply_limit=2**20,
                          peer_ip="127.0.0.1", role=APPLICATION)

        def broken(begun: Any) -> None:
            raise RuntimeError("the finish broke")

        monkeypatch.setattr(server.lifecycles, "finish", broken)
        t = server.begin_together([(session, 1, "get", {"queue": "Q1", "syncpoint": False})])
        server.finish_together([t])
        monkeypatch.undo()
        [reply] = t.replies
        assert reply is not None and reply["error"]["type"] == "OutcomeUnknownError", reply
        assert reply["error"]["delivered"]["body"] == b"taken", reply
    finally:
        monkeypatch.undo()
        pool.shutdown(wait=False)
        qm.stop()
