"""The edges of the service: clients that leave while their get waits, and messages near and over the size limits
(docs/architecture.md, the limits table). These faults act as clients themselves, every call in the history."""

from __future__ import annotations

import random
import signal
import socket
import struct
import time
from functools import partial
from typing import Any

from cfemu.admin import Admin
from cfemu.errors import MQError
from cfemu.limits import DESCRIPTOR_ALLOWANCE
from qsg.chaos.faults.heal import client_ep, history_of, restart
from qsg.chaos.faults.kind import FaultError, FaultKind, FaultSpec, Step, register
from qsg.chaos.group import EDGE_QUEUE, ChaosGroup
from qsg.chaos.history import OK as CALL_OK
from qsg.chaos.history import UNKNOWN as CALL_UNKNOWN
from qsg.chaos.workload import PutSpec, Runner, make_body
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.service.client import Client, handshake
from sqm.service.protocol import ENVELOPE, PRE_HELLO_MAX_FRAME, encode_frame
from sqm.wings import WINGS

LEAVE_WAIT_MS = 20_000  # the waiting get's wait: far longer than the client stays
EDGE_FRAME = 2**20  # the frame big-messages gives its target SQM: less than EDGE holds (4 MiB by default)
BIG_MEMBER = "QMBIG"  # the in-process member big-messages puts through (its log is in the group's log root)


def _sized(msg: str, length: int) -> int:
    """The payload size (PutSpec.size) that makes the chaos body of ``msg`` exactly ``length`` bytes long."""
    return length - len(make_body(msg, 0))


