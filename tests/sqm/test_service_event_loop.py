"""The service's event loop (sqm.service.batch_loop): the puts and gets outside syncpoint that arrive together from
many connections run as one batch (sqm.core.lifecycles). Real redis-server, real `sqm run` processes, real sockets.

Each request of a batch keeps its own outcome; a connection's requests are answered in its order; a client that
stops reading its replies holds back nobody else; and a member killed (SIGKILL) inside a batch, before or after
its force, loses no acknowledged message and applies no unacknowledged one once a peer has recovered its work."""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.errors import LogFailedError, NoMessageError
from sqm.log import LogReader
from sqm.service.client import Client
from sqm.service.protocol import HEADER, decode_body, encode_frame
from tests.sqm.test_log_failure import start_member
from tests.support.group import define_group
from tests.support.killed_member import killed_by_failpoint, log_on_disk
from tests.support.lifecycle_ledger import LifecycleLedger
from tests.support.service_proc import OP_TOKEN, TOKEN, Raw, ServerProc, http_get, start_server

QUEUES = ("E1", "E2", "E3", "E4", "E5")


@pytest.fixture(scope="module")
def server(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    client = redis_server.client()
    client.flushall()
    client.close()
    define_group(redis_server.url, queues=QUEUES)
    Admin(connect(redis_server.url)).ensure_structure("TINY", ("FULLQ",), max_entries=1)
    srv = start_server(redis_server.url, tmp_path_factory.mktemp("loop"), "QM1")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def client(srv: ServerProc, **kw: Any) -> Client:
    return Client(srv.endpoint, token=TOKEN, **kw)


def loop_counts(srv: ServerProc) -> dict[str, Any]:
    with Client(srv.endpoint, token=OP_TOKEN, role="operator") as op:
        counts: dict[str, Any] = op.status()["event_loop"]
        return counts


def raw(srv: ServerProc) -> Raw:
    r = Raw(srv.port)
    assert r.login()["ok"]
    return r


def send(r: Raw, op: str, args: dict[str, Any]) -> int:
    """Send a request without waiting for its reply; its id."""
    r.ids += 1
    r.send_bytes(encode_frame({"id": r.ids, "op": op, "args": args}))
    return r.ids


def test_requests_sent_together_run_in_one_batch_each_with_its_own_outcome(server: ServerProc) -> None:
    """Six connections each send one request before any reply is read: a put (ok), a put to a queue that does not
    exist, a put to a full structure, a get of the message there (ok), a get of an empty queue, a get with a bad
    wait. The member takes them in as few batches as they arrived in, and
    each reply is that request's own: one request's refusal fails no other."""
    with client(server) as c:
        c.put("E2", b"there", syncpoint=False)
        c.put("FULLQ", b"fills TINY", syncpoint=False)
    before = loop_counts(server)
    conns = [raw(server) for _ in range(6)]
    try:
        requests = [("put", {"queue": "E1", "body": b"ok", "syncpoint": False}),
                    ("put", {"queue": "NOSUCH", "body": b"x", "syncpoint": False}),
                    ("put", {"queue": "FULLQ", "body": b"x", "syncpoint": False}),
                    ("get", {"queue": "E2", "syncpoint": False}),
                    ("get", {"queue": "E3", "syncpoint": False}),
                    ("get", {"queue": "E3", "syncpoint": False, "wait_ms": -5})]
        # the frames go out at once, so that they arrive in one turn of the loop as far as the kernel lets them
        ids = [send(r, op, args) for r, (op, args) in zip(conns, requests, strict=True)]
        replies = [r.reply() for r in conns]
    finally:
        for r in conns:
            r.close()
    assert [rep["id"] for rep in replies] == ids
    ok = [rep["ok"] for rep in replies]
    assert ok == [True, False, False, True, False, False], replies
    assert replies[3]["result"]["body"] == b"there"
    assert [rep["error"]["type"] for rep in replies if not rep["ok"]] == [
        "UnknownObjectError", "StructureFullError", "NoMessageError", "BadRequestError"]
    after = loop_counts(server)
    assert after["batched_requests"] - before["batched_requests"] == 6
    assert after["batches"] - before["batches"] <= 6
    with client(server) as c:  # the acknowledged put is there, the refused ones are not
        assert c.get("E1", syncpoint=False).body == b"ok"
        with pytest.raises(NoMessageError):
            c.get("E1", syncpoint=False)


def test_concurrent_clients_share_batches(server: ServerProc) -> None:
    """Sixteen clients running put-then-get lifecycles outside syncpoint at once: every message put is got exactly
    once, and batches carried more than one request on average."""
    before = loop_counts(server)
    got: list[bytes] = []
    lock = threading.Lock()

    def lifecycles(k: int) -> None:
        with client(server) as c:
            for n in range(40):
                c.put("E4", b"c%d-%d" % (k, n), syncpoint=False)
                m = c.get("E4", syncpoint=False, wait_ms=10_000)
                with lock:
                    got.append(m.body)

    threads = [threading.Thread(target=lifecycles, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(got) == sorted(b"c%d-%d" % (k, n) for k in range(16) for n in range(40))
    after = loop_counts(server)
    batches = after["batches"] - before["batches"]
    carried = after["batched_requests"] - before["batched_requests"]
    assert carried == 16 * 40 * 2
    assert carried > batches, (carried, batches)  # some requests did run together


def test_a_connection_s_requests_are_answered_in_its_order(server: ServerProc) -> None:
    """One connection sends puts, gets and a ping (a request of the other path) back to back without reading:
    the replies come in the order sent, and the gets take the messages in the order they were put."""
    r = raw(server)
    try:
        sent = [send(r, "put", {"queue": "E5", "body": b"m%d" % i, "syncpoint": False}) for i in range(5)]
        sent.append(send(r, "ping", {}))
        sent += [send(r, "get", {"queue": "E5", "syncpoint": False}) for _ in range(5)]
        replies = [r.reply() for _ in sent]
    finally:
        r.close()
    assert [rep["id"] for rep in replies] == sent
    assert all(rep["ok"] for rep in replies), replies
    assert [rep["result"]["body"] for rep in replies[6:]] == [b"m%d" % i for i in range(5)]


def test_a_client_that_stops_reading_holds_back_no_other(server: ServerProc) -> None:
    """A client asks for 40 messages of 256 KiB (10 MiB of replies) and reads none of them: its replies wait in
    its socket and its own buffer. Meanwhile other clients' lifecycles go on; the stalled one's replies are all
    there, in order, once it reads."""
    big = b"x" * (256 * 1024)
    with client(server) as feeder:
        feeder.put_batch([big] * 40, queue="E3", syncpoint=False)
    stalled = raw(server)
    try:
        sent = [send(stalled, "get", {"queue": "E3", "syncpoint": False}) for _ in range(40)]
        deadline = time.monotonic() + 60
        with client(server) as other:
            for n in range(50):
                other.put("E1", b"other-%d" % n, syncpoint=False)
                assert other.get("E1", syncpoint=False).body == b"other-%d" % n
                assert time.monotonic() < deadline, "the other client was held back"
        replies = [stalled.reply() for _ in sent]
    finally:
        stalled.close()
    assert [rep["id"] for rep in replies] == sent
    assert all(rep["ok"] and rep["result"]["body"] == big for rep in replies)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_client_that_sends_without_reading_is_held_back_by_its_socket(server: ServerProc) -> None:
    """A client pipelines small gets outside syncpoint as fast as its socket takes them and reads no reply. The
    loop reads no more of a connection than a turn's share ahead of the requests it runs: past that, the client's
    own socket holds it back (TCP), as the thread per connection does. The member does not take 64 MiB of requests
    into its memory (each of its turns runs one request of the connection, and would read 256 KiB)."""
    frame = encode_frame({"id": 1, "op": "get", "args": {"queue": "E4", "syncpoint": False}})
    chunk = frame * (2**20 // len(frame))
    target = 64 * 2**20
    r = raw(server)
    rss_before = _rss_kib(server.proc.pid)
    sent = 0
    try:
        r.sock.setblocking(False)
        deadline = time.monotonic() + 10
        view = memoryview(chunk)
        while sent < target and time.monotonic() < deadline:
            try:
                n = r.sock.send(view)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            sent += n
            view = view[n:] if n < len(view) else memoryview(chunk)
        rss_after = _rss_kib(server.proc.pid)
    finally:
        r.close()
    assert sent < target // 2, (f"the member took {sent >> 20} MiB of requests it had not run from one client "
                                f"(its memory grew {(rss_after - rss_before) >> 10} MiB)")
    with client(server) as c:  # the member serves on
        c.put("E1", b"after the flood", syncpoint=False)
        assert c.get("E1", syncpoint=False).body == b"after the flood"


def test_a_poison_message_that_cannot_move_stays_on_its_queue(server: ServerProc, redis_server: Any) -> None:
    """A get outside syncpoint finds a poison message (its backout count at the queue's threshold) whose backout
    queue is full: the move fails, the get hears why, and the message stays on its queue (backed out, as the plain
    path leaves it), not held by a unit of work nobody ends."""
    admin = Admin(connect(redis_server.url))
    admin.ensure_structure("TINYBQ", ("PBQ",), max_entries=1)
    admin.define_queue("PQ", "APP1", backout_threshold=1, backout_queue="PBQ")
    with client(server) as c:
        c.put("PBQ", b"fills TINYBQ", syncpoint=False)
        c.put("PQ", b"poison", syncpoint=False)
        assert c.get("PQ").body == b"poison"
        c.backout()  # its backout count now 1: poison at the next get
    r = raw(server)
    try:
        refused = r.request("get", {"queue": "PQ", "syncpoint": False})
    finally:
        r.close()
    assert not refused["ok"], refused
    with client(server) as c:
        assert [m.body for m in c.browse("PQ")] == [b"poison"], "the poison message is held by a unit of work"


def test_display_conn_counts_a_batched_request_refused_for_its_arguments(server: ServerProc) -> None:
    """DISPLAY CONN counts each request a connection had run, a batched one refused for its arguments (a get with
    a bad wait, a put with a bad priority) as the plain path counts it: requests 2, its last request's time set."""
    r = Raw(server.port)
    assert r.login(client="counted")["ok"]
    try:
        bad_get = r.request("get", {"queue": "E1", "syncpoint": False, "wait_ms": -1})
        bad_put = r.request("put", {"queue": "E1", "body": b"x", "syncpoint": False, "priority": 99})
        assert not bad_get["ok"] and not bad_put["ok"], (bad_get, bad_put)
        with Client(server.endpoint, token=OP_TOKEN, role="operator") as op:
            row, = [c for c in op.connections()["connections"] if c["application"] == "counted"]
    finally:
        r.close()
    assert row["requests"] == 2, row
    assert row["last_request"], row


def _held(srv: ServerProc) -> tuple[int, int]:
    """The member's open file descriptors and threads."""
    pid = srv.proc.pid
    return len(list(Path(f"/proc/{pid}/fd").iterdir())), len(list(Path(f"/proc/{pid}/task").iterdir()))


def _open_uows(srv: ServerProc) -> int:
    with Client(srv.endpoint, token=OP_TOKEN, role="operator") as op:
        return sum(op.status()["uows"].values())


def test_clients_that_vanish_mid_batch_leave_no_fd_thread_or_unit_of_work(server: ServerProc) -> None:
    """Sixty clients each send a put and a get outside syncpoint (and a ping, a request of the other path) and
    reset their connection (RST) without reading a reply, while other clients' batches run. The member closes
    every one of their sockets, ends their threads and holds no unit of work of theirs."""
    with client(server) as c:
        c.put_batch([b"v"] * 60, queue="E2", syncpoint=False)
    fds, threads = _held(server)
    for k in range(60):
        r = raw(server)
        send(r, "put", {"queue": "E2", "body": b"gone-%d" % k, "syncpoint": False})
        send(r, "get", {"queue": "E2", "syncpoint": False})
        if k % 3 == 0:
            send(r, "ping", {})
        r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        r.close()
    deadline = time.monotonic() + 60
    while True:
        now_fds, now_threads = _held(server)
        uows = _open_uows(server)
        if now_fds <= fds + 2 and now_threads <= threads + 2 and uows == 0:
            break
        assert time.monotonic() < deadline, (f"fds {fds} -> {now_fds}, threads {threads} -> {now_threads}, "
                                             f"units of work open: {uows}")
        time.sleep(0.2)
    with client(server) as c:  # each vanished client's put is there at most once
        gone = [m.body for m in c.get_batch("E2", 500, commit=True) if m.body.startswith(b"gone-")]
    assert len(gone) == len(set(gone)), gone


def _get_durations(srv: ServerProc) -> float:
    """How many gets sqm_operation_duration_seconds has observed."""
    status, text = http_get(srv.metrics_port, "/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith("sqm_operation_duration_seconds_count{") and 'op="get"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_batched_request_refused_for_its_arguments_is_timed(server: ServerProc) -> None:
    """sqm_operation_duration_seconds observes every request run, a batched one refused for its arguments (a get
    with a bad wait) as the plain path's handler observes it (whether it returned or raised)."""
    before = _get_durations(server)
    r = raw(server)
    try:
        assert not r.request("get", {"queue": "E1", "syncpoint": False, "wait_ms": -1})["ok"]
    finally:
        r.close()
    assert _get_durations(server) == before + 1


def test_thread_per_connection_is_still_there(fresh_redis: Any, tmp_path: Path) -> None:
    """--thread-per-connection serves each connection by its own thread: no batch runs, and lifecycles work."""
    define_group(str(fresh_redis.url), queues=("T1",))
    srv = start_server(str(fresh_redis.url), tmp_path, "QM1", "--thread-per-connection")
    try:
        with client(srv) as c:
            c.put("T1", b"alone", syncpoint=False)
            assert c.get("T1", syncpoint=False).body == b"alone"
        assert loop_counts(srv) == {"on": False, "batches": 0, "batched_requests": 0, "failed": ""}
    finally:
        assert srv.stop() == 0, srv.log_text()


# --- kill -9 inside a batch --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["lifecycles-before-force=25", "lifecycles-after-force=25"])
def test_kill_9_inside_a_batch_loses_no_acknowledged_message(fresh_redis: Any, tmp_path: Path, where: str) -> None:
    """Twelve clients run lifecycles (a persistent put outside syncpoint, then a get outside syncpoint, each one
    request) on one member, whose event loop runs the requests that arrive together as one batch. The member dies
    (SIGKILL) in its 25th batch with something to force, before its force or after it (its records on disk, no
    reply sent). After peer recovery: every acknowledged put's and get's COMMIT is in the victim's log on disk, no
    acknowledged put is lost (unless a get of it is in doubt), no acknowledged get comes back, nothing is there
    that no client was told was put or had in doubt, and each put or get in doubt ended as that log decides it
    (a force of earlier batches may have taken a COMMIT of the killed batch to disk before the kill)."""
    acked_puts: set[bytes] = set()
    unknown_puts: set[bytes] = set()
    acked_gets: set[bytes] = set()
    doubtful_gets: list[int] = []
    lock = threading.Lock()

    def lifecycles(victim: ServerProc, k: int) -> None:
        with client(victim, reconnect_timeout=1) as c:
            for n in range(2000):
                body = b"c%d-m%d" % (k, n)
                try:
                    c.put("K5", body, syncpoint=False)
                except Exception:  # the member died: the put's outcome is unknown to its client
                    with lock:
                        unknown_puts.add(body)
                    return
                with lock:
                    acked_puts.add(body)
                try:
                    got = c.get("K5", syncpoint=False, wait_ms=10_000).body
                except Exception:  # its outcome unknown: it may have taken a message
                    with lock:
                        doubtful_gets.append(k)
                    return
                with lock:
                    acked_gets.add(got)

    with killed_by_failpoint(str(fresh_redis.url), tmp_path, "K5", where) as killed:
        killed.run_clients(lifecycles, 12, join_timeout=180, what=f"the member was not killed at {where}")
        assert acked_gets, "no lifecycle was acknowledged before the kill"
        with client(killed.peer) as check:
            left = [m.body for m in check.get_batch("K5", 1000, commit=True)]
        there = set(left)
        assert len(left) == len(there), left
        assert not there & acked_gets, "an acknowledged get came back"
        lost = acked_puts - acked_gets - there  # each get in doubt may have taken one, and no more
        assert len(lost) <= len(doubtful_gets), f"acknowledged puts lost: {sorted(lost)}"
        assert there <= acked_puts | unknown_puts, "a message no client had acknowledged or had in doubt"
        # What the peer did is what the victim's log on disk decides: a COMMIT appended while the finisher forced
        # earlier batches may reach the disk with their force, before the killed batch's own; its client heard
        # nothing (in doubt), and the log decides it.
        on_disk = log_on_disk(killed.victim.log_root / "QM1")
        assert all(on_disk.put_committed(b) for b in acked_puts), "a put acknowledged before its COMMIT was forced"
        assert all(on_disk.get_committed(b) for b in acked_gets), "a get acknowledged before its COMMIT was forced"
        applied = {b for b in unknown_puts if on_disk.put_committed(b)}
        assert there & unknown_puts <= applied, "a put whose COMMIT never reached the disk was applied"
        assert applied - on_disk.got <= there, "a put whose COMMIT reached the disk was not applied"
        assert lost <= on_disk.got, "a message lost that no get whose COMMIT reached the disk took"


# --- graceful shutdown with batches in flight ------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_with_batches_in_flight_answers_or_refuses_and_loses_nothing(fresh_redis: Any, tmp_path: Path) -> None:
    """Ten clients run lifecycles on one member, its event loop batching them, when it is told to stop (SIGTERM).
    It exits 0 within its grace; every request was answered, refused, or left unknown by the connection's end; and
    after a restart the queue holds exactly the acknowledged puts no acknowledged get took, give or take the
    requests whose outcome the clients did not hear."""
    define_group(str(fresh_redis.url), queues=("S1",))
    srv = start_server(str(fresh_redis.url), tmp_path, "QM1")
    ledger = LifecycleLedger()
    started = threading.Event()

    def lifecycles(k: int) -> None:
        with client(srv) as c:
            for n in range(100_000):
                if not ledger.put(c, "S1", b"c%d-m%d" % (k, n)) or not ledger.get(c, "S1", wait_ms=5_000):
                    return
                if len(ledger.acked_gets) > 200:
                    started.set()

    threads = [threading.Thread(target=lifecycles, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    assert started.wait(60), "the lifecycles did not get going"
    t0 = time.monotonic()
    assert srv.stop(timeout=30) == 0, srv.log_text()
    assert time.monotonic() - t0 < 15, "the member did not stop within its grace"
    for t in threads:
        t.join(timeout=30)
    again = start_server(str(fresh_redis.url), tmp_path, "QM1")
    try:
        with client(again) as check:
            left = [m.body for m in check.get_batch("S1", 1000, commit=True)]
    finally:
        assert again.stop() == 0, again.log_text()
    ledger.check(left)


# --- the log fails under a batch ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_log_that_fails_under_batches_loses_no_acknowledged_lifecycle(fresh_redis: Any, tmp_path: Path) -> None:
    """Eight clients run lifecycles (put then get outside syncpoint, batched by the event loop) on a member whose
    log reaches its file size limit (EFBIG, as ENOSPC). Killed and restarted with room: no acknowledged get's
    message comes back, no acknowledged put is lost unless a get in doubt may have taken it, and no put told
    'refused' is there."""
    redis_url = str(fresh_redis.url)
    logs, ready = tmp_path / "logs", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("LF",))
    proc = start_member(redis_url, logs, ready, limited=True)
    ledger = LifecycleLedger()
    try:
        port = json.loads(ready.read_text())["port"]

        def lifecycles(k: int) -> None:
            with Client(("127.0.0.1", port), token=TOKEN, reconnect_timeout=1.0) as c:
                for n in range(1000):
                    body = b"c%d-m%d-" % (k, n) + b"x" * 3000
                    if not ledger.put(c, "LF", body, refused=(LogFailedError,)) \
                            or ledger.get(c, "LF", nothing=(NoMessageError,)) is False:
                        return

        threads = [threading.Thread(target=lifecycles, args=(k,)) for k in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert ledger.acked_gets and (ledger.refused_puts or ledger.unknown_puts), \
            "the log did not fail under the lifecycles"
        proc.kill()
        proc.wait(30)
        time.sleep(1.5)  # its lease lapses
        proc = start_member(redis_url, logs, ready, limited=False)
        with Client(("127.0.0.1", json.loads(ready.read_text())["port"]), token=TOKEN) as c:
            there = [m.body for m in c.browse("LF", limit=10_000)]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    ledger.check(there)


# --- a reply read slowly is not an idle connection -------------------------------------------------------------
@pytest.mark.slow
def test_a_reply_read_slowly_past_the_idle_timeout_is_delivered_whole(fresh_redis: Any, tmp_path: Path) -> None:
    """A client with a small receive window reads a 12 MiB message's reply at a few MiB a second, longer than the
    member's idle timeout (1 s): a connection whose reply is being taken is not idle, and the reply arrives whole
    (as the thread per connection, whose send times out only when the client takes nothing)."""
    define_group(str(fresh_redis.url), queues=("Q0",))
    Admin(connect(str(fresh_redis.url))).define_queue("BIG", "APP1", max_msg_length=16 * 2**20)
    srv = start_server(str(fresh_redis.url), tmp_path, "QM1", "--idle-timeout", "1")
    big = bytes(range(256)) * (12 * 2**12)
    try:
        with client(srv) as c:
            c.put("BIG", big, syncpoint=False)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # before connect: a small window
        sock.settimeout(10)
        sock.connect(("127.0.0.1", srv.port))
        r = Raw.__new__(Raw)
        r.sock, r.ids = sock, 100
        try:
            assert r.login()["ok"]
            send(r, "get", {"queue": "BIG", "syncpoint": False})
            got = bytearray()
            started = time.monotonic()
            while True:
                time.sleep(0.02)
                chunk = sock.recv(64 * 1024)
                if not chunk:
                    break
                got += chunk
                if len(got) >= HEADER.size and len(got) >= HEADER.size + HEADER.unpack_from(got)[0]:
                    break
            took = time.monotonic() - started
        finally:
            r.close()
        assert took > 1.0, f"the reply came in {took:.1f}s: not slowly enough to test the idle timeout"
        (frame_length,) = HEADER.unpack_from(got)
        whole = HEADER.size + frame_length
        assert len(got) == whole, f"the reply was cut at {len(got)} of {whole} bytes"
        assert decode_body(bytes(got[HEADER.size:]))["result"]["body"] == big
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_sigterm_backs_out_a_loop_connection_s_open_unit_of_work_before_its_checkpoint(
        fresh_redis: Any, tmp_path: Path) -> None:
    """A connection on the event loop holds a unit of work (a put under syncpoint, run by its thread) when the member
    is told to stop (SIGTERM): the unit of work is backed out before the shutdown checkpoint, which is the log's
    last record, and the member leaves nothing uncommitted on the CF (it leaves the group: no peer recovers it).
    Run a few times: the backout raced the shutdown's cancellation of the connection's task."""
    define_group(str(fresh_redis.url), queues=("Q1",))
    cf = connect(str(fresh_redis.url))
    for name in ("QMA", "QMB", "QMC", "QMD", "QME", "QMF"):
        srv = start_server(str(fresh_redis.url), tmp_path, name)
        with client(srv) as c:
            c.put("Q1", b"in flight at shutdown")
            assert srv.stop(signal.SIGTERM) == 0, srv.log_text()
        records = [r for _, r in LogReader(tmp_path / "logs" / name).records()]
        assert records[-1]["k"] == "CHECKPOINT", f"{name}: {[r['k'] for r in records[-3:]]}"
        assert CF(cf).structure("APP1").depths()["Q1"]["UP"] == 0, f"{name} left an uncommitted put on the CF"
