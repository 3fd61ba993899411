"""The chaos workload's conversation actions (docs/uow.md): units of work (UOWs) sent to and received from a service
through sqm.service.client.Client's logon / send / receive / syncpoint, every call in the history for
qsg.chaos.uowcheck's rules.

A plan's ``conv`` action (qsg.chaos.workload.client_plan draws it, a pure function of (seed, client)) is one of:

* ``send``: a UOW of 1-4 messages (chaos bodies: id and CRC32C), then COMMIT, BACKOUT, or COMMIT then the sender's
  CANCEL (withdrawn, unless a receiver took it first); a quarter with a short lifetime (UWTIME), so that some time
  out while they wait; some QUERY their status at the end. A COMMIT whose outcome is unknown (the connection died)
  is followed, as an application would, by a logon and LAST and QUERY;
* ``receive``: the next UOW, RECV_FIRST .. LAST, up to "end of unit of work", then COMMIT, BACKOUT or CANCEL (a
  postponement while the service's POSTPONE-ATTEMPTS remain); some BACKOUT or CANCEL after one or two messages;
* ``query``: LAST (the client's last UOW, by user id and token) or QUERY of the last UOW it sent.

After healing, drain_service receives every UOW still ACCEPTED (waiting for postponed ones to come back) and then
QUERYs every UOW of the history once more (client ``ufinal``): the final statuses the checker accounts for.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from cfemu.errors import BackedOutError, EndOfUowError, MQError, NoMessageError
from cfemu.uow_attributes import control_queue, data_queue
from qsg.chaos.bodies import make_body, parse_body
from qsg.chaos.client_session import ClientSession
from qsg.chaos.history import FAIL, OK, UNKNOWN, History, load_history
from qsg.chaos.recorded import RecordedRunner, reason_of
from qsg.chaos.uowcheck import DRAIN_CLIENT, FINAL_CLIENT, RECEIVER, SENDER
from sqm.conversations.uowstatus import ACTIVE
from sqm.service.client import Client

log = logging.getLogger("qsg.chaos")

SERVICE = "SVC1"  # defined by qsg.chaos.group, on APP2
# The service's attributes: persistent UOWs with a persistent status (kept 200 lifetimes after the UOW ends, so
# the final pass finds every one), two postponements a second apart, a lifetime short enough that a backlog times
# out during a run (and a sender may ask for a shorter one still).
SERVICE_UOW: dict[str, Any] = {"store": True, "max_messages": 8, "lifetime_s": 20, "status_lifetime": 200,
                               "postpone_attempts": 2, "postpone_delay_s": 1}
SHORT_LIFETIME_S = 3
RECEIVE_WAIT_MS = 300
QUERY = "query"  # the role of a QUERY or LAST: it settles nothing
DRAIN_S = 45.0  # the drain's limit: postponed UOWs come back after a second, orphans after two sweeps


@dataclass(frozen=True)
class Conv:
    role: str  # send, receive, query
    msgs: tuple[tuple[str, int], ...] = ()  # send: (message id, payload size)
    end: str = "COMMIT"  # send: COMMIT, BACKOUT, CANCEL (COMMIT, then withdraw it); receive: COMMIT, BACKOUT, CANCEL
    stop_after: int = 0  # receive: settle after this many messages (0: the whole UOW, to its end)
    lifetime_s: int = 0  # send: UWTIME (0: the service's)
    cancel_after_s: float = 0.0  # send CANCEL: the wait between COMMIT and CANCEL (a receiver may take it first)
    query: bool = False  # send: QUERY its status at the end
    last: bool = True  # query: LAST, else QUERY of the client's last UOW


def conv_plan(rnd: random.Random, next_msg: Callable[[], str]) -> Conv:
    """One conversation action, drawn from the plan's generator."""
    r = rnd.random()
    if r < 0.45:
        n = rnd.randint(1, 4)
        msgs = tuple((next_msg(), rnd.randint(32, 512)) for _ in range(n))
        end = rnd.choices(("COMMIT", "BACKOUT", "CANCEL"), (70, 15, 15))[0]
        return Conv("send", msgs, end, lifetime_s=SHORT_LIFETIME_S if rnd.random() < 0.25 else 0,
                    cancel_after_s=rnd.choice((0.0, 0.1, 0.3)), query=rnd.random() < 0.4)
    if r < 0.85:
        end = rnd.choices(("COMMIT", "BACKOUT", "CANCEL"), (70, 15, 15))[0]
        stop = rnd.randint(1, 2) if end != "COMMIT" and rnd.random() < 0.4 else 0
        return Conv("receive", end=end, stop_after=stop)
    return Conv("query", last=rnd.random() < 0.5)



