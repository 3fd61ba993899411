"""The chaos workload's kombu actions: messages published and consumed through the kombu transport
(qsg.kombu_transport, the door Celery applications use), over the members' client ports behind the fault proxies,
with the workload's bodies (qsg.chaos.bodies), each call in the history with ``via: "kombu"`` so that every rule of
the checker applies to it.

A plan's ``kombu`` action (qsg.chaos.workload.client_plan draws it, a pure function of (seed, client)) is 1-3
publishes (persistent or transient by kombu's ``delivery_mode``; priorities 0/5/9; a few with kombu's
``expiration``) or 1-3 deliveries taken with ``basic_get`` and settled, each on one of the workload's queues, shared
with the native client's and the REST door's puts and gets. Each action runs on a kombu connection of its own, so
that a connection a fault broke is never reused; closing it backs out whatever it still holds.

What the history records is what kombu told the application, by the transport's rules (docs/kombu.md):

* publish: returned, ``ok`` (the transport puts and commits in one request, forced to the member's log before the
  reply); OutcomeUnknownError, a broken connection or any error that is not an MQ refusal, ``unknown``; an MQ
  refusal, ``fail``. A publish is a put outside syncpoint: its own unit of work.
* delivery: a get under syncpoint, its own unit of work (the transport holds each delivery on a connection of its
  own): ``get`` ok with the message, then ``commit`` for ``ack`` and for ``reject(requeue=False)`` (both commit the
  get: the message is consumed) or ``backout`` for ``reject(requeue=True)``. A commit that raised BackedOutError is a
  fail backed out (the message comes back); OutcomeUnknownError or a broken connection, unknown. A get that found
  nothing (kombu's None: the transport maps a member or CF not answering to "nothing this time") is a fail: it took
  nothing, since only the ack that never came could have consumed it.
* kombu says only whether a delivery is a redelivery (``delivery_info["redelivered"]``: its backout count above
  0), not its backout count: a first delivery is recorded with count 0; a redelivery's count is inferred by the
  checker as a REST get's is (qsg.chaos.doors.count_untold).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import kombu

from cfemu.errors import BackedOutError, MQError, OutcomeUnknownError
from qsg.chaos.bodies import make_body, parse_body
from qsg.chaos.doors import KOMBU, VIA
from qsg.chaos.history import FAIL, OK, UNKNOWN, History
from qsg.chaos.put_spec import PutSpec, door_puts
from qsg.chaos.recorded import reason_of
from qsg.kombu_transport import members_url
from sqm.service.protocol import ProtocolError

KOMBU_SHARE = 0.10  # of the actions, when the run's mix has the kombu kind
CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
RECONNECT_TIMEOUT_S = 5.0
ACK, REQUEUE, DROP = "ack", "requeue", "drop"  # how a delivery is settled: commit, back out, commit (rejected)

Endpoint = tuple[str, int]


@dataclass(frozen=True)
class Kombu:
    puts: tuple[PutSpec, ...] = ()
    gets: tuple[tuple[str, str], ...] = ()  # (queue, how it is settled)


def kombu_plan(rnd: random.Random, next_msg: Callable[[], str], queues: Sequence[str]) -> Kombu:
    """One kombu action, drawn from the plan's generator."""
    if rnd.random() < 0.5:
        return Kombu(puts=door_puts(rnd, next_msg, queues, 0.8))
    return Kombu(gets=tuple((rnd.choice(queues), rnd.choice((ACK,) * 16 + (REQUEUE,) * 3 + (DROP,)))
                            for _ in range(rnd.randint(1, 3))))


def _cause(e: BaseException) -> BaseException:
    """The transport's own exception behind kombu's library error (kombu re-raises connection and channel errors
    as its own, from the original)."""
    while isinstance(e, kombu.exceptions.KombuError) and e.__cause__ is not None:
        e = e.__cause__
    return e


def _outcome(e: BaseException) -> str:
    """What an exception says of a request that may have changed something: an MQ refusal changed nothing; an
    unknown outcome, a broken connection or anything else may have."""
    e = _cause(e)
    if isinstance(e, OutcomeUnknownError | ProtocolError | OSError):
        return UNKNOWN
    return FAIL if isinstance(e, MQError) else UNKNOWN


class KombuSession:
    """One client thread's kombu door: the members' client endpoints, its preferred one first, and the token."""

    def __init__(self, history: History, endpoints: Sequence[Endpoint], name: str, *, token: str | None) -> None:
        self.h = history
        self.url = members_url(endpoints, token or "")
        self.name = name

    def connect(self) -> kombu.Connection:
        return kombu.Connection(self.url, transport_options={
            "client_name": self.name, "connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
            "reconnect_timeout": RECONNECT_TIMEOUT_S, "max_unacked": 4})


