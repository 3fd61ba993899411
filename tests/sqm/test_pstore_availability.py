"""The persistent store's availability under load (docs/pstore.md): DISCONNECT-PSTORE /
CONNECT-PSTORE while client threads on two queue managers put and get persistent and non-persistent messages
(real redis-server, real logs): every committed persistent message is accounted for exactly once, the refusals say
why, non-persistent work goes on; and the "no new units of work" state, set by an operator and by capacity."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import (
    BackedOutError,
    NoMessageError,
    NoNewUowsError,
    OutcomePendingError,
    PstoreUnavailableError,
    StructureFullError,
)
from qsg.pstore_cli import main as pstore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from sqm.log import LogReader
from tests.support.group import define_group, start_qm
from tests.support.messages import drained

S = "APP1"


class Worker(threading.Thread):
    """Puts persistent messages (each its own UOW, committed), non-persistent ones outside syncpoint, and gets
    both, persistent ones under syncpoint; records what committed and what was refused, and when."""

    def __init__(self, name: str, conn: Connection, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.conn, self.stop = conn, stop
        self.committed: list[bytes] = []
        self.got: list[bytes] = []
        self.commits: list[tuple[float, float]] = []  # (start, end) of each persistent commit that succeeded
        self.refusals: list[str] = []
        self.np_puts: list[float] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            i = 0
            while not self.stop.is_set():
                i += 1
                self._put(f"{self.name}-{i}".encode())
                self._np(i)
                self._get()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.failure = e

    def _put(self, body: bytes) -> None:
        c = self.conn
        try:
            c.put("Q1", body)
            t0 = time.monotonic()
            c.commit()
            self.commits.append((t0, time.monotonic()))
            self.committed.append(body)
        except (PstoreUnavailableError, BackedOutError) as e:
            self.refusals.append(f"{type(e).__name__}: {e}")
            c.backout()

    def _np(self, i: int) -> None:
        self.conn.put("Q2", f"np{i}".encode(), persistent=False, syncpoint=False)
        self.np_puts.append(time.monotonic())
        try:
            self.conn.get("Q2", syncpoint=False)
        except NoMessageError:
            pass

    def _get(self) -> None:
        c = self.conn
        try:
            body = c.get("Q1").body
            c.commit()
            self.got.append(body)
        except NoMessageError:
            c.commit()
        except (PstoreUnavailableError, BackedOutError) as e:
            self.refusals.append(f"{type(e).__name__}: {e}")
            c.backout()


def test_disconnect_and_connect_under_load_lose_nothing(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url)
    qms = [start_qm(redis_url, tmp_path / "logs", f"QM{i}", background=False) for i in (1, 2)]
    stop = threading.Event()
    workers = [Worker(f"W{n}", qms[n % 2].connect(), stop) for n in range(4)]
    for w in workers:
        w.start()
    s = CF(client).structure(S)
    time.sleep(0.5)
    rc = pstore(["disconnect", S, "--redis-url", redis_url])
    disconnected = time.monotonic()
    time.sleep(0.8)
    connecting = time.monotonic()
    rc += pstore(["connect", S, "--redis-url", redis_url])
    time.sleep(0.5)
    stop.set()
    for w in workers:
        w.join(10)
    assert rc == 0
    assert not [w.failure for w in workers if w.failure], [w.failure for w in workers]
    committed = Counter(b for w in workers for b in w.committed)
    taken = Counter(b for w in workers for b in w.got) + Counter(drained(qms[0].connect(), "Q1"))
    assert taken == committed  # every committed persistent message once; nothing refused or backed out appears
    assert len(committed) > 20
    refusals = [r for w in workers for r in w.refusals]
    assert refusals and all("persistent store is disconnected" in r for r in refusals), refusals[:5]
    # No persistent commit begun while disconnected succeeded (a little slack for the CLI's own call) ...
    assert not [c for w in workers for c in w.commits if disconnected + 0.05 < c[0] and c[1] < connecting]
    # ... while non-persistent work went on, and persistent work resumed after the connect.
    assert sum(disconnected < t < connecting for w in workers for t in w.np_puts) > 10
    assert [c for w in workers for c in w.commits if c[0] > connecting]
    assert s.pstore().connected
    for qm in qms:
        qm.stop()


def test_a_unit_of_work_in_progress_is_backed_out_at_its_commit(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    c.put("Q1", b"in-progress")
    c.put("Q2", b"np", persistent=False)
    CF(client).structure(S).pstore("disconnect")
    with pytest.raises(BackedOutError, match="persistent store is disconnected") as e:
        c.commit()
    assert e.value.reason_name == "MQRC_BACKED_OUT"
    CF(client).structure(S).pstore("connect")
    # the whole unit of work was backed out
    assert drained(qm.connect(), "Q1") == [] and drained(qm.connect(), "Q2") == []
    qm.stop()


def test_no_new_uows_by_operator_and_by_capacity(redis_url: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    define_group(redis_url, structure="APP2", queues=("Q3",), max_entries=10)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    assert pstore(["no-new-uows", "APP2", "--on", *where]) == 0
    with pytest.raises(NoNewUowsError, match="set by an operator") as e:
        c.put("Q3", b"x")
    assert e.value.reason_name == "MQRC_RESOURCE_PROBLEM"
    c.backout()
    assert pstore(["no-new-uows", "APP2", "--off", *where]) == 0
    for i in range(10):
        c.put("Q3", f"m{i}".encode())
    c.commit()
    with pytest.raises(StructureFullError):
        c.put("Q3", b"one too many")
    c.backout()
    capsys.readouterr()
    assert pstore(["status", "APP2", "--json", *where]) == 0
    assert '"no_new_uows": "FULL"' in capsys.readouterr().out
    with pytest.raises(NoNewUowsError, match="reached its capacity"):
        c.put("Q3", b"x", persistent=False, syncpoint=False)
    for _ in range(2):  # consuming goes on; at 8 of 10 (the low-water mark) new work is taken again
        c.get("Q3")
        c.commit()
    c.put("Q3", b"again")
    c.commit()
    assert pstore(["no-new-uows", "APP2", *where]) == 2
    assert "say --on or --off" in capsys.readouterr().err
    assert pstore(["connect", "NOPE", *where]) == 2
    assert "structure NOPE: structure is not in the CF" in capsys.readouterr().err
    qm.stop()


def _all(qm: QueueManager, queue: str) -> list[bytes]:
    c, out = qm.connect(), []
    while True:
        try:
            out.append(c.get(queue).body)
        except NoMessageError:
            c.backout()
            return out


def _log_kinds(qm: QueueManager, uow: str) -> list[str]:
    return [str(r["k"]) for _, r in LogReader(qm.log_dir).records() if r.get("u") == uow]


def _moving(redis_url: str, tmp_path: Path) -> tuple[QueueManager, Connection]:
    """A UOW that takes m from Q1 (structure APP1) and puts it to Q3 (APP2), not committed yet."""
    define_group(redis_url)
    define_group(redis_url, structure="APP2", queues=("Q3",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    c.put("Q1", b"m")
    c.commit()
    c.get("Q1")
    c.put("Q3", b"m")
    return qm, c


def test_a_disconnect_after_the_commit_is_forced_does_not_split_it(redis_url: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A logged COMMIT is decided: it completes on every structure of the UOW, including one disconnected after
    another structure applied it (docs/pstore.md, commit.lua does not refuse). Turning it into a backout there
    would lose m and leave COMMIT then BACKOUT in the log."""
    qm, c = _moving(redis_url, tmp_path)
    real = QueueManager._apply_one

    def apply_one(self: QueueManager, uow: UnitOfWork, sname: str, commit: bool, for_member: str | None) -> None:
        if commit and uow.applied:  # an operator's DISCONNECT-PSTORE lands between the two structures
            CF(self.redis).structure(sname).pstore("disconnect")
        real(self, uow, sname, commit, for_member)

    monkeypatch.setattr(QueueManager, "_apply_one", apply_one)
    uow = c._current_uow().id
    c.commit()
    monkeypatch.setattr(QueueManager, "_apply_one", real)
    assert not CF(qm.redis).structure("APP2").pstore().connected
    assert "COMMIT" in _log_kinds(qm, uow) and "BACKOUT" not in _log_kinds(qm, uow)
    CF(qm.redis).structure("APP2").pstore("connect")
    assert (_all(qm, "Q1"), _all(qm, "Q3")) == ([], [b"m"])
    qm.stop()