def _fields(op: str, r: Any) -> dict[str, Any]:
    """What the history keeps of a call's result."""
    if not isinstance(r, dict):
        return {}
    if op == "usend":
        return {"suow": r.get("uow"), "status": r.get("status"), "messages": r.get("messages")}
    if op == "urecv":
        msg, crc_ok = parse_body(bytes(r.get("body") or b""))
        return {"msg": msg, "crc_ok": crc_ok, "suow": r.get("uow"), "recv": r.get("recv"), "status": r.get("status"),
                "deliveries": r.get("deliveries")}
    keep = ("status", "deliveries", "postponements", "moved_to", "messages")
    return {"suow": r.get("uow"), **{k: r[k] for k in keep if k in r}}


class ConvSession(ClientSession):
    """One client thread's conversation: a Client logged on as the thread's user (with the run's token, so LAST
    finds its work), made again, and logged on again, after a failure."""

    def __init__(self, history: History, endpoints: Sequence[tuple[str, int]], name: str, *, user: str,
                 user_token: str, token: str | None) -> None:
        super().__init__(history, endpoints, name, token=token, client_name=name)
        self.user = user
        self.user_token = user_token
        self.last_sent = ""  # the id of the last UOW this session's user committed

    def client(self) -> Client | None:
        """A client logged on, or None (no server answered, or the logon failed: the action is skipped)."""
        c = super().client()
        if c is not None and c.user is None:
            op = self.h.invoke(self.name, "ulogon", user=self.user)
            try:
                c.logon(self.user, self.user_token)
            except (MQError, OSError) as e:
                self.h.complete(op, FAIL, reason=reason_of(e), error=type(e).__name__, detail=str(e)[:200])
                self.close()
                return None
            self.h.complete(op, OK, qmgr=c.qmgr)
        return c

    @property
    def current(self) -> Client | None:
        """The client as it is (None when there is none), without connecting or logging on."""
        return self._c


