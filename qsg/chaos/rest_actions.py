"""The chaos workload's REST actions: messages put by HTTP POST and got by HTTP DELETE (a destructive get, outside
syncpoint) on the members' IBM MQ messaging REST ports (docs/rest.md), over real sockets (http.client), with the
workload's bodies (qsg.chaos.bodies: id and CRC32C), each call in the history as a ``put`` or ``get`` with
``via: "rest"`` so that every rule of the checker applies to it, and qsg.chaos.restcheck's to its gets.

A plan's ``rest`` action (qsg.chaos.workload.client_plan draws it, a pure function of (seed, client)) is 1-3 puts
(persistent or not, by the ``ibm-mq-md-persistence`` header; priorities 0/5/9; a few with an expiry) or 1-3 gets,
each on one of the workload's queues, shared with the native client's puts and gets.

What the history records is what the HTTP exchange said:

* put: 201, ``ok`` (committed: the door replies after the commit was forced); 4xx or 503, ``fail`` (refused: the door
  backs its unit of work out before it replies); 500 or any other status, a reset or a timeout after the request
  began to go out, ``unknown`` (on the queue or not); no member accepted the connection: ``fail`` (nothing was sent);
* get: 200 with the body, ``ok`` with the message received (``unknown`` with it when ``ibm-mq-outcome`` says its
  commit is pending or not known: delivered, and perhaps delivered again, as the native client's pending get); 204,
  4xx or 503, ``fail``; 500, another status, a reset or a timeout after the request began to go out, ``unknown``: it
  may have taken a message that nobody received (REST gets are at-most-once, docs/chaos.md).

Each client thread prefers one member's port and, when a connection is refused, tries the others in turn. The
REST ports are the members' own (no fault proxy: a proxy accepts a connection for a member that is down and then
resets it, which would turn a refusal that sent nothing into an unknown outcome); a member whose clients a fault
has cut off (its client proxy cut: ``reachable`` says no) is skipped as one that refuses, so that a fault that
needs a member to serve no client (peer-clock-skew's idle peer) has it so for the REST door too.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qsg.chaos.bodies import make_body, parse_body
from qsg.chaos.history import FAIL, OK, UNKNOWN, History
from qsg.chaos.put_spec import PutSpec, door_puts
from qsg.chaos.restcheck import REST, VIA

REST_SHARE = 0.12  # of the actions, when the run's mix has the REST kind
CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
GET_WAITS_MS = (0, 0, 100, 300)
PATH = "/ibmmq/rest/v3/messaging/qmgr/{qmgr}/queue/{queue}/message"
OUTCOME_HEADER = "ibm-mq-outcome"
# The statuses after which the door has backed the request's unit of work out (docs/rest.md, Errors): a refusal.
# 500 is not one of them: a commit logged but pending, or a failure the door does not know the end of.
REFUSED = frozenset({400, 401, 403, 404, 405, 406, 415, 503})

EMPTY = "empty"  # a get answered 204: nothing to take (not a failure of the door)

RestEndpoint = tuple[str, str, int]  # (member name, host, REST port)


@dataclass(frozen=True)
class Rest:
    puts: tuple[PutSpec, ...] = ()
    gets: tuple[str, ...] = ()  # queues
    wait_ms: int = 0  # each get's wait


def rest_plan(rnd: random.Random, next_msg: Callable[[], str], queues: Sequence[str]) -> Rest:
    """One REST action, drawn from the plan's generator."""
    if rnd.random() < 0.5:
        return Rest(puts=door_puts(rnd, next_msg, queues, 0.7))
    return Rest(gets=tuple(rnd.choice(queues) for _ in range(rnd.randint(1, 3))), wait_ms=rnd.choice(GET_WAITS_MS))


@dataclass
class Reply:
    """One HTTP exchange: the member that answered, and its status, headers and body; or ``error`` (then ``sent``
    says whether any of the request may have reached a member)."""

    qmgr: str = ""
    status: int = 0
    headers: dict[str, str] | None = None
    body: bytes = b""
    error: str = ""
    detail: str = ""
    sent: bool = False


class RestSession:
    """One client thread's REST door: the members' REST ports, its preferred one first, and the group's token."""

    def __init__(self, history: History, endpoints: Sequence[RestEndpoint], name: str, *, token: str | None,
                 reachable: Callable[[str], bool] | None = None) -> None:
        self.h = history
        self.endpoints = list(endpoints)
        self.name = name
        self.token = token
        self.reachable = reachable  # member -> whether clients may reach it now (None: always)

    def exchange(self, method: str, queue: str, *, body: bytes | None = None, query: str = "",
                 headers: dict[str, str] | None = None) -> Reply:
        """One request on a connection of its own, to the first member that accepts the connection."""
        h = {"ibm-mq-rest-csrf-token": "", "Connection": "close", **(headers or {})}
        if self.token is not None:
            h["Authorization"] = f"Bearer {self.token}"
        refused = Reply(error="ConnectionRefusedError", detail="no member accepted the connection")
        for qmgr, host, port in self.endpoints:
            if self.reachable is not None and not self.reachable(qmgr):
                refused = Reply(error="ConnectionRefusedError", detail=f"{qmgr}: its clients are cut off")
                continue
            conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
            try:
                try:
                    conn.connect()
                except OSError as e:  # nothing was sent: the next member
                    refused = Reply(error=type(e).__name__, detail=f"{qmgr}: {e}"[:200])
                    continue
                assert conn.sock is not None
                conn.sock.settimeout(REQUEST_TIMEOUT_S)
                url = PATH.format(qmgr=qmgr, queue=queue) + (f"?{query}" if query else "")
                try:
                    conn.request(method, url, body=body, headers=h)
                    resp = conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException) as e:
                    return Reply(qmgr=qmgr, error=type(e).__name__, detail=str(e)[:200], sent=True)
                return Reply(qmgr=qmgr, status=resp.status, headers={k.lower(): v for k, v in resp.getheaders()},
                             body=data, sent=True)
            finally:
                conn.close()
        return refused