def test_a_pending_commit_completes_on_a_store_disconnected_meanwhile(redis_url: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pending commit is never turned into a backout: the commit applied on APP1, APP2 failed (its commit
    pending), then APP2 back but disconnected: the retry completes the commit there."""
    qm, c = _moving(redis_url, tmp_path)
    admin = Admin(qm.redis)
    real = QueueManager._apply_one

    def apply_one(self: QueueManager, uow: UnitOfWork, sname: str, commit: bool, for_member: str | None) -> None:
        if commit and uow.applied:
            admin.set_state(sname, "FAILED")  # APP2 fails after APP1 applied the commit
        real(self, uow, sname, commit, for_member)

    monkeypatch.setattr(QueueManager, "_apply_one", apply_one)
    with pytest.raises(OutcomePendingError, match="APP2"):
        c.commit()  # decided (logged): it waits for APP2
    monkeypatch.setattr(QueueManager, "_apply_one", real)
    assert len(qm.pending) == 1
    admin.set_state("APP2", "ACTIVE")
    CF(qm.redis).structure("APP2").pstore("disconnect")
    assert qm.retry_pending() == 1 and not qm.pending
    CF(qm.redis).structure("APP2").pstore("connect")
    assert (_all(qm, "Q1"), _all(qm, "Q3")) == ([], [b"m"])
    qm.stop()


def test_a_refusal_after_one_structure_committed_keeps_the_commit_pending(redis_url: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a structure refuses once another has committed the UOW, the member never turns it into a backout
    (a BACKOUT after the COMMIT tells a restore to undo what the other committed): the commit waits."""
    qm, c = _moving(redis_url, tmp_path)
    real = QueueManager._apply_one

    def apply_one(self: QueueManager, uow: UnitOfWork, sname: str, commit: bool, for_member: str | None) -> None:
        if commit and uow.applied:
            self.redis.hset(keys.tomb(sname), uow.id, "B")  # a refusal that cannot happen after a forced COMMIT
        real(self, uow, sname, commit, for_member)

    monkeypatch.setattr(QueueManager, "_apply_one", apply_one)
    uow = c._current_uow().id
    with pytest.raises(OutcomePendingError, match="APP2"):
        c.commit()
    monkeypatch.setattr(QueueManager, "_apply_one", real)
    assert "BACKOUT" not in _log_kinds(qm, uow) and list(qm.pending) == [uow]
    assert qm.retry_pending() == 0 and list(qm.pending) == [uow]  # still refused: still waiting
    qm.redis.hdel(keys.tomb("APP2"), uow)
    assert qm.retry_pending() == 1
    assert (_all(qm, "Q1"), _all(qm, "Q3")) == ([], [b"m"])
    qm.stop()


def test_persistent_work_is_refused_before_its_commit_is_forced(redis_url: str, tmp_path: Path) -> None:
    """In-progress persistent work on a disconnected store is backed out at its commit, and the log says BACKOUT
    only (no COMMIT before it): the refusal is the member's, before the force (standing.lua's 'D')."""
    qm, c = _moving(redis_url, tmp_path)
    uow = c._current_uow().id
    CF(qm.redis).structure("APP2").pstore("disconnect")
    with pytest.raises(BackedOutError, match="structure APP2: the persistent store is disconnected"):
        c.commit()
    assert "COMMIT" not in _log_kinds(qm, uow) and "BACKOUT" in _log_kinds(qm, uow)
    CF(qm.redis).structure("APP2").pstore("connect")
    assert (_all(qm, "Q1"), _all(qm, "Q3")) == ([b"m"], [])
    qm.stop()


def test_one_put_too_big_does_not_lock_out_new_work(redis_url: str, tmp_path: Path) -> None:
    """A put larger than the room left in an empty structure is refused and sets no 'no new units of work' (FULL):
    one bad put never locks every application out (docs/pstore.md, "No new units of work")."""
    define_group(redis_url, max_bytes=1_000_000)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    with pytest.raises(StructureFullError):
        c.put("Q1", b"x" * 1_500_000, persistent=False, syncpoint=False)
    c.backout()
    assert CF(qm.redis).structure(S).pstore().no_new_uows == ""
    c.put("Q2", b"small")
    c.commit()
    qm.stop()


def test_replacements_cannot_fill_the_structure(redis_url: str, tmp_path: Path) -> None:
    """Puts with the message id of a message the UOW takes (replacements) are bounded by the capacity check like
    any other put: any client may put with a message id, so they cannot fill the structure."""
    define_group(redis_url, max_entries=10, max_bytes=10_000)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    c.put("Q1", b"x", msgid=b"K" * 24)
    c.commit()
    got = c.get("Q1")
    refused = 0
    for _ in range(50):
        try:
            c.put("Q1", b"y" * 1000, msgid=got.msgid)
        except (StructureFullError, NoNewUowsError):
            refused += 1
    c.commit()
    info = CF(qm.redis).structure(S).info()
    qm.stop()
    assert int(info["entries"]) <= 10 and int(info["bytes"]) <= 10_000 and refused, (refused, info)


def test_a_migrated_structure_is_refused_for_good_not_retry_later(redis_url: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A store migration's source stays MIGRATED until an operator reopens it: a verb refused for it exits 2 (not 75,
    which a script would retry for ever) and names the way out."""
    define_group(redis_url).hset(keys.meta(S), "state", "MIGRATED")  # as a migration's unload leaves its source
    capsys.readouterr()
    for verb in (["disconnect", S], ["connect", S], ["no-new-uows", S, "--on"]):
        assert pstore([*verb, "--redis-url", redis_url]) == 2, verb
        err = capsys.readouterr().err
        assert "structure is MIGRATED" in err and f"cfemu migrate reopen {S}" in err and err.count("\n") == 1, err