class ConvRunner(RecordedRunner):
    """Carries out one conversation action, recording each call (op usend, urecv, usync; ``uow`` = the action's
    key)."""

    def __init__(self, history: History, session: ConvSession, key: str) -> None:
        super().__init__(history, session, key, tags={"svc": SERVICE}, fields=_fields,
                         backed_out=(BackedOutError,))
        self.s: ConvSession = session

    def sync(self, c: Client, option: str, role: str, suow: str = "") -> tuple[str, Any]:
        return self.call("usync", lambda: c.syncpoint(option, "" if option == "LAST" else suow), option=option,
                         role=role, suow=suow)

    def run(self, a: Conv) -> bool:
        c = self.s.client()
        if c is None:
            return False
        if a.role == "send":
            ok = self.send(c, a)
        elif a.role == "receive":
            ok = self.receive(c, a)
        elif a.last or not self.s.last_sent:
            ok = self.sync(c, "LAST", QUERY)[0] == OK
        else:
            ok = self.sync(c, "QUERY", QUERY, self.s.last_sent)[0] == OK
        self._leave_nothing_held(a.role)
        return ok

    def finish_nothing_held(self) -> None:
        """The drain's: after a receive that failed, nothing held (a BACKOUT BOTH, else a new session)."""
        self._leave_nothing_held(RECEIVER)

    def _leave_nothing_held(self, role: str) -> None:
        """A settling call that was refused (the UOW changed status meanwhile: a restore or a peer settled it) leaves
        the session holding it: back everything out, so that the next action starts clean (else its sends would
        join a stale UOW); a session that cannot is ended (the server backs it out)."""
        c = self.s.current
        if c is None or c.user is None or not c.held:
            return
        if self.sync(c, "BACKOUT", SENDER if role == "send" else RECEIVER, "BOTH")[0] != OK:
            self.s.close()

    def _abandon(self, c: Client, role: str, suow: str, e: Any) -> bool:
        """A call inside the UOW failed: back out what the session still holds (a lost session backed it out)."""
        if not isinstance(e, BackedOutError) and c.user is not None and c.held:
            self.sync(c, "BACKOUT", role, suow)
        return False

    def _ask_after_unknown(self, suow: str, last: bool) -> None:
        """A settling call's outcome is unknown: log on again and ask, as the application would."""
        c = self.s.client()
        if c is None:
            return
        if last:
            self.sync(c, "LAST", QUERY)
        if suow:
            self.sync(c, "QUERY", QUERY, suow)

    def send(self, c: Client, a: Conv) -> bool:
        suow = ""
        for i, (msg, size) in enumerate(a.msgs):
            body = make_body(msg, size)
            outcome, r = self.call("usend", partial(c.send, SERVICE, body, lifetime_s=a.lifetime_s),
                                   msg=msg, idx=i, of=len(a.msgs), lifetime_s=a.lifetime_s)
            if outcome != OK:
                return self._abandon(c, SENDER, suow, r)
            suow = str(r["uow"])
        if a.end == "BACKOUT":
            return self.sync(c, "BACKOUT", SENDER, suow)[0] == OK
        outcome, _ = self.sync(c, "COMMIT", SENDER, suow)
        if outcome == UNKNOWN:
            self._ask_after_unknown(suow, last=True)
            return False
        if outcome != OK:
            return False
        self.s.last_sent = suow
        if a.end == "CANCEL":
            time.sleep(a.cancel_after_s)
            if self.sync(c, "CANCEL", SENDER, suow)[0] == UNKNOWN:
                self._ask_after_unknown(suow, last=False)
                return False
        if a.query:
            c2 = self.s.client()
            if c2 is not None:
                self.sync(c2, "QUERY", QUERY, suow)
        return True

    def receive(self, c: Client, a: Conv) -> bool:
        outcome, r = self.call("urecv", lambda: c.receive(SERVICE, option="SYNC", wait_ms=RECEIVE_WAIT_MS))
        if outcome == FAIL and isinstance(r, NoMessageError):
            return True  # nothing to receive: an action all the same
        if outcome != OK:
            return self._abandon(c, RECEIVER, "", r)
        suow, got, whole = str(r["uow"]), 1, False
        while not (a.stop_after and got >= a.stop_after):
            outcome, r = self.call("urecv", lambda: c.receive(SERVICE, option="SYNC"))
            if outcome == FAIL and isinstance(r, EndOfUowError):
                whole = True
                break
            if outcome != OK:
                return self._abandon(c, RECEIVER, suow, r)
            got += 1
            if got > SERVICE_UOW["max_messages"]:  # more than a UOW may hold: the checker says so; settle it
                break
        end = a.end if whole or a.end != "COMMIT" else "BACKOUT"
        outcome, _ = self.sync(c, end, RECEIVER, suow)
        if outcome == UNKNOWN:
            self._ask_after_unknown(suow, last=False)
        return outcome == OK

    def finish_whole(self, c: Client, suow: str) -> bool:
        """The drain's receipt after its first message: the rest of the UOW to its end, then COMMIT. One that did not
        commit leaves nothing held, as every workload action (run): a refused COMMIT left the drain's session holding
        the UOW, every later receive answered 'end of unit of work', and the drain went round until its limit while
        the UOW waited for the session to end (CHAOS-RESULTS.md, 2026-11-26 20:10: uow-unsettled)."""
        ok = self._finish_whole(c, suow)
        if not ok:
            self._leave_nothing_held(RECEIVER)
        return ok

    def _finish_whole(self, c: Client, suow: str) -> bool:
        for _ in range(int(SERVICE_UOW["max_messages"])):
            outcome, r = self.call("urecv", lambda: c.receive(SERVICE, option="SYNC"))
            if outcome == FAIL and isinstance(r, EndOfUowError):
                return self.sync(c, "COMMIT", RECEIVER, suow)[0] == OK
            if outcome != OK:
                self._abandon(c, RECEIVER, suow, r)
                return False
        return self.sync(c, "COMMIT", RECEIVER, suow)[0] == OK


