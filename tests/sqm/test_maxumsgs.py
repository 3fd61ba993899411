"""MAXUMSGS: the messages an application may put and get in one unit of work (QueueManagerConfig.max_umsgs, sqm run
--max-umsgs, $SQM_MAX_UMSGS). The put or get past it is refused with MQRC_SYNCPOINT_LIMIT_REACHED (2024), nothing
changed, and the unit of work stays open to be committed or backed out, as IBM MQ leaves it. Through real `sqm run`
processes, in process, and for units of work sent to a service (the conversations' sends ride on it)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.errors import NoMessageError, SyncpointLimitError
from cfemu.settings import DEFAULT_MAX_UMSGS, ENV_MAX_UMSGS, resolve
from sqm.conversations.conversation import SYNC, Conversation
from sqm.core.manager import QueueManager
from sqm.service.client import Client
from tests.support.group import define_group, start_qm
from tests.support.service_proc import OP_TOKEN, TOKEN, TOKENS_ENV, ServerProc, start_server


def _depth(url: str, queue: str) -> int:
    """Committed messages on the queue."""
    return int(CF(connect(url)).structure("APP1").depths().get(queue, {}).get("CP", 0))


@pytest.fixture
def limited(redis_url: str, tmp_path: Path) -> Iterator[ServerProc]:
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QM1", "--max-umsgs", "20")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def test_the_default_is_ibm_mqs() -> None:
    assert DEFAULT_MAX_UMSGS == 10_000
    assert resolve(env={}, cwd=Path("/")).max_umsgs() == 10_000


def test_the_flag_and_the_environment_set_it_and_a_bad_value_is_one_line(tmp_path: Path) -> None:
    assert resolve(env={ENV_MAX_UMSGS: "7"}, cwd=tmp_path).max_umsgs() == 7
    found = resolve(max_umsgs="9", env={ENV_MAX_UMSGS: "7"}, cwd=tmp_path)
    assert (found.max_umsgs(), found.sources["max_umsgs"]) == (9, "flag")
    assert resolve(env={ENV_MAX_UMSGS: "7"}, cwd=tmp_path).env()[ENV_MAX_UMSGS] == "7"  # handed to a child
    for bad in ("0", "many", "1000000000"):
        with pytest.raises(ValueError, match=r"\$SQM_MAX_UMSGS"):
            resolve(env={ENV_MAX_UMSGS: bad}, cwd=tmp_path).max_umsgs()
    out = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QMX", "--max-umsgs", "0",
                          "--redis-url", "redis://127.0.0.1:1/0", "--log-root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env={**TOKENS_ENV, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--max-umsgs" in out.stderr and "'0'" in out.stderr, out.stderr


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "backed-out"])
def test_the_put_past_the_limit_is_refused_and_the_uow_can_still_be_settled(limited: ServerProc, redis_url: str,
                                                                            commit: bool) -> None:
    assert "MAXUMSGS 20" in limited.log_text()  # the start line says it
    with Client(limited.endpoint, token=TOKEN) as c:
        for i in range(20):
            c.put("Q1", b"m%d" % i)
        with pytest.raises(SyncpointLimitError) as refused:
            c.put("Q1", b"one too many")
        assert refused.value.reason == 2024 and refused.value.reason_name == "MQRC_SYNCPOINT_LIMIT_REACHED"
        text = str(refused.value)
        assert "\n" not in text and "MAXUMSGS 20" in text and "--max-umsgs" in text, text
        assert c.uow_open  # the refusal ended nothing
        if commit:
            c.commit()
        else:
            c.backout()
        got = []
        with pytest.raises(NoMessageError):
            while True:
                got.append(c.get("Q1", syncpoint=False).body)
    assert got == ([b"m%d" % i for i in range(20)] if commit else [])


def test_gets_count_with_puts_and_the_refused_get_takes_nothing(limited: ServerProc) -> None:
    with Client(limited.endpoint, token=TOKEN) as c:
        for i in range(25):
            c.put("Q1", b"g%d" % i, syncpoint=False)  # each its own unit of work: none near the limit
        for _ in range(15):
            c.get("Q1")
        for i in range(5):
            c.put("Q2", b"p%d" % i)
        with pytest.raises(SyncpointLimitError, match="get on Q1 refused.*holds 20 messages"):
            c.get("Q1")
        with pytest.raises(SyncpointLimitError):
            c.put("Q2", b"no")
        c.commit()
        # 15 taken, the refused get took nothing: 10 left, and a new unit of work counts from 0 again
        left = [c.get("Q1").body for _ in range(10)]
        c.commit()
        assert left == [b"g%d" % i for i in range(15, 25)]
        assert [c.get("Q2").body for _ in range(5)] == [b"p%d" % i for i in range(5)]
        c.commit()


def test_the_status_shows_the_limit(limited: ServerProc) -> None:
    with Client(limited.endpoint, token=OP_TOKEN, role="operator") as op:
        status = op.status()
    assert _find(status, "max_umsgs") == 20


def _find(d: Any, key: str) -> Any:
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def test_work_outside_syncpoint_is_never_counted(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, max_umsgs=2)
    try:
        conn = qm.connect()
        for i in range(5):
            conn.put("Q1", b"x%d" % i, syncpoint=False)
        assert [conn.get("Q1", syncpoint=False).body for _ in range(5)] == [b"x%d" % i for i in range(5)]
    finally:
        qm.stop()


# --- units of work sent to a service --------------------------------------------------------------------------
@pytest.fixture
def conversing(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure("APP1", ("BQ",))
    admin.define_queue("SVC", "APP1", uow={"max_messages": 1000, "status_lifetime": 1})
    a = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, max_umsgs=4)
    b = start_qm(redis_url, tmp_path / "logs", "QM2", background=False, max_umsgs=4)
    yield a, b
    a.stop()
    b.stop()


def test_a_uow_sent_to_a_service_is_bounded_by_the_members_maxumsgs_and_still_commits(
        conversing: tuple[QueueManager, QueueManager]) -> None:
    """A service's MAX-MESSAGES-IN-UOW (here 1000) is the service's bound; the member's MAXUMSGS bounds the sends of
    one unit of work as well. The control entries a commit moves are not the application's messages: a UOW refused
    at the limit commits, and is received whole."""
    snd, rcv = Conversation(conversing[0], "alice", "tok-a"), Conversation(conversing[1], "bob", "tok-b")
    try:
        uow = ""
        for i in range(4):
            uow = snd.send("SVC", b"m%d" % i).uow
        with pytest.raises(SyncpointLimitError, match="MAXUMSGS 4"):
            snd.send("SVC", b"m4")
        assert snd.commit() == {"status": "ACCEPTED", "uow": uow}
        got = [rcv.receive("SVC", option=SYNC) for _ in range(4)]
        assert [g.body for g in got] == [b"m%d" % i for i in range(4)] and got[-1].recv == "RECV_LAST"
        assert rcv.commit()["status"] == "PROCESSED"
    finally:
        snd.close()
        rcv.close()


# --- one application's huge unit of work does not take the group down -----------------------------------------
def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


@pytest.mark.timed
@pytest.mark.slow
def test_a_200000_message_uow_is_refused_at_10000_while_other_clients_keep_working(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    define_group(redis_url)
    admin = Admin(connect(redis_url))
    big = start_server(redis_url, tmp_path, "QM1", "--lease-ms", "1500")
    peer = start_server(redis_url, tmp_path, "QM2", "--lease-ms", "1500")
    try:
        _a_large_uow_beside_other_clients(redis_url, admin, big, peer)
    finally:  # a failed check leaves no server behind to write into the next test's CF
        for srv in (big, peer):
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()


def _a_large_uow_beside_other_clients(redis_url: str, admin: Admin, big: ServerProc, peer: ServerProc) -> None:
    epochs = {m: admin.epoch(m) for m in ("QM1", "QM2")}
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def other(srv: ServerProc, tag: bytes) -> None:
        try:
            with Client(srv.endpoint, token=TOKEN) as c:
                i = 0
                while not stop.is_set():
                    t0 = time.monotonic()
                    c.put("Q2", tag + b"%d" % i)
                    c.commit()
                    c.get("Q2", wait_ms=5000)
                    c.commit()
                    latencies.append(time.monotonic() - t0)
                    i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    workers = [threading.Thread(target=other, args=(srv, tag)) for srv, tag in ((big, b"a"), (peer, b"b"))]
    for w in workers:
        w.start()
    refused_at = -1
    try:
        with Client(big.endpoint, token=TOKEN) as app:
            t0 = time.monotonic()
            for i in range(200_000):
                try:
                    app.put("Q1", b"x" * 100)
                except SyncpointLimitError:
                    refused_at = i
                    break
            put_s = time.monotonic() - t0
            assert app.uow_open
            t0 = time.monotonic()
            app.commit()
            commit_s = time.monotonic() - t0
        time.sleep(1.0)  # the others go on after the commit
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    assert not errors, errors
    assert refused_at == 10_000
    assert _depth(redis_url, "Q1") == 10_000
    assert big.proc.poll() is None and peer.proc.poll() is None, (big.log_text(), peer.log_text())
    assert {m: admin.epoch(m) for m in ("QM1", "QM2")} == epochs  # nobody was fenced
    assert "fenced" not in big.log_text() + peer.log_text()
    p99, worst = _percentile(latencies, 0.99), max(latencies)
    print(f"\n200,000-message UOW: refused at {refused_at} after {put_s:.1f} s, commit of 10,000 {commit_s:.2f} s; "
          f"other clients: {len(latencies)} round trips, p50 {_percentile(latencies, 0.5) * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms")
    assert len(latencies) > 50
    assert p99 < 0.5, f"p99 {p99 * 1000:.0f} ms"
    assert big.stop() == 0 and peer.stop() == 0
