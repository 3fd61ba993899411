"""The edges of the service: clients that leave while their get waits, messages near and over the size limits
(docs/architecture.md, the limits table), a unit of work far past MAXUMSGS, and an application that tries to read and
act on other users' work. These faults act as clients themselves, every call in the history."""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgpack

from cfemu.admin import Admin
from cfemu.errors import BadRequestError, MQError, OutcomeUnknownError
from cfemu.limits import DESCRIPTOR_ALLOWANCE
from qsg.chaos.conversations import service_queues
from qsg.chaos.faults.heal import client_ep, history_of, restart
from qsg.chaos.faults.kind import Draw, FaultError, FaultKind, FaultSpec, Step, register
from qsg.chaos.group import BULK_QUEUE, EDGE_QUEUE, ChaosGroup
from qsg.chaos.history import FAIL as CALL_FAIL
from qsg.chaos.history import OK as CALL_OK
from qsg.chaos.history import UNKNOWN as CALL_UNKNOWN
from qsg.chaos.pubsub_actions import TOPIC, topic_queues
from qsg.chaos.workload import PutSpec, Runner, make_body
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.service.client import Client, handshake
from sqm.service.protocol import ENVELOPE, PRE_HELLO_MAX_FRAME, encode_frame
from sqm.wings import WINGS

SNOOP = "snoop"  # the history op of each attempt of the snoop fault (the checker's isolation rule reads it)
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


HUGE_OVER = 3  # puts tried past MAXUMSGS, each refused
LATENCY_EVERY_S = 0.3  # how often the latency watch probes each member while the huge unit of work runs


class _LatencyWatch:
    """Probes every member (a persistent put, commit, get, commit through its client proxy) from a thread, and keeps
    each member's slowest probe and its failures: the other clients' latency while one client's huge unit of work
    runs."""

    def __init__(self, g: ChaosGroup) -> None:
        self.g = g
        self.slowest: dict[str, float] = {n: 0.0 for n in g.names}
        self.failed: dict[str, int] = {n: 0 for n in g.names}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="huge-uow-latency", daemon=True)

    def __enter__(self) -> _LatencyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(LATENCY_EVERY_S):
            for name in self.g.names:
                t0 = time.monotonic()
                ok = self.g.probe(name, timeout=10.0)
                took = time.monotonic() - t0
                self.slowest[name] = max(self.slowest[name], round(took, 3))
                if not ok:
                    self.failed[name] += 1


def _members_state(g: ChaosGroup) -> dict[str, tuple[int | None, int]]:
    """Each member's process and epoch (a fenced member's epoch moves on when it joins again)."""
    client = g.cf()
    try:
        admin = Admin(client)
        return {n: (pid, admin.epoch(n)) for n, pid in g.pids().items()}
    finally:
        client.close()


def _others_served(g: ChaosGroup, watch: _LatencyWatch, before: dict[str, tuple[int | None, int]],
                   out: dict[str, Any], bound: float, meanwhile: str, bound_said: str) -> list[str]:
    """What went wrong for the other clients while one client's work ran (``meanwhile``): a member fenced or dead
    (its process or epoch changed since ``before``), a probe slower than ``bound`` seconds, or a failed one. The
    probes' figures go into ``out``."""
    problems: list[str] = []
    out["slowest_probe_s"] = watch.slowest
    out["failed_probes"] = {n: v for n, v in watch.failed.items() if v}
    after = _members_state(g)
    for n, (pid, epoch) in before.items():
        if after.get(n) != (pid, epoch):
            problems.append(f"{n} was fenced or died while {meanwhile} (process, epoch {pid}, {epoch} -> "
                            f"{after.get(n)})")
    slow = {n: v for n, v in watch.slowest.items() if v > bound}
    if slow or out["failed_probes"]:
        problems.append(f"other clients waited longer than {bound_said} while {meanwhile}: slowest probes {slow}, "
                        f"failed probes {out['failed_probes']}")
    return problems