class KombuRunner:
    """Carries out one kombu action on a connection of its own, recording each call (a publish names no ``uow``;
    each delivery's unit of work is ``<key>.k<i>``: ``key`` is the plan's action key)."""

    def __init__(self, history: History, session: KombuSession, key: str) -> None:
        self.h = history
        self.s = session
        self.key = key

    def put(self, conn: kombu.Connection, p: PutSpec) -> str:
        op = self.h.invoke(self.s.name, "put", **{VIA: KOMBU}, action=self.key, msg=p.msg, queue=p.queue,
                           priority=p.priority, persistent=p.persistent, syncpoint=False, expiry_ms=p.expiry_ms)
        try:
            conn.Producer().publish(make_body(p.msg, p.size), routing_key=p.queue, exchange="",
                                    content_type="application/octet-stream", content_encoding="binary",
                                    delivery_mode=2 if p.persistent else 1, priority=p.priority,
                                    expiration=p.expiry_ms / 1000 if p.expiry_ms else None)
        except Exception as e:  # noqa: BLE001 - whatever kombu raised is what the application was told
            outcome = _outcome(e)
            self.h.complete(op, outcome, reason=reason_of(_cause(e)), detail=str(e)[:200])
            return outcome
        self.h.complete(op, OK)
        return OK

    def get(self, conn: kombu.Connection, queue: str, settle: str, n: int) -> bool:
        """One delivery and its settlement; False when the door failed (not when the queue was empty)."""
        uow = f"{self.key}.k{n}"
        op = self.h.invoke(self.s.name, "get", **{VIA: KOMBU}, uow=uow, queue=queue, syncpoint=True)
        try:
            m = conn.default_channel.basic_get(queue, no_ack=False)
        except Exception as e:  # noqa: BLE001 - nothing was delivered, and without an ack nothing is consumed
            self.h.complete(op, FAIL, reason=reason_of(_cause(e)), detail=str(e)[:200])
            return False
        if m is None:
            self.h.complete(op, FAIL, reason="empty")
            return True
        msg, crc_ok = parse_body(m.body if isinstance(m.body, bytes) else str(m.body).encode())
        redelivered = bool(m.delivery_info.get("redelivered"))
        fields: dict[str, Any] = {"msg": msg, "crc_ok": crc_ok, "queue": queue,
                                  "priority": int(m.properties.get("priority") or 0), "redelivered": redelivered}
        if not redelivered:
            fields["backout_count"] = 0
        self.h.complete(op, OK, **fields)
        if settle == REQUEUE:
            return self._settle(uow, "backout", lambda: m.reject(requeue=True))
        return self._settle(uow, "commit", m.ack if settle == ACK else lambda: m.reject(requeue=False))

    def _settle(self, uow: str, op_name: str, fn: Callable[[], Any]) -> bool:
        """``commit`` (ack, or reject without requeue) or ``backout`` (reject with requeue). A backout that raised
        is backed out all the same: the transport closed its connection, and the member backs the work out."""
        op = self.h.invoke(self.s.name, op_name, **{VIA: KOMBU}, uow=uow)
        try:
            fn()
        except Exception as raised:  # noqa: BLE001 - whatever kombu raised is what the application was told
            e = _cause(raised)
            if isinstance(e, BackedOutError):
                self.h.complete(op, FAIL, reason=reason_of(e), backed_out=True, detail=str(e)[:200])
            else:
                self.h.complete(op, _outcome(e) if op_name == "commit" else FAIL, reason=reason_of(e),
                                detail=str(e)[:200])
            return False
        self.h.complete(op, OK)
        return True

    def run(self, a: Kombu) -> bool:
        """Every publish, or every delivery, of the action on a connection of its own; False when the door refused
        or did not answer one."""
        conn = self.s.connect()
        try:
            try:
                conn.connect()
            except Exception:  # noqa: BLE001 - no member answered: nothing was asked of the group
                return False
            ok = True
            for p in a.puts:
                ok = self.put(conn, p) == OK and ok
            for n, (queue, settle) in enumerate(a.gets):
                ok = self.get(conn, queue, settle, n) and ok
            return ok
        finally:
            try:
                conn.release()  # backs out what it still holds (nothing, unless a settle failed)
            except Exception:  # noqa: BLE001, S110 - a connection a fault broke: its member backs its work out
                pass


__all__ = ["KOMBU_SHARE", "Kombu", "KombuRunner", "KombuSession", "kombu_plan"]
