"""The service's event loop runs the puts, gets and commits under syncpoint that arrive together from many
connections as one batch (sqm.core.syncpoint_calls). Real redis-server, real `sqm run` processes, real sockets.

Each request of a batch keeps its own outcome and each unit of work stays its connection's; a member killed
(SIGKILL) inside a batch of commits, before or after its force, loses no acknowledged commit and applies no
unacknowledged one once a peer has recovered its work."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.service.client import Client
from sqm.service.server import EXIT_FENCED
from tests.sqm.test_service_event_loop import _open_uows, client, loop_counts, raw, send
from tests.support.group import define_group
from tests.support.killed_member import killed_by_failpoint, log_on_disk, peer_recovered
from tests.support.service_proc import OP_TOKEN, ServerProc, start_server


def test_commits_sent_together_run_in_one_batch_each_with_its_own_outcome(fresh_redis: Any, tmp_path: Path) -> None:
    """Five connections each hold a unit of work (three with a put on one structure, one with a put on a structure
    then set RECOVERING, one with nothing) and send their commits before any reply is read. The puts and the
    commits run on the event loop; each commit's reply is its own: the three commit, the one whose structure
    cannot take it now hears its commit pending (and it completes once the structure is back), the empty one
    commits nothing, and one refusal fails no other."""
    define_group(fresh_redis.url, queues=("S1", "S2", "S3"))
    admin = Admin(connect(fresh_redis.url))
    admin.ensure_structure("SLOW", ("SQ1",))
    srv = start_server(fresh_redis.url, tmp_path, "QM1")
    try:
        before = loop_counts(srv)
        conns = [raw(srv) for _ in range(5)]
        try:
            for r, queue in zip(conns, ("S1", "S2", "S3", "SQ1"), strict=False):
                assert r.request("put", {"queue": queue, "body": queue.encode()})["ok"]
            admin.set_state("SLOW", "RECOVERING")
            ids = [send(r, "commit", {}) for r in conns]  # out at once: they arrive in one turn as far as they can
            replies = [r.reply() for r in conns]
        finally:
            for r in conns:
                r.close()
        assert [rep["id"] for rep in replies] == ids
        assert [rep["ok"] for rep in replies] == [True, True, True, False, True], replies
        assert replies[3]["error"]["type"] == "OutcomePendingError", replies[3]
        assert not any(rep["uow"] for rep in replies)  # every unit of work ended, the pending one decided
        after = loop_counts(srv)
        assert after["batched_requests"] - before["batched_requests"] == 4 + 5  # the puts and the commits
        with client(srv) as c:
            for queue in ("S1", "S2", "S3"):
                assert c.get(queue, syncpoint=False).body == queue.encode()
            admin.set_state("SLOW", "ACTIVE")
            assert c.get("SQ1", syncpoint=False, wait_ms=20_000).body == b"SQ1"  # the pending commit completed
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_a_unit_of_work_spans_batches_and_stays_its_connection_s(fresh_redis: Any, tmp_path: Path) -> None:
    """Four clients each put three messages under syncpoint, then commit or back out, all at once:
    what each sees and what is left is what its own unit of work did, whichever batches carried its requests."""
    define_group(fresh_redis.url, queues=("U1",))
    srv = start_server(fresh_redis.url, tmp_path, "QM1")
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            with client(srv) as c:
                for n in range(3):
                    c.put("U1", b"u%d-%d" % (k, n))
                if k % 2:
                    c.backout()
                else:
                    c.commit()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    try:
        before = loop_counts(srv)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        with client(srv) as c:
            left = sorted(m.body for m in c.browse("U1"))
        assert left == sorted(b"u%d-%d" % (k, n) for k in (0, 2) for n in range(3))
        after = loop_counts(srv)
        assert after["batched_requests"] - before["batched_requests"] >= 4 * 3 + 2  # the puts and the commits
    finally:
        assert srv.stop() == 0, srv.log_text()


# --- kill -9 inside a batch of commits -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["lifecycles-before-force=25", "lifecycles-after-force=25"])
def test_kill_9_inside_a_batch_of_commits_loses_no_acknowledged_commit(fresh_redis: Any, tmp_path: Path,
                                                                       where: str) -> None:
    """Twelve clients run lifecycles under syncpoint (put, commit, get, commit: four requests) on one member, whose
    event loop runs the requests that arrive together as one batch. The member dies (SIGKILL) in a batch, before
    its force or after it (its COMMITs on disk, no reply sent). A COMMIT appended while the finisher forced
    earlier batches may be on disk before the killed batch's own force: its client heard nothing, so it is in
    doubt, and the victim's log on disk is what decides it. After peer recovery: every acknowledged commit is in
    that log (acknowledged only once forced), no put whose commit was acknowledged is lost (unless a get of it had
    its commit in doubt), no message whose get's commit was acknowledged comes back, nothing is there that no
    client was told was committed or had in doubt, and each commit in doubt ended as that log decides it."""
    acked_puts: set[bytes] = set()
    unknown_puts: set[bytes] = set()
    acked_gets: set[bytes] = set()
    doubtful_gets: set[bytes] = set()  # the messages got whose commit's outcome is not known
    gets_unseen = [0]  # gets whose message the client never saw (their commit never came)
    lock = threading.Lock()

    def lifecycles(victim: ServerProc, k: int) -> None:
        with client(victim, reconnect_timeout=1) as c:
            for n in range(2000):
                body = b"c%d-m%d" % (k, n)
                try:
                    c.put("K6", body)
                    c.commit()
                except Exception:  # the member died: the put's outcome is unknown to its client
                    with lock:
                        unknown_puts.add(body)
                    return
                with lock:
                    acked_puts.add(body)
                try:
                    got = c.get("K6", wait_ms=10_000).body
                except Exception:  # nothing committed: its unit of work is backed out by recovery
                    with lock:
                        gets_unseen[0] += 1
                    return
                try:
                    c.commit()
                except Exception:  # its outcome unknown: the message may be consumed
                    with lock:
                        doubtful_gets.add(got)
                    return
                with lock:
                    acked_gets.add(got)

    with killed_by_failpoint(str(fresh_redis.url), tmp_path, "K6", where) as killed:
        killed.run_clients(lifecycles, 12, join_timeout=180, what=f"the member was not killed at {where}")
        assert acked_gets, "no lifecycle was acknowledged before the kill"
        with client(killed.peer) as check:
            deadline = time.monotonic() + 30
            left: list[bytes] = []
            while True:  # a message the recovery backs out is back once its unit of work is
                left = [m.body for m in check.browse("K6", 10_000)]
                if set(acked_puts - acked_gets - doubtful_gets) <= set(left) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        there = set(left)
        assert len(left) == len(there), left
        assert not there & acked_gets, "a message whose get's commit was acknowledged came back"
        lost = acked_puts - acked_gets - there
        assert lost <= doubtful_gets, f"acknowledged puts lost: {sorted(lost - doubtful_gets)}"
        assert there <= acked_puts | unknown_puts, "a message no client had committed or had in doubt"
        # What the peer did is what the victim's log on disk decides (a reply that was never sent decides nothing:
        # a COMMIT that a force of an earlier batch took to disk, appended before the killed batch was handed to
        # the finisher, is committed though its client heard nothing; one that reached no disk is backed out).
        on_disk = log_on_disk(killed.victim.log_root / "QM1")
        assert all(on_disk.put_committed(b) for b in acked_puts), "a put's commit acknowledged before it was forced"
        assert all(on_disk.get_committed(b) for b in acked_gets), "a get's commit acknowledged before it was forced"
        applied = {b for b in unknown_puts if on_disk.put_committed(b)}
        assert there & unknown_puts <= applied, "a put whose COMMIT never reached the disk was applied"
        assert applied - on_disk.got <= there, "a put whose COMMIT reached the disk was not applied"
        consumed = {b for b in doubtful_gets if on_disk.get_committed(b)}
        assert not there & consumed, "a get whose COMMIT reached the disk did not consume its message"
        assert doubtful_gets - consumed <= there, "a get whose COMMIT never reached the disk consumed its message"



def test_clients_that_vanish_mid_unit_of_work_have_it_backed_out(fresh_redis: Any, tmp_path: Path) -> None:
    """Thirty clients each get a message and put one under syncpoint on the event loop, read the replies, (some
    send their commit and) reset their connection (RST) without reading more, while other clients' batches run: as
    on the connection's thread, each open unit of work is backed out (its got message available again, its put
    gone), a commit that ran is committed whole, and no unit of work is left open."""
    define_group(fresh_redis.url, queues=("V1", "V2"))
    srv = start_server(fresh_redis.url, tmp_path, "QM1")
    stop = threading.Event()

    def busy() -> None:  # other connections' batches run meanwhile
        with client(srv) as c:
            while not stop.is_set():
                c.put("V2", b"busy")
                c.commit()
                c.get("V2")
                c.commit()

    try:
        with client(srv) as c:
            c.put_batch([b"m%d" % k for k in range(30)], queue="V1", syncpoint=False)
        others = [threading.Thread(target=busy) for _ in range(3)]
        for t in others:
            t.start()
        for k in range(30):
            r = raw(srv)
            send(r, "get", {"queue": "V1"})
            send(r, "put", {"queue": "V1", "body": b"gone-%d" % k})
            assert r.reply()["ok"] and r.reply()["uow"]  # the unit of work is open on the member
            if k % 3 == 0:
                send(r, "commit", {})
            r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            r.close()
        stop.set()
        for t in others:
            t.join(timeout=60)
        deadline = time.monotonic() + 60
        while (uows := _open_uows(srv)) != 0:
            assert time.monotonic() < deadline, f"units of work left open: {uows}"
            time.sleep(0.2)
        with client(srv) as c:
            left = [m.body for m in c.browse("V1", 1000)]
        assert len(left) == len(set(left)), left
        originals = {b"m%d" % k for k in range(30)}
        gone = {b for b in left if b.startswith(b"gone-")}
        assert {int(b[5:]) for b in gone} <= set(range(0, 30, 3)), "a put no commit was sent for is there"
        # a unit of work committed whole: its put there exactly when its get's message is not
        assert len(originals - set(left)) == len(gone), (sorted(originals - set(left)), sorted(gone))
        assert len(left) >= 30 - 10, left
    finally:
        stop.set()
        assert srv.stop() == 0, srv.log_text()


def test_a_batch_with_nothing_to_force_passes_no_failpoint_of_a_force(fresh_redis: Any, tmp_path: Path) -> None:
    """A member whose failpoints kill it at the first force of a batch of commits (before it, and after it) runs
    puts and gets under syncpoint on its event loop, and their backout: none of them forces anything, so the member
    lives on; its first commit under syncpoint is the one that dies."""
    define_group(fresh_redis.url, queues=("F1",))
    srv = start_server(fresh_redis.url, tmp_path, "QM1",
                       env={"SQM_FAILPOINTS": "lifecycles-before-force=1,lifecycles-after-force=1"})
    try:
        with client(srv) as c:
            c.put_batch([b"stays"], queue="F1", syncpoint=False)  # its own path: not a batch of the loop
            for _ in range(3):
                c.put("F1", b"backed out")
                assert c.get("F1").body == b"stays"
                c.backout()
            assert srv.proc.poll() is None, srv.log_text()
            c.put("F1", b"dies")
            with pytest.raises(Exception):  # noqa: B017 - the member died at its force: the outcome is unknown
                c.commit()
        assert srv.proc.wait(timeout=30) == -signal.SIGKILL, srv.log_text()
    finally:
        if srv.proc.poll() is None:
            srv.stop()


@pytest.mark.slow
def test_commits_of_a_member_fenced_mid_batch_each_hear_an_outcome_the_peer_keeps(fresh_redis: Any,
                                                                                 tmp_path: Path) -> None:
    """Six clients hold a put under syncpoint each on QM1; QM1 is paused (SIGSTOP) past its lease and fenced, as
    peer recovery fences a member it takes over; the clients send their commits meanwhile, and QM1 resumes and runs
    them as a batch. Every commit is answered, none told it committed (the member is fenced: no COMMIT of its can
    count), QM1 exits as fenced, and once QM2 has recovered its work no put is on the queue."""
    define_group(fresh_redis.url, queues=("FQ",))
    srv = start_server(fresh_redis.url, tmp_path, "QM1", "--lease-ms", "900")
    peer: ServerProc | None = None
    admin = Admin(connect(fresh_redis.url))
    conns = [raw(srv) for _ in range(6)]
    try:
        for k, r in enumerate(conns):
            assert r.request("put", {"queue": "FQ", "body": b"f%d" % k})["ok"]
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while "QM1" not in admin.lapsed_members():
                assert time.monotonic() < deadline, "the lease never lapsed"
                time.sleep(0.1)
            assert admin.fence("QM1")
            ids = [send(r, "commit", {}) for r in conns]
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        replies = [r.reply() for r in conns]
        assert [rep["id"] for rep in replies] == ids
        assert not any(rep["ok"] for rep in replies), replies
        assert srv.proc.wait(timeout=30) == EXIT_FENCED, srv.log_text()
        peer = start_server(fresh_redis.url, tmp_path, "QM2", "--lease-ms", "900")
        peer_recovered(peer)
        with client(peer) as c:
            assert not [m.body for m in c.browse("FQ")]
    finally:
        for r in conns:
            r.close()
        for s in (srv, peer):
            if s is not None and s.proc.poll() is None:
                s.stop()


def test_status_and_display_conn_count_batched_work_under_syncpoint_as_alone(fresh_redis: Any, tmp_path: Path) -> None:
    """Four clients each put, commit, get and commit under syncpoint, together, on the event loop: the member's
    counters (puts, gets, commits, no backout) and DISPLAY CONN (each connection's requests, its queue, no unit of
    work left) count them as the connections' threads would, one each."""
    define_group(fresh_redis.url, queues=("CQ",))
    srv = start_server(fresh_redis.url, tmp_path, "QM1")
    clients = [client(srv, client_name=f"counted-{k}") for k in range(4)]
    try:
        with Client(srv.endpoint, token=OP_TOKEN, role="operator") as op:
            before, loop_before = op.status(), loop_counts(srv)
            errors: list[BaseException] = []

            def lifecycle(c: Client, k: int) -> None:
                try:
                    c.put("CQ", b"c%d" % k)
                    c.commit()
                    c.get("CQ", wait_ms=10_000)
                    c.commit()
                except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                    errors.append(e)

            threads = [threading.Thread(target=lifecycle, args=(c, k)) for k, c in enumerate(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            after = op.status()
            assert {k: after[k] - before[k] for k in ("puts", "gets", "commits", "backouts")} == \
                {"puts": 4, "gets": 4, "commits": 8, "backouts": 0}
            assert loop_counts(srv)["batched_requests"] - loop_before["batched_requests"] == 16  # all on the loop
            rows = {r["application"]: r for r in op.connections()["connections"]}
        for k in range(4):
            row = rows[f"counted-{k}"]
            assert (row["requests"], row["queues"], row["uow"]) == (4, ["CQ"], None), row
    finally:
        for c in clients:
            c.close()
        assert srv.stop() == 0, srv.log_text()
