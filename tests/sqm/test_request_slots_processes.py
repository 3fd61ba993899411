"""The request slots (sqm.request_slots): what an outsider sees through real `sqm run` processes with one slot
(`--request-slots 1`) on a real CF.

The rules: no request keeps its slot while it blocks, wherever it blocks (the log's force, a get's, receive's or
status wait's poll, a CF that does not answer, the group repository's file lock), so one such request cannot stall
every other request of the member, a ping included: a slot is a lease (--slot-lease-ms). A request that waited for
its slot runs only if the server is not stopping and its client is still there. The slots are bounded and follow
the CPU affinity. Slots do not leak on errors or on clients that leave (both paths), the metrics count the queue,
checkpoints taken inside requests do not deadlock, and a graceful shutdown with requests queued for the slot ends
within its grace."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import MQError, NoMessageError
from sqm.log import LogReader
from sqm.request_slots import RequestSlots, before_wait
from sqm.service.client import Client
from sqm.service.server import ServerConfig, ServerConfigError
from tests.sqm.test_request_slots import metric
from tests.support.group import define_group
from tests.support.service_proc import OP_TOKEN, TOKEN, TOKENS_ENV, ServerProc, start_server
from tests.support.waits import sigstop, wait_until


@pytest.fixture
def group(fresh_redis: Any) -> Any:
    define_group(str(fresh_redis.url), queues=("Q1", "Q2"))
    return fresh_redis


def one_slot_server(cf: Any, tmp_path: Path, *args: str) -> ServerProc:
    return start_server(str(cf.url), tmp_path, "QM1", "--token", TOKEN, "--request-slots", "1", *args)


@pytest.fixture
def slot1(group: Any, tmp_path: Path) -> Iterator[ServerProc]:
    """One slot with its default lease: what an operator runs."""
    srv = one_slot_server(group, tmp_path)
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def slot1_kept(group: Any, tmp_path: Path) -> Iterator[ServerProc]:
    """One slot whose holder keeps it for a minute (--slot-lease-ms 60000): requests stay queued behind a holder that
    waits where it cannot give its slot up, as they all did before the lease. Each connection by its own thread
    (--thread-per-connection), so that its puts and gets outside syncpoint take slots too (on the event loop they
    run together and take none: test_puts_and_gets_outside_syncpoint_on_the_event_loop_do_not_queue_for_a_slot)."""
    srv = one_slot_server(group, tmp_path, "--slot-lease-ms", "60000", "--thread-per-connection")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def timed(call: Callable[[], Any]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` in a thread of its own; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # noqa: BLE001 - reported by the test that looks
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@contextlib.contextmanager
def repository_locked(srv: ServerProc) -> Iterator[None]:
    """The group repository's lock held, as another process of the group holds it while it rewrites
    repository.json (a member's define, a restore's adopt, a migration): cfemu.repository._locked."""
    path = srv.log_root / "_group" / "lock"
    assert path.exists(), "the member created its group repository at its start"
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def slot_held_by_a_define(srv: ServerProc) -> Iterator[threading.Thread]:
    """The only slot held by an operator's define that waits for the group repository's lock (it has defined the
    queue in the CF and now records it durably): nothing before that wait gives its slot up."""
    with repository_locked(srv):
        op = Client(srv.endpoint, token=OP_TOKEN, role="operator")
        t, out = in_thread(lambda: op.define_queue("LATE", "APP1"))
        time.sleep(0.5)  # the define is at the lock by now
        assert t.is_alive(), out
        yield t
    t.join(10)
    op.close()
    assert out and not isinstance(out[0], BaseException), out


# --- a CF that does not answer, or a lock held elsewhere, never stalls the slots --------------------------------------


def test_a_request_on_a_cf_that_does_not_answer_keeps_the_only_slot_for_a_lease_only(group: Any, slot1: ServerProc) -> None:
    with Client(slot1.endpoint, token=TOKEN) as a, Client(slot1.endpoint, token=TOKEN) as b:
        a.put("Q1", b"known", syncpoint=False)  # the queue's definition cached: the browse below is one CF call
        sigstop(group.pid)  # the CF stops answering (a hung host, a long fork, a full network)
        resumed = threading.Timer(3.0, os.kill, (group.pid, signal.SIGCONT))  # well inside the 5 s lease
        resumed.start()
        try:
            t, out = in_thread(lambda: a.browse("Q1"))
            time.sleep(0.3)  # the browse waits for the CF's answer, in its slot
            took = timed(b.ping)
        finally:
            resumed.join()
            os.kill(group.pid, signal.SIGCONT)
        t.join(20)
        assert out and not isinstance(out[0], BaseException), out
    assert took < 1.5, f"a ping waited {took:.1f} s for the slot of a request that waited for the CF"
    assert metric(slot1, "sqm_slot_leases_expired_total") >= 1  # the browse's lease ran out: the ping took it


def test_requests_on_a_silent_cf_time_out_together_not_one_after_another(group: Any, tmp_path: Path) -> None:
    # The CF's socket timeout at 1 s (redis-py reads it from the URL) instead of 30 s; a lease long enough that
    # the member is not fenced by the pause.
    srv = start_server(f"{group.url}?socket_timeout=1", tmp_path, "QM1", "--token", TOKEN, "--request-slots", "1",
                       "--lease-ms", "30000")
    clients = [Client(srv.endpoint, token=TOKEN) for _ in range(4)]
    ended: list[tuple[float, BaseException | None]] = []

    def browse(c: Client, started: float) -> None:
        try:
            c.browse("Q1")
            ended.append((time.monotonic() - started, None))
        except MQError as e:
            ended.append((time.monotonic() - started, e))
    try:
        for c in clients:
            c.put("Q1", b"known", syncpoint=False)  # the definition cached: a browse is one CF call
        sigstop(group.pid)
        try:
            started = time.monotonic()
            threads = [in_thread(lambda c=c: browse(c, started))[0] for c in clients]  # type: ignore[misc]
            for t in threads:
                t.join(15)
        finally:
            os.kill(group.pid, signal.SIGCONT)
    finally:
        for c in clients:
            c.close()
        assert srv.stop() == 0, srv.log_text()
    assert len(ended) == 4 and all(e is not None for _, e in ended), ended  # each got MQRC_CF_STRUC_FAILED-like
    took = sorted(round(t, 1) for t, _ in ended)
    assert took[-1] < 2.5, f"the browses on a silent CF failed after {took} s: one socket timeout after another"


@pytest.mark.soak  # 16 s (the shutdown checkpoint's CF timeouts): `pytest -m soak tests/sqm/test_request_slots_processes.py`
def test_sigterm_with_requests_queued_behind_a_silent_cf_ends_soon_after_the_grace(group: Any,
                                                                                   tmp_path: Path) -> None:
    """12 browses on a CF that does not answer (socket timeout 1 s), one slot, --shutdown-grace 1. With as many slots
    as requests the process ends in about 4 s (the grace, then the shutdown checkpoint's own CF timeouts); with one
    slot the 11 queued browses run one after another after the queue manager stopped, and the exit waits ~12 s."""
    srv = start_server(f"{group.url}?socket_timeout=1", tmp_path, "QM1", "--token", TOKEN, "--request-slots", "1",
                       "--lease-ms", "30000", "--shutdown-grace", "1")
    clients = [Client(srv.endpoint, token=TOKEN) for _ in range(12)]
    took = None
    try:
        for c in clients:
            c.put("Q1", b"known", syncpoint=False)
        sigstop(group.pid)
        try:
            for c in clients:
                in_thread(lambda c=c: c.browse("Q1"))  # type: ignore[misc]
            time.sleep(0.2)
            sent = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                srv.proc.wait(9)
                took = time.monotonic() - sent
        finally:
            os.kill(group.pid, signal.SIGCONT)
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        assert srv.stop() == 0, srv.log_text()
    assert took is not None and took < 8, "the shutdown outlasted its grace by far: queued requests ran after it"


def test_a_define_waiting_for_the_group_repository_lock_does_not_stall_every_other_request(slot1: ServerProc) -> None:
    with Client(slot1.endpoint, token=TOKEN) as b:
        b.ping()
        with slot_held_by_a_define(slot1):
            t, out = in_thread(lambda: timed(lambda: b.put("Q1", b"x", syncpoint=False)))
            t.join(3)
            stalled = t.is_alive()
        t.join(10)
    assert not stalled, "a put waited for the slot of a define that waited for the group repository's lock"


# --- what holds -----------------------------------------------------------------------------------------------------


def test_requests_queued_for_the_slot_are_counted_while_they_wait(slot1_kept: ServerProc) -> None:
    """sqm_waiting_for_slot above 0 while requests queue (the existing tests see it only at 0), the waits counted
    once each, and both back to normal when the holder ends."""
    waits_before = metric(slot1_kept, "sqm_slot_waits_total")
    clients = [Client(slot1_kept.endpoint, token=TOKEN) for _ in range(2)]
    try:
        with slot_held_by_a_define(slot1_kept):
            pings = [in_thread(c.ping) for c in clients]
            deadline = time.monotonic() + 5
            while metric(slot1_kept, "sqm_waiting_for_slot") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(slot1_kept, "sqm_waiting_for_slot") == 2
            assert all(t.is_alive() for t, _ in pings)
        for t, out in pings:
            t.join(10)
            assert out and isinstance(out[0], dict), out
    finally:
        for c in clients:
            c.close()
    assert metric(slot1_kept, "sqm_waiting_for_slot") == 0
    assert metric(slot1_kept, "sqm_slot_waits_total") - waits_before == 2
    assert metric(slot1_kept, "sqm_request_slots") == 1


def test_a_get_queued_for_the_slot_whose_client_left_takes_nothing(slot1_kept: ServerProc) -> None:
    """A client that leaves while its get waits for the slot: when the get gets the slot it sees the client gone
    and takes nothing (the message is not consumed for nobody)."""
    with Client(slot1_kept.endpoint, token=TOKEN) as c:
        c.put("Q1", b"keep me", syncpoint=False)
    with slot_held_by_a_define(slot1_kept):
        leaver = Client(slot1_kept.endpoint, token=TOKEN, request_timeout=0.5)
        with pytest.raises(MQError):  # the client's patience ends while the get waits for the slot
            leaver.get("Q1", syncpoint=False)
        leaver.close()
        time.sleep(0.3)
    time.sleep(0.5)  # the get has had the slot by now
    with Client(slot1_kept.endpoint, token=TOKEN) as c:
        assert c.get("Q1", syncpoint=False).body == b"keep me"


def test_puts_and_gets_outside_syncpoint_on_the_event_loop_do_not_queue_for_a_slot(group: Any, tmp_path: Path) -> None:
    """The only slot held by a define waiting for the group repository's lock (for a minute: the lease): on the
    event loop (the default) a put and a get outside syncpoint run at once all the same, in a batch that takes no
    slot, while a ping (a request of a connection's thread) waits for the slot."""
    srv = one_slot_server(group, tmp_path, "--slot-lease-ms", "60000")
    c, pinger = Client(srv.endpoint, token=TOKEN), Client(srv.endpoint, token=TOKEN)
    try:
        with slot_held_by_a_define(srv):
            assert timed(lambda: c.put("Q1", b"not held back", syncpoint=False)) < 2
            assert c.get("Q1", syncpoint=False).body == b"not held back"
            t, out = in_thread(pinger.ping)
            time.sleep(0.5)
            assert t.is_alive() and not out, "a ping did not wait for the slot the define holds"
        t.join(10)
        assert out and isinstance(out[0], dict), out
    finally:
        c.close()
        pinger.close()
        assert srv.stop() == 0, srv.log_text()


def test_a_put_queued_for_the_slot_whose_client_left_is_not_carried_out(slot1_kept: ServerProc) -> None:
    with slot_held_by_a_define(slot1_kept):
        leaver = Client(slot1_kept.endpoint, token=TOKEN, request_timeout=0.5, reconnect_timeout=0)
        with pytest.raises(MQError):  # the client's patience ends while the put waits for the slot
            leaver.put("Q1", b"for nobody", syncpoint=False)
        leaver.close()
        time.sleep(0.3)
    time.sleep(0.5)  # the put has had the slot by now
    with Client(slot1_kept.endpoint, token=TOKEN) as c, pytest.raises(NoMessageError):
        c.get("Q1", syncpoint=False)


FAILING: dict[str, Callable[[Client], Any]] = {
    "unknown queue": lambda c: c.get("NOSUCHQ", syncpoint=False),
    "companion queue": lambda c: c.put("SVC.CONTROL", b"x"),
    "no message": lambda c: c.get("Q2", syncpoint=False),
    "no message after a wait": lambda c: c.get("Q2", syncpoint=False, wait_ms=50),
    "bad argument": lambda c: c.get("Q2", syncpoint=False, wait_ms=-1),
    "prepare with nothing": lambda c: c.prepare("x" * 300),
    "receive not logged on": lambda c: c.receive("SVC"),
}


@pytest.mark.parametrize("tls", [False, True], ids=["direct", "event-loop (TLS)"])
def test_failing_requests_and_clients_that_leave_mid_request_return_the_only_slot(group: Any, tmp_path: Path,
                                                                                   tls: bool) -> None:
    args: tuple[str, ...] = ()
    ctx = None
    if tls:
        from sqm.service.client import client_tls_context
        from tests.support.certs import _openssl
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "s.key"), "-out",
                 str(tmp_path / "s.pem"))
        args = ("--tls-cert", str(tmp_path / "s.pem"), "--tls-key", str(tmp_path / "s.key"))
        ctx = client_tls_context(str(tmp_path / "s.pem"))
    srv = one_slot_server(group, tmp_path, *args)
    try:
        for _ in range(3):
            with Client(srv.endpoint, token=TOKEN, tls=ctx) as c:
                for call in FAILING.values():
                    with pytest.raises(MQError):
                        call(c)
            # a get that waits, left by its client mid-wait (its connection cut under it)
            leaver = Client(srv.endpoint, token=TOKEN, tls=ctx, reconnect_timeout=0)
            t, out = in_thread(lambda c=leaver: c.get("Q2", syncpoint=False, wait_ms=5_000))  # type: ignore[misc]
            time.sleep(0.3)
            assert leaver._wire is not None
            leaver._wire.sock.shutdown(socket.SHUT_RDWR)
            t.join(10)
            assert out and isinstance(out[0], BaseException), out
            leaver.close()
        time.sleep(0.5)
        with Client(srv.endpoint, token=TOKEN, tls=ctx, request_timeout=5) as c:
            assert timed(lambda: c.put("Q1", b"after", syncpoint=False)) < 2
            assert c.get("Q1", syncpoint=False).body == b"after"
        assert metric(srv, "sqm_waiting_for_slot") == 0
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_checkpoints_taken_inside_requests_through_one_slot_do_not_deadlock(group: Any, tmp_path: Path) -> None:
    """LOGLOAD 5: a request's append takes a checkpoint every few records, forcing the log under the checkpoint's
    lock (the module docstring's case against taking a slot back). Committers, getters that wait and a
    conversation-less mix all finish through one slot."""
    srv = one_slot_server(group, tmp_path, "--logload", "5", "--cf-connections", "4")
    errors: list[BaseException] = []
    got: list[bytes] = []

    def putter(i: int) -> None:
        try:
            with Client(srv.endpoint, token=TOKEN) as c:
                for n in range(25):
                    c.put("Q1", f"{i}-{n}".encode())
                    c.commit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def getter() -> None:
        try:
            with Client(srv.endpoint, token=TOKEN) as c:
                while len(got) < 100:
                    try:
                        got.append(c.get("Q1", wait_ms=200).body)
                        c.commit()
                    except NoMessageError:
                        pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=putter, args=(i,), daemon=True) for i in range(4)]
        threads += [threading.Thread(target=getter, daemon=True) for _ in range(3)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, 40 - (time.monotonic() - started)))
        assert not any(t.is_alive() for t in threads), "requests through one slot stalled (a deadlock?)"
        assert not errors, errors[:3]
        assert len(got) >= 100
    finally:
        assert srv.stop() == 0, srv.log_text()
    taken = [r for _, r in LogReader(srv.log_root / srv.name).records()
             if r["k"] == "CHECKPOINT" and r["why"] == "logload"]
    assert len(taken) >= 5, f"{len(taken)} LOGLOAD checkpoints: the requests did not take them"