def _refusal(r: Reply) -> dict[str, Any]:
    """What the history keeps of an error reply: the status, and IBM's message id and MQ reason code."""
    out: dict[str, Any] = {"status": r.status, "qmgr": r.qmgr}
    try:
        item = json.loads(r.body)["error"][0]
        out.update(reason=f"{item.get('msgId')} {item.get('reasonCode', '')}".strip(),
                   detail=str(item.get("message", ""))[:200])
    except (ValueError, KeyError, IndexError, TypeError):
        out.update(reason=f"HTTP {r.status}")
    return out


class RestRunner:
    """Carries out one REST action, recording each exchange (ops put and get, ``via: "rest"``; each is a unit of
    work of its own, so it names no ``uow``: ``action`` is the plan's action key)."""

    def __init__(self, history: History, session: RestSession, key: str) -> None:
        self.h = history
        self.s = session
        self.key = key

    def put(self, p: PutSpec) -> str:
        op = self.h.invoke(self.s.name, "put", **{VIA: REST}, action=self.key, msg=p.msg, queue=p.queue,
                           priority=p.priority, persistent=p.persistent, syncpoint=False, expiry_ms=p.expiry_ms)
        headers = {"Content-Type": "text/plain;charset=utf-8",
                   "ibm-mq-md-persistence": "persistent" if p.persistent else "nonPersistent",
                   "ibm-mq-md-priority": str(p.priority)}
        if p.expiry_ms:
            headers["ibm-mq-md-expiry"] = str(p.expiry_ms)
        r = self.s.exchange("POST", p.queue, body=make_body(p.msg, p.size), headers=headers)
        if r.error:
            outcome = UNKNOWN if r.sent else FAIL
            self.h.complete(op, outcome, reason=r.error, detail=r.detail, qmgr=r.qmgr)
        elif r.status == 201:
            outcome = OK
            self.h.complete(op, OK, status=201, qmgr=r.qmgr,
                            message_id=(r.headers or {}).get("ibm-mq-md-messageid", ""))
        else:
            outcome = FAIL if r.status in REFUSED else UNKNOWN
            self.h.complete(op, outcome, **_refusal(r))
        return outcome

    def get(self, queue: str, wait_ms: int) -> str:
        """The get's outcome; EMPTY when the queue had nothing (204, in the history a fail)."""
        op = self.h.invoke(self.s.name, "get", **{VIA: REST}, action=self.key, queue=queue, syncpoint=False,
                           wait_ms=wait_ms)
        r = self.s.exchange("DELETE", queue, query=f"wait={wait_ms}", headers={"Accept": "text/plain"})
        if r.error:
            outcome = UNKNOWN if r.sent else FAIL
            self.h.complete(op, outcome, reason=r.error, detail=r.detail, qmgr=r.qmgr)
            return outcome
        if r.status == 200:
            h = r.headers or {}
            msg, crc_ok = parse_body(r.body)
            pending = h.get(OUTCOME_HEADER, "")
            # The door does not tell the backout count: the delivery has none (the checker's order rule leaves
            # REST deliveries out for that).
            fields = {"msg": msg, "crc_ok": crc_ok, "queue": queue, "priority": int(h.get("ibm-mq-md-priority", 0)),
                      "persistent": h.get("ibm-mq-md-persistence") == "persistent", "qmgr": r.qmgr, "status": 200}
            if pending:
                self.h.complete(op, UNKNOWN, reason=f"ibm-mq-outcome: {pending}", **fields)
                return UNKNOWN
            self.h.complete(op, OK, **fields)
            return OK
        if r.status == 204:
            self.h.complete(op, FAIL, reason="MQRC_NO_MSG_AVAILABLE", status=204, qmgr=r.qmgr)
            return EMPTY
        outcome = FAIL if r.status in REFUSED else UNKNOWN
        self.h.complete(op, outcome, **_refusal(r))
        return outcome

    def run(self, a: Rest) -> bool:
        """Every put, or every get, of the action; False when the door refused or did not answer one."""
        ok = True
        for p in a.puts:
            ok = self.put(p) == OK and ok
        for q in a.gets:
            outcome = self.get(q, a.wait_ms)
            ok = ok and outcome in (OK, EMPTY)
        return ok


__all__ = ["REST_SHARE", "Rest", "RestEndpoint", "RestRunner", "RestSession", "rest_plan"]