def _leave_during_get(g: ChaosGroup, ep: tuple[str, int], correlid: bytes, syncpoint: bool, stay_s: float,
                      reset: bool) -> None:
    """A raw client: hello, a get by correlation id with a long wait, then gone (a close, or a reset) while the
    get waits. Raw, because the client library always reads its reply."""
    sock = socket.create_connection(ep, timeout=5.0)
    try:
        try:
            handshake(sock, token=g.c.token, client_name="leaver", max_frame=PRE_HELLO_MAX_FRAME)
        except MQError as e:
            raise FaultError(f"the leaving client's handshake was refused: {e}") from None
        sock.sendall(encode_frame({"id": 1, "op": "get", "args": {
            "queue": EDGE_QUEUE, "wait_ms": LEAVE_WAIT_MS, "syncpoint": syncpoint, "correlid": correlid}}))
        time.sleep(stay_s)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def client_leaves_waiting_get(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A waiting get must end with its connection and take nothing. Each round a client sends
    a get by correlation id with a 20 s wait and leaves; only then is a message with that correlation id put; a
    second client must find it there (a get that outlived its client would have consumed it for nobody: the
    checker's ``undelivered``; docs/invariants.md, invariant 1)."""
    h = history_of(g)
    rnd = random.Random(f"leave-{f.n}-{f.at}-{f.target}")
    ep = client_ep(g, f.target)
    out: dict[str, Any] = {"found_after_leave": 0, "backout_counts": []}
    for i, syncpoint in enumerate((False, True, rnd.random() < 0.5)):
        name, correlid = f"leaver{f.n}.{i}", f"L{f.n}.{i}".encode()
        stay_s, reset = rnd.choice((0.2, 0.5, 1.0)), rnd.random() < 0.5
        op = h.invoke(name, "get", uow=f"{name}.get" if syncpoint else None, queue=EDGE_QUEUE,
                      syncpoint=syncpoint, wait_ms=LEAVE_WAIT_MS, correlid=correlid.hex())
        _leave_during_get(g, ep, correlid, syncpoint, stay_s, reset)
        h.complete(op, CALL_UNKNOWN, reason="client left", left=True)
        step(f"{name} left its waiting get after {stay_s}s ({'reset' if reset else 'close'}, "
             f"syncpoint {syncpoint})")
        time.sleep(0.5)
        msg = f"leave{f.n}-{i}"
        with Client([ep], token=g.c.token, client_name=f"{name}-after", request_timeout=10.0) as c:
            putter = Runner(h, c, f"{name}-putter", f"{name}.put")
            put = partial(c.put, EDGE_QUEUE, make_body(msg, 64), syncpoint=False, correlid=correlid)
            outcome, _ = putter.call("put", put, uow=None, msg=msg, queue=EDGE_QUEUE, priority=0, persistent=True,
                                     syncpoint=False, expiry_ms=0, correlid=correlid.hex())
            if outcome != CALL_OK:
                continue
            time.sleep(1.5)  # a get that outlived its client would have taken it by now
            taker = Runner(h, c, f"{name}-taker", f"{name}.take")
            outcome, got = taker.get(EDGE_QUEUE, wait_ms=2000, correlid=correlid)
            if outcome == CALL_OK:
                out["found_after_leave"] += 1
                out["backout_counts"].append(got[0].backout_count)
            taker.end(outcome == CALL_OK)
    step("heal")
    return out


register(FaultKind(
    "client-leaves-waiting-get", client_leaves_waiting_get, number=17, cost_s=9.0,
    doc="three rounds (outside syncpoint, under it, either): a raw client says hello, sends a get by correlation id "
        "on EDGE with a 20 s wait through the SQM's client proxy and leaves after 0.2-1 s (a close or a reset); 0.5 s "
        "later a message with that correlation id is put, and 1.5 s later a second client must get it (all in the "
        "history: the left get is `unknown` with `left`)"))


def big_messages(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Messages near and over the size limits, in process and through the service. The target
    SQM serves with frames smaller than EDGE holds; an in-process member puts at the queue's limit (and over it:
    refused); through the target a put over its frame is refused at the client (2218), a get of a message its
    reply cannot carry fails (2080) and takes nothing, a browse says so instead of losing its connection; a client
    that accepts small frames is never sent more; healed, the target delivers the longest message whole. A broken
    expectation is a FaultError (the run fails); a message consumed for nobody is the checker's."""
    h = history_of(g)
    target = f.target
    other = next((n for n in g.names if n != target), target)
    client = g.cf()
    try:
        limit = Admin(client).queue_def(EDGE_QUEUE).max_msg_length
    finally:
        client.close()
    problems: list[str] = []

    def expect(what: str, outcome: str, res: Any, reason: int | None) -> None:
        got = getattr(res, "reason", None) if outcome != CALL_OK else None
        if got != reason:
            problems.append(f"{what}: expected {reason or 'success'}, got {outcome} {res!r:.160}")

    def body(name: str, length: int, priority: int) -> PutSpec:
        msg = f"big{f.n}-{name}"
        return PutSpec(msg, EDGE_QUEUE, priority, True, 0, _sized(msg, length))

    base = [a for a in g.c.manager(target).get("extra_args", [])]
    if "--max-frame" in base:
        k = base.index("--max-frame")
        del base[k:k + 2]
    g.c.kill_manager(target, signal.SIGTERM, timeout=30.0)
    step("stopped")
    out: dict[str, Any] = {"limit": limit, "frame": EDGE_FRAME}
    longest = body("limit", limit, 9)
    longest_msgid = b""
    try:
        out["restart_s"] = restart(g, target, step, extra_args=[*base, "--max-frame", str(EDGE_FRAME)])
        qm = QueueManager(QueueManagerConfig(name=BIG_MEMBER, log_root=g.c.log_root, redis_url=g.c.cf_url("member"),
                                             lease_ms=g.lease_ms), wings=WINGS)
        qm.start()
        try:
            conn = qm.connect()
            inproc = Runner(h, conn, "big-inproc", f"big{f.n}.in")
            for spec in (longest, body("between", (EDGE_FRAME + limit) // 2, 9)):
                outcome, res = inproc.put(spec, syncpoint=True)
                expect(f"in-process put of {spec.msg}", outcome, res, None)
                if spec is longest and outcome == CALL_OK:
                    longest_msgid = res.msgid
            inproc.end(True)
            outcome, res = Runner(h, conn, "big-inproc", f"big{f.n}.over").put(body("over", limit + 1, 0), False)
            expect("in-process put over the queue's limit", outcome, res, 2030)
        finally:
            qm.stop()
        step(f"in-process member put {limit} bytes and {limit + 1} (refused)")
        with Client([client_ep(g, target)], token=g.c.token, client_name="big-svc", request_timeout=30.0) as c:
            svc = Runner(h, c, "big-svc", f"big{f.n}.svc")
            outcome, res = svc.put(body("wide", EDGE_FRAME + 1024, 0), syncpoint=False)
            expect("put over the target's frame", outcome, res, 2218)
            outcome, res = svc.put(body("fits", EDGE_FRAME - 64 * 1024, 0), syncpoint=True)
            expect("put within the target's frame", outcome, res, None)
            svc.end(True)
            outcome, res = svc.get(EDGE_QUEUE, syncpoint=False)  # the head: one of the p9 messages, > the frame
            expect("get outside syncpoint of a message longer than the target's frame", outcome, res, 2080)
            held = Runner(h, c, "big-svc", f"big{f.n}.svc2")
            outcome, res = held.get(EDGE_QUEUE)
            expect("syncpoint get of a message longer than the target's frame", outcome, res, 2080)
            held.end(False)
            try:
                c.browse(EDGE_QUEUE, limit=50)
                problems.append("browse through the target: its head message fits no reply, yet no refusal")
            except Exception as e:  # noqa: BLE001 (any other failure is what the fault looks for)
                if getattr(e, "reason", None) != 2080:
                    problems.append(f"browse through the target: expected 2080, got {e!r:.160}")
        step("through the target: refusals checked")
        with Client([client_ep(g, other)], token=g.c.token, client_name="big-narrow", max_frame=EDGE_FRAME,
                    request_timeout=30.0) as c:
            outcome, res = Runner(h, c, "big-narrow", f"big{f.n}.narrow").get(EDGE_QUEUE, syncpoint=False)
            expect("get by a client accepting small frames", outcome, res, 2080)
        one = limit + DESCRIPTOR_ALLOWANCE + 2 * ENVELOPE  # one message at the limit fits; two never
        with Client([client_ep(g, other)], token=g.c.token, client_name="big-browse", max_frame=one,
                    request_timeout=30.0) as c:
            seen = c.browse(EDGE_QUEUE, limit=50)
            if not (seen and getattr(seen, "more", False)):
                problems.append(f"browse of a queue two of whose messages do not fit one reply: {len(seen)} "
                                f"messages, more={getattr(seen, 'more', None)}")
    finally:
        if g.running(target):
            g.c.kill_manager(target, signal.SIGTERM, timeout=30.0)
        out["heal_restart_s"] = restart(g, target, step, extra_args=base)
    step("heal")
    if longest_msgid:  # the limits agree: the longest message a queue holds goes through a healed SQM
        with Client([client_ep(g, target)], token=g.c.token, client_name="big-wide", request_timeout=30.0) as c:
            taker = Runner(h, c, "big-wide", f"big{f.n}.wide")
            outcome, res = taker.get(EDGE_QUEUE, msgid=longest_msgid, wait_ms=2000)
            expect(f"get of {longest.msg} ({limit} bytes) through the healed target", outcome, res, None)
            taker.end(outcome == CALL_OK)
    if problems:
        raise FaultError("; ".join(problems))
    return out


register(FaultKind(
    "big-messages", big_messages, number=18, cost_s=12.0,
    doc="the SQM is restarted with `--max-frame 1 MiB` (less than EDGE's 4 MiB); an in-process member (QMBIG, its "
        "log in the log root) puts at EDGE's limit and between the two in one UOW, and one byte over the limit (must "
        "fail 2030); through the SQM: a put over its frame (must fail at the client, 2218), one within it, a get "
        "outside syncpoint and one under syncpoint of the head message (must fail 2080 and take nothing), a browse "
        "(2080, not a lost connection); through another SQM a client accepting 1 MiB frames (get: 2080) and one "
        "accepting one message at the limit (browse: one message, `more`); healed (restarted without the option), "
        "the longest message is got whole through the SQM. A broken expectation is a fault error (the run fails)"))


__all__ = ["BIG_MEMBER", "EDGE_FRAME", "LEAVE_WAIT_MS"]
