"""The chaos workload: client threads on several SQMs, every operation recorded in the history.

Each client thread follows a plan that is a pure function of (seed, client number): the same seed gives the
same actions, message ids, payloads and decisions (the interleaving with faults is the machine's). Actions:

* ``uow``: 1-3 puts across the queues (both structures) and 0-2 gets in one unit of work, then commit, or
  (sometimes) backout;
* ``consume``: 1-3 gets, then commit or backout;
* ``put1``: one put outside syncpoint, persistent or not;
* ``2pc``: puts and a get, prepare (two-phase commit, phase one), then the coordinator resolves it through the
  owner's ``resolve`` operation, at once or later (left in doubt, across faults, resolved after healing);
* ``conv``: a unit of work sent to, or received from, a service, or a status query (qsg.chaos.conversations);
* ``pub``: a publication published, publications received for the thread's subscriber, or its subscriber offline
  for a while (qsg.chaos.pubsub_actions);
* ``rest`` (only when the run's mix has it): puts by HTTP POST or destructive gets by HTTP DELETE on the members'
  REST ports (qsg.chaos.rest_actions).
* ``kombu`` (only when the run's mix has it): publishes, and deliveries acknowledged or requeued, through the kombu
  transport Celery applications use (qsg.chaos.kombu_actions).

Messages: persistent or not, priorities 0/5/9 (mostly 0, so that order can be checked), some with an expiry.
Every message has a unique id and a CRC32C of its payload, both in its body (see make_body).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cfemu.errors import BackedOutError, MQError, NoMessageError, OutcomeUnknownError
from qsg.chaos.bodies import delivery_fields, make_body, parse_body, pending_delivery
from qsg.chaos.conversations import Conv, ConvRunner, ConvSession, conv_plan
from qsg.chaos.history import FAIL, OK, UNKNOWN, History
from qsg.chaos.kombu_actions import KOMBU_SHARE, Kombu, KombuRunner, KombuSession, kombu_plan
from qsg.chaos.pubsub_actions import SUBSCRIBERS, Pub, PubRunner, PubSession, pub_plan
from qsg.chaos.put_spec import PutSpec
from qsg.chaos.recorded import reason_of
from qsg.chaos.rest_actions import REST_SHARE, Rest, RestEndpoint, RestRunner, RestSession, rest_plan
from sqm.service.client import Client
from sqm.service.protocol import QueueManagerUnavailableError

log = logging.getLogger("qsg.chaos")

AWAY = "away"
CONV_SHARE = 0.15  # of the actions: conversations with the service (units of work sent and received, queries)
PUB_SHARE = 0.12  # of the actions: publications published and received (durable publish and subscribe)


# --- the plan --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    kind: str  # uow, consume, put1, 2pc, conv, pub, rest, kombu
    puts: tuple[PutSpec, ...] = ()
    gets: tuple[str, ...] = ()  # queues
    commit: bool = True  # for 2pc: the coordinator's decision
    park_s: float = 0.0  # 2pc: leave in doubt this long before the coordinator resolves it (0: at once)
    conv: Conv | None = None  # conv: the conversation action
    pub: Pub | None = None  # pub: the publish/subscribe action
    rest: Rest | None = None  # rest: the REST door's puts or gets
    kombu: Kombu | None = None  # kombu: the kombu transport's publishes or deliveries


def client_plan(seed: int, client: int, queues: tuple[str, ...], *, rest: bool = False,
                kombu: bool = False) -> Iterator[Action]:
    """The endless, reproducible action sequence of one client. ``rest``: REST_SHARE of the actions go through the
    REST door; ``kombu``: KOMBU_SHARE through the kombu transport; without them the plan is what it was before
    those kinds existed (the same seed, the same plan)."""
    rnd = random.Random(f"chaos-{seed}-{client}")
    n = 0
    n_pub = 0

    def next_msg() -> str:
        nonlocal n
        n += 1
        return f"{seed}-{client}-{n}"

    def put_spec(persistent_p: float = 0.9) -> PutSpec:
        return PutSpec(msg=next_msg(), queue=rnd.choice(queues),
                       priority=rnd.choice((0, 0, 0, 0, 5, 9)), persistent=rnd.random() < persistent_p,
                       expiry_ms=rnd.choice((300, 1500, 4000)) if rnd.random() < 0.08 else 0,
                       size=rnd.randint(64, 1024))

    while True:
        share = rnd.random()
        if rest:
            if share < REST_SHARE:
                yield Action("rest", rest=rest_plan(rnd, next_msg, queues))
                continue
            share = (share - REST_SHARE) / (1 - REST_SHARE)  # the other kinds share the rest as before
        if kombu:
            if share < KOMBU_SHARE:
                yield Action("kombu", kombu=kombu_plan(rnd, next_msg, queues))
                continue
            share = (share - KOMBU_SHARE) / (1 - KOMBU_SHARE)
        if share < CONV_SHARE:
            yield Action("conv", conv=conv_plan(rnd, next_msg))
            continue
        if share < CONV_SHARE + PUB_SHARE:
            n_pub += 1
            yield Action("pub", pub=pub_plan(rnd, next_msg, client, n_pub))
            continue
        r = rnd.random()
        if r < 0.45:
            puts = tuple(put_spec() for _ in range(rnd.randint(1, 3)))
            gets = tuple(rnd.choice(queues) for _ in range(rnd.choice((0, 1, 1, 2))))
            yield Action("uow", puts, gets, commit=rnd.random() < 0.88)
        elif r < 0.72:
            yield Action("consume", gets=tuple(rnd.choice(queues) for _ in range(rnd.randint(1, 3))),
                         commit=rnd.random() < 0.9)
        elif r < 0.87:
            yield Action("put1", (put_spec(persistent_p=0.7),))
        else:
            puts = tuple(put_spec(persistent_p=1.0) for _ in range(rnd.randint(1, 2)))
            gets = (rnd.choice(queues),) if rnd.random() < 0.5 else ()
            park = rnd.choice((0.0, 0.0, 0.0, 1.0, 3.0, 6.0, 600.0))  # 600: resolved only after healing
            yield Action("2pc", puts, gets, commit=rnd.random() < 0.7, park_s=park)


# --- running it ------------------------------------------------------------------------------------------------
Endpoint = tuple[str, int]


HEURISTIC = "operator-heuristic"  # the client name of an operator's heuristic resolve (Coordinator)
HEURISTIC_EVERY = 4


@dataclass
class Parked:
    """A prepared (in-doubt) UOW the coordinator resolves later."""

    xid: str
    uow: str  # the server's UOW id
    qmgr: str
    commit: bool
    due: float


@dataclass
class Coordinator:
    """The external transaction coordinator: resolves prepared UOWs through their owner's ``resolve`` op.

    It talks to each owner directly (not through the client-side proxies): the coordinator's own network is not
    under test. Decisions are fixed at prepare time, so a retry after an unknown outcome resolves the same way.
    """

    history: History
    owners: dict[str, Endpoint]  # queue manager name -> its real address
    token: str | None = None
    decisions: dict[str, bool] = field(default_factory=dict)  # xid -> commit?
    parked: list[Parked] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Every HEURISTIC_EVERY-th due resolve, an operator (this token) resolves the same UOW the other way at the same
    # moment, as a heuristic decision taken while the coordinator's is under way: one of the two may succeed, never
    # both (the checker's resolved-twice rule). None: no heuristic decisions.
    operator_token: str | None = None
    resolves_due: int = 0

    def decide(self, xid: str, commit: bool) -> None:
        with self.lock:
            self.decisions[xid] = commit

    def park(self, item: Parked) -> None:
        with self.lock:
            self.parked.append(item)

    def resolve(self, xid: str, uow: str, qmgr: str, commit: bool, *, who: str = "coordinator",
                start: threading.Barrier | None = None) -> str:
        """One resolve attempt: ok, fail, unknown, or "away" (the owner did not answer: try again later). The
        heuristic one (who HEURISTIC) resolves as an operator, by the UOW's id alone; start: wait there, connected,
        for the other resolve of the race."""
        heuristic = who == HEURISTIC
        op = self.history.invoke(who, "resolve", xid=xid, server_uow=uow, qmgr=qmgr, commit=commit)
        try:
            with Client([self.owners[qmgr]], token=self.operator_token if heuristic else self.token,
                        role="operator" if heuristic else "application", client_name=who, connect_timeout=2.0,
                        request_timeout=10.0, reconnect_timeout=1.0) as c:
                if start is not None:
                    with contextlib.suppress(threading.BrokenBarrierError):
                        start.wait(5.0)
                # An application resolves its own: it names the xid; an operator may resolve any.
                c.resolve(uow, commit, xid=None if heuristic else xid)
        except OutcomeUnknownError as e:
            self.history.complete(op, UNKNOWN, reason=reason_of(e))
            return UNKNOWN
        except MQError as e:
            self.history.complete(op, FAIL, reason=reason_of(e), detail=str(e)[:200])
            return AWAY if isinstance(e, QueueManagerUnavailableError) else FAIL
        self.history.complete(op, OK)
        return OK

    def resolve_due(self, now: float) -> None:
        """Resolve every parked UOW whose time has come; keep the ones whose owner cannot be reached."""
        with self.lock:
            due = [p for p in self.parked if p.due <= now]
        for p in due:
            # An owner that is away (killed, restarting) is tried again; any other outcome is final: an unknown
            # or failed resolve is settled by the final pass, which asks every owner what is still in doubt.
            if self._resolve_due(p) == AWAY:
                p.due = now + 0.5
            else:
                with self.lock:
                    self.parked.remove(p)

    def _resolve_due(self, p: Parked) -> str:
        """The coordinator's resolve of a parked UOW; every HEURISTIC_EVERY-th, raced by an operator's opposite one."""
        self.resolves_due += 1
        if self.operator_token is None or self.resolves_due % HEURISTIC_EVERY:
            return self.resolve(p.xid, p.uow, p.qmgr, p.commit)
        start = threading.Barrier(2)
        other = threading.Thread(target=self.resolve, args=(p.xid, p.uow, p.qmgr, not p.commit),
                                 kwargs={"who": HEURISTIC, "start": start}, name="chaos-heuristic", daemon=True)
        other.start()
        try:
            return self.resolve(p.xid, p.uow, p.qmgr, p.commit, start=start)
        finally:
            other.join(30.0)

    def resolve_all(self, indoubt_by_qmgr: dict[str, list[dict[str, Any]]]) -> int:
        """After healing: resolve every UOW still in doubt on any queue manager (presumed abort for a prepare
        whose outcome the client never learned). Returns how many were resolved."""
        n = 0
        for qmgr, uows in sorted(indoubt_by_qmgr.items()):
            for u in uows:
                xid = str(u.get("xid", ""))
                with self.lock:
                    commit = self.decisions.get(xid, False)
                    self.decisions.setdefault(xid, commit)
                if self.resolve(xid, str(u["uow"]), qmgr, commit, who="coordinator-final") == OK:
                    n += 1
        with self.lock:
            self.parked.clear()
        return n


class Workload:
    """Client threads following their plans until stop(), each on its own sqm.service.client.Client."""

    def __init__(self, history: History, endpoints: list[Endpoint], coordinator: Coordinator, *, seed: int,
                 clients: int, queues: tuple[str, ...], token: str | None = None,
                 rest_endpoints: list[RestEndpoint] | None = None,
                 rest_reachable: Callable[[str], bool] | None = None, kombu: bool = False) -> None:
        """``rest_endpoints``: the members' REST ports, when the run's mix has the REST kind (None: it has not);
        ``rest_reachable``: whether clients may reach a member now (a fault may cut its clients off); ``kombu``:
        the run's mix has the kombu kind (through the same client endpoints as the native client)."""
        self.history = history
        self.endpoints = endpoints
        self.kombu = kombu
        self.rest_endpoints = rest_endpoints
        self.rest_reachable = rest_reachable
        self.coordinator = coordinator
        self.seed = seed
        self.queues = queues
        self.token = token
        self._stop = threading.Event()
        self.actions_done = 0
        self._threads = [threading.Thread(target=self._run_client, args=(i,), name=f"chaos-c{i}", daemon=True)
                         for i in range(clients)]
        self._coordinator_thread = threading.Thread(target=self._run_coordinator, name="chaos-coordinator",
                                                    daemon=True)

    def start(self) -> None:
        for t in self._threads:
            t.start()
        self._coordinator_thread.start()

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Stop after each client's current action; the names of threads that did not finish in time."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in [*self._threads, self._coordinator_thread]:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _run_coordinator(self) -> None:
        while not self._stop.wait(0.25):
            self.coordinator.resolve_due(time.monotonic())

    def _run_client(self, i: int) -> None:

        name = f"c{i}"
        # Each client prefers one server (through its proxy) and fails over to the others in turn.
        k = i % len(self.endpoints)
        eps = self.endpoints[k:] + self.endpoints[:k]
        client: Client | None = None
        conv = ConvSession(self.history, eps, name, user=name, user_token=f"chaos-{self.seed}", token=self.token)
        pubsub = PubSession(self.history, eps, name, token=self.token, sub=SUBSCRIBERS.get(i))
        rest = None
        if self.rest_endpoints:
            r = i % len(self.rest_endpoints)
            rest = RestSession(self.history, self.rest_endpoints[r:] + self.rest_endpoints[:r], f"{name}-rest",
                               token=self.token, reachable=self.rest_reachable)
        kombu = KombuSession(self.history, eps, f"{name}-kombu", token=self.token) if self.kombu else None
        plan = client_plan(self.seed, i, self.queues, rest=rest is not None, kombu=self.kombu)
        n_uow = 0
        while not self._stop.is_set():
            if client is None:
                try:
                    client = Client(eps, token=self.token, client_name=name, connect_timeout=2.0,
                                    request_timeout=5.0, reconnect_timeout=5.0)
                except MQError:
                    time.sleep(0.2)
                    continue
            action = next(plan)
            n_uow += 1
            try:
                ok = Runner(self.history, client, name, f"{name}.{n_uow}", self.coordinator, conv, pubsub,
                            rest, kombu).run(action)
            except Exception:  # a bug in the suite itself: keep the evidence, keep the run going
                log.exception("%s: action %s failed", name, action.kind)
                ok = False
            self.actions_done += 1
            if not ok:
                time.sleep(0.1)  # a failing group (CF down, failover) is not hammered
        if client is not None:
            client.close()
        conv.close()
        pubsub.close()