def test_sigterm_with_requests_queued_for_the_only_slot_ends_within_the_grace(group: Any, tmp_path: Path) -> None:
    """16 clients committing through one slot (most of them queued for it at any moment: a thread per connection,
    where every request takes a slot) when SIGTERM comes: the process ends within --shutdown-grace, with exit code
    0, and every request is either done or refused."""
    srv = one_slot_server(group, tmp_path, "--shutdown-grace", "3", "--thread-per-connection")
    stop = threading.Event()
    done, errors = [0], list[BaseException]()

    def committer() -> None:
        try:
            with Client(srv.endpoint, token=TOKEN, reconnect_timeout=0.5, request_timeout=10) as c:
                while not stop.is_set():
                    c.put("Q2", b"x" * 512)
                    c.commit()
                    done[0] += 1
        except BaseException as e:  # noqa: BLE001 - looked at below
            errors.append(e)

    threads = [threading.Thread(target=committer, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    assert wait_until(lambda: metric(srv, "sqm_slot_waits_total") > 0, 20, "a commit waited for a slot")
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(20)
    took = time.monotonic() - sent
    stop.set()
    for t in threads:
        t.join(10)
    assert code == 0, srv.log_text()
    # each client ends at the shutdown: refused (quiescing, no queue manager) or its connection closed, nothing else
    assert len(errors) == 16 and all(isinstance(e, MQError | OSError) for e in errors), errors
    assert took < 3 + 5, f"the shutdown took {took:.1f} s with --shutdown-grace 3"
    assert done[0] > 0
    assert "requests still running" not in srv.log_text()


def test_a_slot_held_by_one_thread_is_given_up_by_that_thread_alone() -> None:
    """before_wait in a thread with no request (a helper thread a request started, the log's flush leader of
    another request) gives up nothing: a slot is the request thread's own."""
    slots = RequestSlots(1)
    with slots.running():
        t = threading.Thread(target=before_wait)
        t.start()
        t.join(5)
        assert slots._free.qsize() == 0
    assert slots._free.qsize() == 1


def test_server_config_refuses_fewer_than_one_slot(tmp_path: Path) -> None:
    with pytest.raises(ServerConfigError, match="at least 1"):
        ServerConfig(name="QM1", log_root=tmp_path, token=TOKEN, request_slots=0).check()


def test_a_huge_request_slots_is_refused_in_one_line(tmp_path: Path) -> None:
    def cap() -> None:  # so that the reproduction cannot take the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**29, 3 * 2**29))
    done = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QM1", "--redis-url",
                           "redis://127.0.0.1:1", "--log-root", str(tmp_path), "--cf-wait", "1", "--request-slots",
                           "1000000000"], capture_output=True, text=True, timeout=60, preexec_fn=cap,
                          env={**TOKENS_ENV, "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--request-slots" in lines[0], done.stderr[-2000:]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin the process to one")
def test_the_default_slots_follow_the_cpus_the_process_may_use() -> None:
    done = subprocess.run([sys.executable, "-c", "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))"
                           "[0]}); from sqm.request_slots import default_slots; print(default_slots())"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert int(done.stdout) == 2  # one CPU, plus one