def huge_uow(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """One client's unit of work far past MAXUMSGS while the workload goes on. Through the target SQM, one unit of
    work puts MAXUMSGS persistent messages on EDGE (each put in the history), then HUGE_OVER more: each must be
    refused with MQRC_SYNCPOINT_LIMIT_REACHED (2024); then it is backed out (BACKOUT, or the client leaves and the
    member backs it out: from the seed), in the CF's bounded steps. Meanwhile every member is probed: none may take
    longer than the lease to answer, and none may be fenced or die. Nothing of it may ever be delivered (the drain
    takes EDGE: the checker's phantom)."""
    h = history_of(g)
    name, end = f"huge{f.n}", str(f.params["end"])
    before = _members_state(g)
    bound = g.lease_ms / 1000
    problems: list[str] = []
    out: dict[str, Any] = {"end": end}
    with _LatencyWatch(g) as watch:
        t0 = time.monotonic()
        with Client([g.direct[f.target]], token=g.c.operator_token, role="operator", client_name=name) as op:
            limit = int(op.status().get("limits", {}).get("max_umsgs") or 0)
        c = Client([client_ep(g, f.target)], token=g.c.token, client_name=name, request_timeout=30.0)
        try:
            if not limit:
                raise FaultError(f"{f.target}'s status names no MAXUMSGS limit")
            out["max_umsgs"] = limit
            runner = Runner(h, c, name, f"{name}.uow")
            for i in range(limit + HUGE_OVER):
                outcome, res = runner.put(PutSpec(f"{name}-{i}", EDGE_QUEUE, 0, True, 0, 16), syncpoint=True)
                refused = outcome != CALL_OK and getattr(res, "reason", None) == 2024
                if i < limit and outcome != CALL_OK:
                    raise FaultError(f"put {i + 1} of the unit of work failed below MAXUMSGS {limit}: {res!r:.200}")
                if i >= limit and not refused:
                    problems.append(f"put {i + 1} (past MAXUMSGS {limit}): expected 2024, got {outcome} {res!r:.160}")
            out["put_s"] = round(time.monotonic() - t0, 3)
            step(f"{limit} puts in one unit of work, {HUGE_OVER} more refused")
            t1 = time.monotonic()
            if end == "backout":
                runner.end(commit=False)
        finally:
            c.close()
        step("heal")
        if end == "leave":  # the member backs out what the session held: a probe's put then finds the CF free
            g.probe(f.target, timeout=30.0)
        out["end_s"] = round(time.monotonic() - t1, 3)
        time.sleep(1.0)
    problems += _others_served(g, watch, before, out, bound, "the huge unit of work ran", f"the lease ({bound:g}s)")
    if problems:
        raise FaultError("; ".join(problems))
    return out


def _huge_end(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"end": d.rnd.choice(("backout", "leave"))}


register(FaultKind(
    "huge-uow", huge_uow, number=29, cost_s=25.0, draw=_huge_end,
    doc="one client, through the SQM, puts MAXUMSGS (its status's `max_umsgs`, 10,000 by default) persistent messages "
        "on EDGE in one unit of work, every put in the history, then 3 more: each must be refused with 2024 "
        "(MQRC_SYNCPOINT_LIMIT_REACHED); then BACKOUT, or the client leaves and the SQM backs it out (from the seed), "
        "in bounded CF steps. Meanwhile every SQM is probed every 0.3 s: a probe slower than the lease, a failed one, "
        "or a member fenced or dead is a fault error; nothing of the unit of work may be delivered (`phantom`)"))


STORM_EXPIRED = 100_000  # expired messages the browsers must page past
STORM_BROWSERS = 4
STORM_S = 3.0  # how long the browsers browse
STORM_PROBE_S = 2.0  # the slowest probe allowed meanwhile (a probe takes tens of ms on an idle group)


def browse_storm(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Browsers of a queue whose live message sits behind STORM_EXPIRED expired ones, while the workload goes on.
    Through the target SQM, BULK (outside the history) gets STORM_EXPIRED non-persistent messages that expire at
    once, then one live message; STORM_BROWSERS clients browse it for STORM_S, each browse of 10 must show exactly the
    live one. Meanwhile every member is probed: one browse call walked the whole queue in the CF, which runs one
    call at a time, so every member's gets, commits and lease renewals waited behind the browsers; a probe slower
    than STORM_PROBE_S, a failed one, or a member fenced or dead is a fault error. The live message is taken at the
    end; the expired ones are left to the members' expiry."""
    name = f"storm{f.n}"
    before = _members_state(g)
    problems: list[str] = []
    out: dict[str, Any] = {"expired": STORM_EXPIRED, "browsers": STORM_BROWSERS}
    live = f"{name}-live".encode()
    with Client([g.direct[f.target]], token=g.c.token, client_name=name, request_timeout=60.0) as c:
        t0 = time.monotonic()
        for start in range(0, STORM_EXPIRED, 1000):
            c.put_batch([{"body": b"x", "persistent": False, "expiry_ms": 1}
                         for _ in range(min(1000, STORM_EXPIRED - start))], queue=BULK_QUEUE, syncpoint=False)
        c.put(BULK_QUEUE, live, syncpoint=False)
        out["fill_s"] = round(time.monotonic() - t0, 3)
        step(f"{STORM_EXPIRED} expired messages and one live on {BULK_QUEUE}")
        time.sleep(0.05)  # every filler expired
        counts = [0] * STORM_BROWSERS
        wrong: list[str] = []
        stop = threading.Event()

        def browser(k: int) -> None:
            with Client([g.direct[f.target]], token=g.c.token, client_name=f"{name}-{k}",
                        request_timeout=60.0) as b:
                while not stop.is_set():
                    try:
                        seen = [m.body for m in b.browse(BULK_QUEUE, limit=10)]
                    except MQError as e:
                        wrong.append(f"browser {k}: {e!r:.160}")
                        return
                    counts[k] += 1
                    if seen != [live]:
                        wrong.append(f"browser {k} saw {len(seen)} messages, not the live one alone")
                        return

        with _LatencyWatch(g) as watch:
            threads = [threading.Thread(target=browser, args=(k,), name=f"{name}-{k}") for k in range(STORM_BROWSERS)]
            for t in threads:
                t.start()
            stop.wait(STORM_S)
            stop.set()
            for t in threads:
                t.join(120)
        out["browses"] = sum(counts)
        problems += wrong[:3]
        step("heal")
        taken = c.get(BULK_QUEUE, syncpoint=False, wait_ms=5000)
        if taken.body != live:
            problems.append(f"the get after the storm took {taken.body[:40]!r}, not the live message")
    problems += _others_served(g, watch, before, out, STORM_PROBE_S,
                               f"the browsers paged past {STORM_EXPIRED} expired messages", f"{STORM_PROBE_S:g}s")
    if not out["browses"]:
        problems.append("no browse ended within the storm")
    if problems:
        raise FaultError("; ".join(problems))
    return out


register(FaultKind(
    "browse-storm", browse_storm, number=35, cost_s=12.0,
    doc="through the SQM, BULK (outside the history) gets 100,000 non-persistent messages that expire at once, then "
        "one live message; 4 clients browse it (10 at a time) for 3 s, each browse must show the live message "
        "alone; meanwhile every SQM is probed every 0.3 s: a probe slower than 2 s, a failed one, or a member fenced "
        "or dead is a fault error (one browse call walked the whole queue in the CF, and every member's calls waited "
        "behind it); the live message is taken at the end"))


SNOOP_TOKENS = ("guess", "")  # the tokens a snooper tries besides those it finds: a guess, and none


def _companions() -> tuple[str, ...]:
    return (*service_queues(), *topic_queues())


def tokens_in_clear(messages: Any) -> list[str]:
    """Logon tokens the entries of a companion queue would carry in clear (its "token" and "receiver_token" fields)."""
    found: list[str] = []
    for m in messages:
        try:
            body = msgpack.unpackb(m.body, raw=False)
        except Exception:  # noqa: BLE001 - a UOW's or a publication's own message
            continue
        if isinstance(body, dict):
            found += [v for k, v in body.items() if k in ("token", "receiver_token") and isinstance(v, str) and v]
    return found


def _victims(g: ChaosGroup, n: int) -> list[tuple[str, str]]:
    """(user, UOW id) of the last units of work the workload's users sent and had accepted (from the history)."""
    h = history_of(g)
    sent: dict[int, str] = {}
    found: dict[str, str] = {}
    events = []
    with open(h.path, encoding="utf-8") as lines:  # only the sends' lines: a run's history grows large
        for line in lines:
            if '"usend"' in line or '"suow"' in line:
                with contextlib.suppress(json.JSONDecodeError):  # the line being written
                    events.append(json.loads(line))
    for e in events:
        if e.get("type") == "invoke" and e.get("op") == "usend":
            sent[e["id"]] = e["client"]
        elif e.get("type") == CALL_OK and e.get("id") in sent and e.get("suow"):
            found[sent[e["id"]]] = str(e["suow"])
    return sorted(found.items())[-n:]


def snoop(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A second application with the group's application token tries to read and act on other users' work: it
    browses (and gets from) the companion queues of the service and the topic, collects any logon token it finds
    there, logs on as real users of the workload with each (and a guess, and none) and as itself, and tries LAST,
    CANCEL, SETUSTATUS and DELETE on their units of work, and receive, unsubscribe and list on a durable subscription
    of a user of its own (logged on with a token the snooper never sees). Every attempt is an op ``snoop`` in the
    history: refused (fail), or not (ok, with ``breach``: the checker's isolation finding)."""
    h = history_of(g)
    name = f"snoop{f.n}"
    ep = client_ep(g, f.target)
    counts = {"attempts": 0, "refused": 0, "breaches": 0}

    def attempt(what: str, as_user: str, token: str, target: str, fn: Callable[[], Any],
                breach: Callable[[Any], bool] = lambda r: True) -> Any:
        counts["attempts"] += 1
        op = h.invoke(name, SNOOP, what=what, as_user=as_user, token=token, target=target)
        try:
            r = fn()
        except OutcomeUnknownError as e:
            h.complete(op, CALL_UNKNOWN, reason=e.reason_name)
            return None
        except MQError as e:
            counts["refused"] += 1
            h.complete(op, CALL_FAIL, reason=e.reason_name, error=type(e).__name__)
            return None
        broke = bool(breach(r))
        counts["breaches"] += broke
        h.complete(op, CALL_OK, breach=broke, detail=repr(r)[:200])
        return r

    def client(user: str | None = None, token: str = "") -> Client | None:
        c = Client([ep], token=g.c.token, client_name=name, request_timeout=10.0)
        if user is None:
            return c
        try:
            c.logon(user, token)
            return c
        except BadRequestError:  # not a token a logon takes
            c.close()
            return None

    own_user, own_token = f"{name}-alice", secrets.token_hex(12)  # never given to the snooper
    sub = f"{name}-sub"
    with Client([ep], token=g.c.token, client_name=f"{name}-alice", request_timeout=10.0) as alice:
        alice.logon(own_user, own_token)
        alice.subscribe(TOPIC, sub, durable=True)
        step(f"{own_user} subscribed to {TOPIC} as {sub}")
        tokens: list[str] = []
        for as_user, c in (("", client()), ("mallory", client("mallory", secrets.token_hex(6)))):
            assert c is not None
            with c:
                for queue in _companions():
                    seen = attempt("browse", as_user, "own", queue, partial(c.browse, queue, 1000))
                    if seen is not None:
                        tokens += tokens_in_clear(seen)
                    attempt("get", as_user, "own", queue,
                            partial(c.get, queue, syncpoint=False, msgid=secrets.token_bytes(24)))
        step(f"companion queues tried: {len(tokens)} tokens found")
        tried = [("found", t) for t in dict.fromkeys(tokens)] + [("guess" if t else "none", t) for t in SNOOP_TOKENS]
        victims = _victims(g, 3)
        for user, uow in victims:
            for kind, token in tried:
                c = client(user, token)
                if c is None:
                    continue
                with c:
                    attempt("LAST", user, kind, user, partial(c.syncpoint, "LAST"))
                    for option, extra in (("CANCEL", {}), ("SETUSTATUS", {"user_status": b"snooped"}),
                                          ("DELETE", {})):
                        attempt(option, user, kind, uow, partial(c.syncpoint, option, uow, **extra))
        mallory = client("mallory", secrets.token_hex(6))
        assert mallory is not None
        with mallory:
            for _, uow in victims:
                for option, extra in (("CANCEL", {}), ("SETUSTATUS", {"user_status": b"snooped"}), ("DELETE", {})):
                    attempt(option, "mallory", "own", uow, partial(mallory.syncpoint, option, uow, **extra))
        step(f"units of work of {', '.join(u for u, _ in victims) or 'nobody yet'} tried")
        for as_user, kind, token in [*((own_user, k, t) for k, t in tried), ("mallory", "own", secrets.token_hex(6))]:
            c = client(as_user, token)
            if c is None:
                continue
            with c:
                attempt("receive_pub", as_user, kind, sub, partial(c.receive_pub, TOPIC, sub))
                attempt("subscriptions", as_user, kind, TOPIC, partial(c.subscriptions, TOPIC),
                        breach=lambda r: any(s.get("name") == sub for s in r))
                attempt("unsubscribe", as_user, kind, sub, partial(c.unsubscribe, TOPIC, sub))
        step(f"{own_user}'s subscription tried")
        still = [s.get("name") for s in alice.subscriptions(TOPIC)]
        if sub not in still:
            step(f"{own_user}'s subscription {sub} is gone", subscriptions=still)
        else:
            alice.unsubscribe(TOPIC, sub)
    step("heal")
    return counts


register(FaultKind(
    "snoop", snoop, number=33, cost_s=4.0,
    doc="a second application with the group's application token, through the SQM: browses and gets (by an unknown "
        "message id) the service's and the topic's companion queues, as no user and as its own, collecting any logon "
        "token it finds; logs on as the workload's users of the last three units of work sent with each, a guess and "
        "none, and tries LAST, CANCEL, SETUSTATUS and DELETE on them (and as itself); logs on likewise as the fault's "
        "own user, whose durable subscription it tries to receive, list and remove. Each attempt is an op `snoop` in "
        "the history; one not refused is the checker's `isolation` finding"))


__all__ = ["BIG_MEMBER", "EDGE_FRAME", "HUGE_OVER", "LEAVE_WAIT_MS", "tokens_in_clear"]