class Runner:
    """Carries out one action on one client, recording each call."""

    def __init__(self, history: History, client: Any, name: str, uow: str,
                 coordinator: Coordinator | None = None, conv: ConvSession | None = None,
                 pubsub: PubSession | None = None, rest: RestSession | None = None,
                 kombu: KombuSession | None = None) -> None:
        self.h = history
        self.c = client
        self.name = name
        self.uow = uow
        self.coordinator = coordinator
        self.conv = conv
        self.pubsub = pubsub
        self.rest = rest
        self.kombu = kombu

    def call(self, op: str, fn: Callable[[], Any], **args: Any) -> tuple[str, Any]:
        """Invoke, run, complete: (outcome, result or exception). Not RecordedRunner.call, which closes its session
        when the connection breaks: this client is the thread's for the whole run and fails over by itself; and the
        queue calls' lines carry no ``error`` (each call names its own ``uow``, none outside syncpoint)."""
        op_id = self.h.invoke(self.name, op, **args)
        try:
            result = fn()
        except OutcomeUnknownError as e:  # a get whose commit is pending: unknown, with the message it delivered
            self.h.complete(op_id, UNKNOWN, reason=reason_of(e), **pending_delivery(e, self.c.qmgr))
            return UNKNOWN, e
        except NoMessageError as e:
            self.h.complete(op_id, FAIL, reason=reason_of(e))
            return FAIL, e
        except MQError as e:
            self.h.complete(op_id, FAIL, reason=reason_of(e), backed_out=isinstance(e, BackedOutError),
                            detail=str(e)[:200])
            return FAIL, e
        except (OSError, ValueError) as e:  # the connection broke in a way the client library did not map
            self.h.complete(op_id, UNKNOWN, reason=type(e).__name__, detail=str(e)[:200])
            return UNKNOWN, e
        fields = result[1] if isinstance(result, tuple) else {}
        self.h.complete(op_id, OK, **fields)
        return OK, result

    def put(self, p: PutSpec, syncpoint: bool) -> tuple[str, Any]:
        body = make_body(p.msg, p.size)
        return self.call("put", lambda: self.c.put(p.queue, body, persistent=p.persistent, syncpoint=syncpoint,
                                                   priority=p.priority, expiry_ms=p.expiry_ms),
                         uow=self.uow if syncpoint else None, msg=p.msg, queue=p.queue, priority=p.priority,
                         persistent=p.persistent, syncpoint=syncpoint, expiry_ms=p.expiry_ms)

    def get(self, queue: str, *, syncpoint: bool = True, wait_ms: int = 50, **match: bytes) -> tuple[str, Any]:
        """A get (``match``: msgid= or correlid=); outside syncpoint it is a unit of work of its own."""
        def fn() -> tuple[Any, dict[str, Any]]:
            m = self.c.get(queue, syncpoint=syncpoint, wait_ms=wait_ms, **match)
            return m, delivery_fields(m, self.c.qmgr)
        return self.call("get", fn, uow=self.uow if syncpoint else None, queue=queue, syncpoint=syncpoint)

    def end(self, commit: bool) -> bool:
        if commit:
            outcome, _ = self.call("commit", self.c.commit, uow=self.uow)
            return outcome == OK
        self.call("backout", self.c.backout, uow=self.uow)
        return True

    def abandon(self, e: Any) -> bool:
        """An operation inside the UOW failed: back the rest out (unless the failure already did)."""
        if not isinstance(e, BackedOutError):
            self.call("backout", self.c.backout, uow=self.uow)
        return False

    def run(self, a: Action) -> bool:
        if a.kind == "conv":
            assert self.conv is not None and a.conv is not None, "a conv action needs the client's conversation"
            return ConvRunner(self.h, self.conv, self.uow).run(a.conv)
        if a.kind == "pub":
            assert self.pubsub is not None and a.pub is not None, "a pub action needs the client's pub/sub session"
            return PubRunner(self.h, self.pubsub, self.uow).run(a.pub)
        if a.kind == "rest":
            assert self.rest is not None and a.rest is not None, "a rest action needs the client's REST session"
            return RestRunner(self.h, self.rest, self.uow).run(a.rest)
        if a.kind == "kombu":
            assert self.kombu is not None and a.kombu is not None, "a kombu action needs the client's kombu session"
            return KombuRunner(self.h, self.kombu, self.uow).run(a.kombu)
        if a.kind == "put1":
            outcome, _ = self.put(a.puts[0], syncpoint=False)
            return outcome == OK
        for p in a.puts:
            outcome, e = self.put(p, syncpoint=True)
            if outcome != OK:
                return self.abandon(e)
        for q in a.gets:
            outcome, e = self.get(q)
            if outcome != OK and not isinstance(e, NoMessageError):
                return self.abandon(e)
        if a.kind != "2pc":
            return self.end(a.commit)
        return self.two_phase(a)

    def two_phase(self, a: Action) -> bool:
        xid = f"x-{self.uow}"
        assert self.coordinator is not None, "a 2pc action needs the coordinator"
        self.coordinator.decide(xid, a.commit)
        qmgr = self.c.qmgr
        outcome, res = self.call("prepare", lambda: (r := self.c.prepare(xid), {"server_uow": r, "qmgr": qmgr}),
                                 uow=self.uow, xid=xid)
        if outcome == FAIL:
            return self.abandon(res)
        if outcome == UNKNOWN:
            return False  # in doubt or backed out: the coordinator's final pass finds out
        # The coordinator thread, not this client, owns the resolution and its retries (park_s 0: at once).
        self.coordinator.park(Parked(xid, res[0], qmgr, a.commit, time.monotonic() + a.park_s))
        return True


__all__ = ["Action", "Coordinator", "Parked", "PutSpec", "Workload", "client_plan", "make_body", "parse_body"]