def uows_in(events: list[dict[str, Any]]) -> list[str]:
    """Every UOW id the history's calls returned, in the order first seen."""
    seen: dict[str, None] = {}
    for e in events:
        if e.get("type") == OK and e.get("suow"):
            seen.setdefault(str(e["suow"]), None)
    return list(seen)


def drain_service(history: History, endpoints: Sequence[tuple[str, int]], token: str | None, *,
                  limit_s: float = DRAIN_S) -> dict[str, int]:
    """After healing: receive and COMMIT every UOW left on the service, until none is active (postponed ones come
    back after their delay, orphans are settled by the sweepers) or limit_s passes; then QUERY every UOW of the
    history (client ufinal), each answer in the history."""
    deadline = time.monotonic() + limit_s
    drain = ConvSession(history, endpoints, DRAIN_CLIENT, user=DRAIN_CLIENT, user_token="drain", token=token)
    processed = rounds = receipts = 0
    active: list[str] | None = None  # None: every UOW of the history
    try:
        while True:
            rounds += 1
            while time.monotonic() < deadline:
                c = drain.client()
                if c is None:
                    break
                receipts += 1
                runner = ConvRunner(history, drain, f"{DRAIN_CLIENT}.{receipts}")
                outcome, r = runner.call("urecv", partial(c.receive, SERVICE, option="SYNC"))
                if outcome != OK:
                    runner.finish_nothing_held()  # a session left holding a UOW would answer the same next round
                    break
                if runner.finish_whole(c, str(r["uow"])):
                    processed += 1
            pending = active if active is not None else uows_in(load_history(history.path))
            active = []
            c = drain.client()
            for suow in pending:
                if c is None:
                    active.append(suow)
                    continue
                outcome, r = ConvRunner(history, drain, f"{DRAIN_CLIENT}.poll").sync(c, "QUERY", QUERY, suow)
                if outcome != OK or r.get("status") in ACTIVE:
                    active.append(suow)
            if not active or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
    finally:
        drain.close()
    final = ConvSession(history, endpoints, FINAL_CLIENT, user=FINAL_CLIENT, user_token="final", token=token)
    try:
        every = uows_in(load_history(history.path))
        for suow in every:
            c = final.client()
            if c is not None:
                ConvRunner(history, final, f"{FINAL_CLIENT}.q").sync(c, "QUERY", QUERY, suow)
    finally:
        final.close()
    return {"UOWs drained": processed, "drain rounds": rounds, "UOWs still active": len(active or []),
            "UOWs queried": len(every)}


def service_queues() -> tuple[str, ...]:
    """The service's companion queues (its UOWs' messages, their control entries)."""
    return data_queue(SERVICE), control_queue(SERVICE)


__all__ = ["SERVICE", "SERVICE_UOW", "Conv", "ConvRunner", "ConvSession", "conv_plan", "drain_service",
           "service_queues", "uows_in"]
