"""The persistent store's availability under load (issue 14, part 2; docs/pstore.md): DISCONNECT-PSTORE /
CONNECT-PSTORE while client threads on two queue managers put and get persistent and non-persistent messages
(real redis-server, real logs): every committed persistent message is accounted for exactly once, the refusals say
why, non-persistent work goes on; and the "no new units of work" state, set by an operator and by capacity."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from cfemu.cf import CF
from cfemu.errors import (
    BackedOutError,
    NoMessageError,
    NoNewUowsError,
    PstoreUnavailableError,
    StructureFullError,
)
from qsg.pstore_cli import main as pstore
from sqm.connection import Connection
from sqm.manager import QueueManager
from tests.support.group import define_group, start_qm

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


def _drain(qm: QueueManager, queue: str) -> list[bytes]:
    c, out = qm.connect(), []
    while True:
        try:
            out.append(c.get(queue).body)
        except NoMessageError:
            c.commit()
            return out


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
    taken = Counter(b for w in workers for b in w.got) + Counter(_drain(qms[0], "Q1"))
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
    assert _drain(qm, "Q1") == [] and _drain(qm, "Q2") == []  # the whole unit of work was backed out
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
