"""The chaos checker: what the history says the group did, against what the clients were told.

It runs after healing, resolving every in-doubt UOW and draining every queue, on the history alone (the drain's
gets are in it, as op ``drain``). Definitions (docs/chaos.md has them with examples):

Outcome of a unit of work: COMMITTED when its commit (or the coordinator's resolve, or an out-of-syncpoint put
or get, or a drain get) returned ok; ABORTED when it was backed out (backout, a BackedOutError, a prepare refused
with one); otherwise UNKNOWN, and then inferred from its effects (a get whose commit is pending is unknown and
delivered its message: see delivered):
  * a put of the UOW is *visible* when its message was ever delivered (to any get, or the drain), and
    *invisible* when it was never delivered (only decisive for persistent messages without expiry);
  * a get of the UOW *took effect* when its message was never delivered again afterwards, and *did not* when it
    was (only decisive for persistent messages without expiry).
  An unknown UOW with effects of both kinds is an atomicity violation; with only taken effects it committed; with
  only untaken ones it was backed out; with none it is undetermined (either way is allowed).
  A put never delivered that an unknown REST get accounts for (the at-most-once rule of ``lost`` below, one message
  per such get) is no evidence either way: the get may have consumed it for nobody (a member that died right after
  forcing the get's commit, completed by its peer's recovery: seed 15, peer-clock-skew).

Findings (each names the message ids and UOWs involved):
  lost        a persistent message without expiry whose put committed (known, not inferred) and that no
              committed or undetermined get consumed and the drain did not find, unless a REST get whose outcome
              is unknown accounts for it (at-most-once; each such get for one message: qsg.chaos.restcheck);
  undelivered such a message when a get on its queue whose client never received a reply (the client left while
              it waited, or its outcome is unknown) was active while the message was there: consumed for nobody;
  duplicated  a message consumed by two committed gets (the drain counts as one);
  phantom     a delivered message that no client put, or whose put was backed out or failed;
  atomicity   a UOW (of any outcome) with decisive effects of both kinds;
  corrupted   a delivered body whose CRC32C does not match (or that is not a chaos message at all);
  order       see check_order;
  resurrected a non-persistent message delivered by a get that began after a CF loss its put preceded;
  expired     a message delivered by a get that began more than EXPIRY_SLACK_S after its expiry;
  stuck       entries still locked (uncommitted puts or gets) in a queue after healing, resolving every
              in-doubt UOW and draining (the run's "drained" note): held by a UOW no member can resolve;
  restore-order  two messages available on the live CF just before a CF loss and again right after its
              restore, in the other order (the fault steps' live_order / restored_order): the CF and restore
              disagree on where a commit counts (see check_restore_order);
  restore-foreign-cf  a restore that wrote into a CF it did not start on (the faults' restore events: it
              completed on another CF, or a CF started empty under it held restore-written keys right after it);
  restore-wiped       two restores of one structure that overlapped and both completed: the later one loaded a
              plan older than the other's result, wiping it and the work acknowledged in between (named).
  purge-undone a message a purge discarded (the fault names them: its "purged" step), delivered by a get
              that began after the purge (a later restore crossed the purge).
  liveness    a member that did not serve again within its bound after a fault's heal (the runner's "serving
              again" events: when each member first passed a probe after the heal, and the bound), or whose process
              ended between one fault's recovery and the next fault (or the workload's end): it served, then stopped;
  isolation   one application acting as, or reading the work of, another user: an attempt of the snoop fault
              (history op "snoop") that was not refused;
  resolved-twice  a prepared UOW that two resolves with opposite decisions both reported done (the coordinator's
              and an operator's heuristic one, raced: qsg.chaos.workload.Coordinator): a UOW has one decision;
  uow-*        units of work sent to a service (conversations): qsg.chaos.uowcheck has those rules.
  pub-*        publications and subscribers (durable publish and subscribe): qsg.chaos.pubsubcheck's rules.
Operations through the REST door (``via: "rest"``: qsg.chaos.rest_actions) are puts and gets outside syncpoint like
any other, under every rule above; those through the kombu transport (``via: "kombu"``: qsg.chaos.kombu_actions) are
puts outside syncpoint and gets under syncpoint settled by an ack (commit) or a requeue (backout), under every rule
above too.
Allowed and counted: non-persistent messages lost (with the CF), unknown outcomes (resolved either way),
redeliveries after backout, expired messages that never came back, messages a purge discarded (neither lost nor
evidence about their UOW's outcome: the operator threw them away).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from qsg.chaos.doors import count_untold, kombu_counts
from qsg.chaos.history import Op, pair_ops
from qsg.chaos.pubsub_actions import TOPIC_STRUCTURE
from qsg.chaos.pubsubcheck import PUB_KINDS, PUB_OPS, check_pubsub
from qsg.chaos.restcheck import is_rest, match_missing, ordering_counts, rest_counts, unknown_rest_gets
from qsg.chaos.uowcheck import CONV_OPS, UOW_KINDS, check_uows

COMMITTED, ABORTED, UNKNOWN, UNDETERMINED = "committed", "aborted", "unknown", "undetermined"
MUST_BE_ZERO = ("lost", "undelivered", "duplicated", "phantom", "atomicity", "corrupted", "stuck",
                "restore-foreign-cf", "restore-wiped", "purge-undone", "liveness", "isolation", "resolved-twice", *UOW_KINDS,
                *PUB_KINDS)
FINDING_KINDS = (*MUST_BE_ZERO, "order", "restore-order", "resurrected", "expired")
EXPIRY_SLACK_S = 1.0  # the server's clock reads expiry at the get, some milliseconds after the client's invoke
# After a fault has recovered, its after-effects last this long: pending CF work retried by the members, and a
# request stalled behind a half-open path that the client gives up on only after its request timeout (5 s).
SETTLE_S = 6.0
# Kinds that always lose the CF (their injection counts as the loss); a kind that loses it only sometimes
# (member-own-log-root, when the stray member was let in; peer-clock-skew, which loses it after its peer recovery,
# unless a step before failed) says so with a "CF killed" step.
CF_LOSS_KINDS = ("cf-kill", "cf-kill-during-restore", "during-backup",
                 "cf-kill-during-load-restart", "cf-kill-twice", "purge-then-cf-kill", "cf-kill-recauto",
                 "cluster-node-kill", "cf-hang")
CF_KILLED = "CF killed"
PURGED = "purged"  # the phase of a fault's history event that names the messages a purge discarded ("msgs")
LEFT_SLACK_S = 1.0  # a get whose client left: the server might have gone on this long past the get's own wait
SERVING_AGAIN = "serving again"  # the runner's event: when a member first passed a probe after a fault's heal
SNOOP_OP = "snoop"  # an attempt of one application on another user's work (the snoop fault): refused, or a finding


def delivered(o: Op) -> bool:
    """A get (or drain get) that delivered its message: ok, or unknown with the message (its commit pending: the
    member delivers the message with OutcomePendingError). The unknown one's unit of work is inferred like any
    unknown one: it consumed the message only when the message was never delivered again, so it never counts as a
    second committed consumer of a message a restore backed its get out of."""
    return o.op in ("get", "drain") and (o.outcome == "ok" or o.outcome == "unknown" and "msg" in o.result)


@dataclass
class Delivery:
    msg: str
    uow: str
    op: Op

    @property
    def t1(self) -> float:
        return self.op.t1 if self.op.t1 is not None else self.op.t0


@dataclass
class Uow:
    key: str
    client: str
    ops: list[Op] = field(default_factory=list)
    outcome: str = UNKNOWN
    known: bool = False  # outcome from a completion, not inferred
    xid: str = ""
    resolved_at: float | None = None  # a prepared UOW: when the coordinator's resolve returned ok

    @property
    def start(self) -> float:
        return self.ops[0].t0

    @property
    def end(self) -> float:
        """When its outcome was decided (as far as the history knows): its last operation, or its resolve."""
        if self.resolved_at is not None:
            return self.resolved_at
        last = self.ops[-1]
        return last.t1 if last.t1 is not None else last.t0


@dataclass
class Finding:
    kind: str
    msgs: list[str]
    detail: str
    uow: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "msgs": self.msgs, "uow": self.uow, "detail": self.detail}


@dataclass
class CheckResult:
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> dict[str, int]:
        return {k: len(self.of(k)) for k in FINDING_KINDS}


class Checker:
    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.ops, marks = pair_ops(events)
        self.faults = [e for e in marks if e.get("type") == "fault"]
        self.notes = [e for e in marks if e.get("type") == "note"]
        self.uows: dict[str, Uow] = {}
        self.puts: dict[str, Op] = {}  # msg -> its put
        self.put_uow: dict[str, str] = {}
        self.deliveries: dict[str, list[Delivery]] = defaultdict(list)
        self.result = CheckResult()
        self.counts: Counter[str] = Counter()
        self.purged: dict[str, float] = {}  # message -> when a purge discarded it
        # Messages never delivered matched one to one with REST gets whose outcome is unknown (rest_matching).
        self.rest_gets: list[Op] = []
        self.rest_taken: dict[str, Op] = {}
        # The purges of the topic's structure, from the fault's injection to its purged step: each discards the
        # topic's subscriptions with everything else (its subscribers subscribe again).
        self.topic_purges: list[tuple[float, float]] = []
        injected: dict[Any, float] = {}
        for f in sorted(self.faults, key=lambda f: f["t"]):
            if f.get("phase") == "inject":
                injected[f.get("fault")] = float(f["t"])
            if f.get("phase") == PURGED:
                for m in f.get("msgs", ()):
                    self.purged.setdefault(m, float(f["t"]))
                if f.get("structure") == TOPIC_STRUCTURE:
                    self.topic_purges.append((injected.get(f.get("fault"), float(f["t"])), float(f["t"])))

    def find(self, kind: str, msgs: Iterable[str], detail: str, uow: str = "") -> None:
        self.result.findings.append(Finding(kind, sorted(set(msgs)), detail, uow))

    # --- building the picture ----------------------------------------------------------------------------------
    def _uow(self, key: str, client: str) -> Uow:
        u = self.uows.get(key)
        if u is None:
            u = self.uows[key] = Uow(key, client)
        return u

    def build(self) -> None:
        resolves: dict[str, list[Op]] = defaultdict(list)
        for o in self.ops:
            if o.op in CONV_OPS or o.op in PUB_OPS:  # qsg.chaos.uowcheck's and qsg.chaos.pubsubcheck's rules
                continue
            if o.op == SNOOP_OP:  # check_isolation's
                continue
            if o.op == "resolve":
                resolves[o.args.get("xid", "")].append(o)
                continue
            # A put outside syncpoint and a drain get are each a unit of work of their own.
            key = o.args.get("uow") or f"op{o.id}"
            u = self._uow(key, o.client)
            u.ops.append(o)
            if o.op == "put" and o.args.get("msg"):
                self.puts[o.args["msg"]] = o
                self.put_uow[o.args["msg"]] = key
            if delivered(o):
                msg = o.result.get("msg")
                if msg is None:
                    self.find("corrupted", [], f"op {o.id} ({o.client}) got a body that is not a chaos message "
                                               f"from queue {o.result.get('queue') or o.args.get('queue')}")
                    continue
                self.deliveries[msg].append(Delivery(msg, key, o))
                if not o.result.get("crc_ok", True):
                    self.find("corrupted", [msg], f"checksum mismatch at op {o.id} ({o.client})", key)
                if int(o.result.get("backout_count", 0) or 0) > 0:
                    self.counts["deliveries with a backout count"] += 1
        for u in self.uows.values():
            self._known_outcome(u, resolves)
        for xid, ops in sorted(resolves.items()):
            decisions = {bool(o.args.get("commit")) for o in ops if o.outcome == "ok"}
            if len(decisions) > 1:
                self.find("resolved-twice", [], f"xid {xid}: committed and backed out, both reported done (ops "
                                                 f"{', '.join(str(o.id) for o in ops if o.outcome == 'ok')})")

        def consumed(o: Op) -> bool:
            u = self.uows[o.args.get("uow") or f"op{o.id}"]
            return u.known and u.outcome == COMMITTED

        for d in self.deliveries.values():
            # Delivery order: every backout of a get raises the message's backout count, so the count orders
            # the deliveries of one message even when a reply arrives late (a slow link). Two deliveries with one
            # count mean that a take was erased without a backout: a CF lost before its GET reached a log the
            # restore read. The erased take came first, so the get asked first comes first: by completion time,
            # a reply held up across the loss and the restore (cf-kill-twice holds an SQM there) made the
            # committed get after it look undone and the aborted one look done. A REST get's count is inferred
            # (qsg.chaos.restcheck.ordering_counts: the door does not tell it).
            counts = ordering_counts([x.op for x in d], consumed)
            d.sort(key=lambda x: (counts[x.op.id], x.op.t0))

    def _known_outcome(self, u: Uow, resolves: dict[str, list[Op]]) -> None:
        first = u.ops[0]
        if len(u.ops) == 1 and first.op in ("put", "get", "drain") and not first.args.get("uow"):
            u.outcome = {"ok": COMMITTED, "fail": ABORTED}.get(first.outcome, UNKNOWN)
            u.known = u.outcome != UNKNOWN
            return
        for o in u.ops:
            if o.op in ("put", "get") and o.outcome == "fail" and o.result.get("backed_out"):
                u.outcome, u.known = ABORTED, True
                return
            if o.op == "backout":
                u.outcome, u.known = ABORTED, True
                return
            if o.op == "commit":
                if o.outcome == "ok":
                    u.outcome, u.known = COMMITTED, True
                elif o.outcome == "fail" and o.result.get("backed_out"):
                    u.outcome, u.known = ABORTED, True
                return
            if o.op == "prepare" and o.outcome == "fail" and o.result.get("backed_out"):  # a no vote
                u.outcome, u.known = ABORTED, True
                return
            if o.op == "prepare":
                u.xid = o.args.get("xid", "")
                ok = [r for r in resolves.get(u.xid, []) if r.outcome == "ok"]
                if ok:
                    u.outcome, u.known = (COMMITTED if ok[0].args.get("commit") else ABORTED), True
                    u.resolved_at = ok[0].t1
                return

    # --- inference and the rules ---------------------------------------------------------------------------------
    def _decisive(self, m: str) -> bool:
        p = self.puts.get(m)
        return (p is not None and bool(p.args.get("persistent")) and not p.args.get("expiry_ms")
                and m not in self.purged)

    def _missing_committed(self) -> list[tuple[str, Op, Uow]]:
        """The persistent messages without expiry, not purged, whose put's unit of work is known committed, that
        were never delivered (the candidates for ``lost``), by message id."""
        missing: list[tuple[str, Op, Uow]] = []
        for m, put in sorted(self.puts.items()):
            u = self.uows[self.put_uow[m]]
            if not self.deliveries.get(m) and self._decisive(m) and u.known and u.outcome == COMMITTED:
                missing.append((m, put, u))
        return missing

    def rest_matching(self) -> None:
        """Match the messages never delivered to the unknown REST gets that could have taken them, one message per
        get (qsg.chaos.restcheck): first those of units of work known committed (exactly the matching of the lost
        rule: an augmenting path never unmatches a message), then those of units of work whose outcome is unknown.
        A matched message is no evidence about its unit of work (infer), nor lost (check_messages)."""
        self.rest_gets = unknown_rest_gets(self.ops)
        first = self._missing_committed()
        then = [(m, put, u) for m, put in sorted(self.puts.items())
                if not (u := self.uows[self.put_uow[m]]).known and put.outcome != "fail"
                and not self.deliveries.get(m) and self._decisive(m)]
        self.rest_taken = match_missing([(m, str(put.args.get("queue")), u.start) for m, put, u in first + then],
                                        self.rest_gets, SETTLE_S)

    def _effects(self, u: Uow) -> tuple[list[str], list[str]]:
        """(messages whose effect is visible / taken, messages whose effect is not), decisive ones only."""
        taken: list[str] = []
        untaken: list[str] = []
        for o in u.ops:
            if o.op == "put" and o.outcome != "fail" and self._decisive(o.args["msg"]):
                m = o.args["msg"]
                if not self.deliveries.get(m) and m in self.rest_taken:
                    self.counts["puts never delivered that an unknown REST get may have taken (no evidence)"] += 1
                    continue
                (taken if self.deliveries.get(m) else untaken).append(m)
            elif o.op == "get" and delivered(o) and o.result.get("msg") and self._decisive(o.result["msg"]):
                m = o.result["msg"]
                ds = self.deliveries.get(m, [])
                at = next(i for i, d in enumerate(ds) if d.op is o)
                (untaken if ds[at + 1:] else taken).append(m)
        return taken, untaken

    def infer(self) -> None:
        self.rest_matching()
        for u in self.uows.values():
            taken, untaken = self._effects(u)
            if taken and untaken:
                self.find("atomicity", taken + untaken, f"{u.outcome} UOW {u.key} ({u.client}): took effect for "
                                                        f"{sorted(taken)}, not for {sorted(untaken)}", u.key)
            if u.known:
                continue
            self.counts["unknown outcomes"] += 1
            if taken and not untaken:
                u.outcome = COMMITTED
                self.counts["unknown outcomes resolved: committed"] += 1
            elif untaken and not taken:
                u.outcome = ABORTED
                self.counts["unknown outcomes resolved: backed out"] += 1
            else:
                u.outcome = UNDETERMINED
                self.counts["unknown outcomes resolved: undetermined"] += 1

    def check_messages(self) -> None:
        cf_losses = [f for f in self.faults if f.get("kind") in CF_LOSS_KINDS and f["phase"] == "inject"
                     or f.get("kind") not in CF_LOSS_KINDS and str(f["phase"]).startswith(CF_KILLED)]
        # A loss of one node of a Redis Cluster CF (cluster-node-kill) lost only the queues of its structures.
        lost_queues = {f.get("fault"): set(f["lost_queues"]) for f in self.faults
                       if str(f["phase"]).startswith(CF_KILLED) and "lost_queues" in f}
        for m, ds in sorted(self.deliveries.items()):
            put = self.puts.get(m)
            if put is None:
                self.find("phantom", [m], f"delivered {len(ds)}x, never put by any client")
                continue
            pu = self.uows[self.put_uow[m]]
            if pu.outcome == ABORTED:
                self.find("phantom", [m], f"delivered {len(ds)}x, but its put ({pu.key}) was backed out or failed",
                          pu.key)
            committed = [d for d in ds if self.uows[d.uow].outcome == COMMITTED]
            if len(committed) > 1:
                self.find("duplicated", [m], "consumed by " + ", ".join(
                    f"{d.uow} ({d.op.client}, t={d.t1})" for d in committed))
            redelivered = [d for d in ds[:-1] if self.uows[d.uow].outcome != COMMITTED]
            self.counts["redeliveries after backout"] += len(redelivered)
            expiry = int(put.args.get("expiry_ms") or 0)
            put_done = put.t1 if put.t1 is not None else put.t0
            for d in ds:
                if m in self.purged and d.op.t0 > self.purged[m]:
                    self.find("purge-undone", [m], f"purged at t={self.purged[m]}, delivered by op {d.op.id} "
                                                   f"({d.op.client}) begun at t={d.op.t0}", d.uow)
                if expiry and d.op.t0 > put_done + expiry / 1000 + EXPIRY_SLACK_S:
                    self.find("expired", [m], f"expiry {expiry} ms, put done at t={put_done}, delivered by "
                                              f"op {d.op.id} begun at t={d.op.t0}", d.uow)
                if not put.args.get("persistent"):
                    for f in cf_losses:
                        if put.args.get("queue") not in lost_queues.get(f.get("fault"), {put.args.get("queue")}):
                            continue  # its structure's node survived that loss
                        if put_done < f["t"] < d.op.t0 and self._cf_back(f) < d.op.t0:
                            self.find("resurrected", [m], f"non-persistent, put at t={put_done}, CF lost at "
                                                          f"t={f['t']}, delivered by op {d.op.id} at t={d.op.t0}")
        unknown_drains = sum(1 for o in self.ops if o.op == "drain" and o.outcome == "unknown" and not delivered(o))
        for m, put in sorted(self.puts.items()):
            if self.deliveries.get(m):
                continue
            u = self.uows[self.put_uow[m]]
            if m in self.purged:
                self.counts["purged (allowed)"] += 1
                continue
            if not put.args.get("persistent"):
                if u.outcome == COMMITTED:
                    self.counts["non-persistent lost (allowed)"] += 1
                continue
            if put.args.get("expiry_ms"):
                if u.outcome == COMMITTED:
                    self.counts["expired, never delivered (allowed)"] += 1
                continue
        missing = self._missing_committed()
        # REST gets are at-most-once (qsg.chaos.restcheck): each unknown one may account for one missing message
        # (rest_matching, which matched the missing messages of known committed units of work first).
        rest_gets = self.rest_gets
        missing_ids = {m for m, _, _ in missing}
        taken = {m: g for m, g in self.rest_taken.items() if m in missing_ids}
        self.counts["unknown REST gets"] = len(rest_gets)
        self.counts["missing after an unknown REST get (allowed: at-most-once)"] = len(taken)
        for m, put, u in missing:
            if m in taken:
                continue
            taker = self._replyless_get(put, u)
            if taker is not None:
                why = "its client left while it waited" if taker.result.get("left") else "its outcome is unknown"
                self.find("undelivered", [m], f"put committed by {u.key} ({u.client}) at t={u.end}, never "
                                              f"delivered: {taker.op} op {taker.id} ({taker.client}) on "
                                              f"{put.args['queue']} got no reply to its client ({why}) while "
                                              "the message was there: consumed for nobody", u.key)
                continue
            note = f"; {unknown_drains} drain gets had an unknown outcome" if unknown_drains else ""
            on_queue = sum(1 for g in rest_gets if g.args.get("queue") == put.args.get("queue"))
            if on_queue:
                note += (f"; the {on_queue} unknown REST gets on {put.args['queue']} could each account for one "
                         "other missing message at most")
            self.find("lost", [m], f"put committed by {u.key} ({u.client}) at t={u.end}, never consumed, "
                                   f"not present at the end{note}", u.key)
        # Consumed only by gets of undetermined UOWs: not lost, but worth counting.
        self.counts["consumed only by undetermined UOWs"] = sum(
            1 for ds in self.deliveries.values()
            if ds and all(self.uows[d.uow].outcome == UNDETERMINED for d in ds))

    def _replyless_get(self, put: Op, pu: Uow) -> Op | None:
        """A get on the message's queue whose client never had its reply (it left while the get waited, or the
        outcome is unknown), active after the message's put began: the get that may have consumed it for nobody."""
        queue = put.args.get("queue")
        for g in self.ops:
            if g.op not in ("get", "drain") or g.outcome != "unknown" or delivered(g) or g.args.get("queue") != queue:
                continue  # a get that delivered its message (its commit pending) consumed nothing for nobody
            if is_rest(g):
                continue  # matched one to one with what is missing (qsg.chaos.restcheck), before this rule
            if g.args.get("correlid") not in (None, put.args.get("correlid")):
                continue  # a get by correlation id takes no message with another one
            if g.result.get("left"):  # a server that missed the leave would have waited out the get's wait
                end = max(g.t1 or g.t0, g.t0 + int(g.args.get("wait_ms") or 0) / 1000) + LEFT_SLACK_S
            else:
                end = (g.t1 if g.t1 is not None else float("inf")) + SETTLE_S
            if end >= pu.start:
                return g
        return None

    def _cf_back(self, loss: dict[str, Any]) -> float:
        """When the CF loss `loss` had recovered (the end of the history if it never did)."""
        for f in self.faults:
            if f.get("fault") == loss.get("fault") and f["phase"] == "recovered":
                return float(f["t"])
        return float("inf")

    def disturbed(self) -> list[tuple[float, float]]:
        """Intervals from each fault's injection to SETTLE_S after its recovery (open-ended if it never did)."""
        spans: dict[Any, list[float]] = {}
        for f in self.faults:
            s = spans.setdefault(f.get("fault"), [f["t"], float("inf")])
            if f["phase"] == "inject":
                s[0] = min(s[0], f["t"])
            elif f["phase"] == "recovered":
                s[1] = f["t"] + SETTLE_S
        return sorted((a, b) for a, b in spans.values())

    def check_order(self) -> None:
        """FIFO within (producer, queue, priority) as seen by one consumer.

        m1 and m2 were put by one producer on one queue with one priority, persistent, without expiry, each in a
        UOW that committed (known) and whose whole span (first op to commit) touched no fault window; m1's commit
        completed before m2's put began. Each was delivered exactly once, with backout count 0, to a committed
        get of the same consumer (the drain is a consumer too), in a UOW that touched no fault window either. If that consumer got m2 before m1, m1 was
        available all along (committed earlier, held by nobody), so FIFO was broken. Everything else is allowed
        to reorder: a message whose delivery was backed out (by the application, a failure, peer recovery or a
        CF loss) goes back to its place, after others were taken; a commit that waits for the CF (pending work)
        becomes visible late.
        """
        windows = self.disturbed()

        def calm(a: float, b: float) -> bool:
            return not any(a < w1 and w0 < b for w0, w1 in windows)

        groups: dict[tuple[str, str, int, str], list[tuple[float, float, float, str]]] = defaultdict(list)
        for m, ds in self.deliveries.items():
            put = self.puts.get(m)
            if put is None or len(ds) != 1 or not self._decisive(m):
                continue
            d = ds[0]
            pu, du = self.uows[self.put_uow[m]], self.uows[d.uow]
            if not (pu.known and pu.outcome == COMMITTED and du.outcome == COMMITTED):
                continue
            if count_untold(d.op):
                continue  # the door did not tell the message's backout count: a redelivery cannot be told apart
            if int(d.op.result.get("backout_count", 0) or 0) or not (calm(pu.start, pu.end)
                                                                     and calm(du.start, du.end)):
                continue
            consumer = "drain" if d.op.op == "drain" else d.op.client
            key = (put.client, put.args["queue"], int(put.args.get("priority", 0)), consumer)
            groups[key].append((d.t1, put.t0, pu.end, m))
        for (producer, queue, prio, consumer), items in groups.items():
            items.sort()  # in the consumer's delivery order
            later_min: tuple[float, str] = (float("inf"), "")  # earliest commit among messages delivered later
            for _, put_start, committed_at, m2 in reversed(items):
                if later_min[0] < put_start:
                    m1 = later_min[1]
                    self.find("order", [m1, m2], f"{consumer} got {m2} before {m1} on {queue} (priority {prio}, "
                                                 f"producer {producer}), though {m1} committed first")
                if committed_at < later_min[0]:
                    later_min = (committed_at, m2)

    def check_restore_order(self) -> None:
        """Get order across a restore: the messages of a queue that were available on the live CF just before a
        CF loss (a fault step's live_order) and again right after its restore (restored_order) must come in the
        same relative order. Work between the two snapshots only removes messages (gets) or adds ones that are
        in one snapshot only (new commits; pending commits that restore completed), and a backed-out get goes
        back to its place, so the order of the messages in both is what the live CF and restore each decided
        for them: priority, then the LRSN at which the commit counts, then the put."""
        live: dict[Any, dict[str, list[str]]] = {}
        for f in self.faults:
            if "live_order" in f:
                live[f.get("fault")] = f["live_order"]
            elif "restored_order" in f and f.get("fault") in live:
                before = live.pop(f.get("fault"))
                for queue, after in sorted(f["restored_order"].items()):
                    common = set(before.get(queue, ())) & set(after)
                    a = [m for m in before.get(queue, ()) if m in common]
                    b = [m for m in after if m in common]
                    if a != b:
                        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                        self.find("restore-order", [a[i], b[i]],
                                  f"{queue}: {a[i]} came before {b[i]} on the live CF before the CF loss of fault "
                                  f"{f.get('fault')} ({f.get('kind')}), after its restore {b[i]} comes first")

    def check_stuck(self) -> None:
        """Entries still locked after healing, resolving every in-doubt UOW and draining: nobody can free them."""
        for n in self.notes:
            if n.get("what") != "drained":
                continue
            for queue, states in sorted((n.get("left in the structures") or {}).items()):
                held = int(states.get("UP", 0)) + int(states.get("UG", 0))
                if held:
                    self.find("stuck", [], f"{queue}: {states.get('UP', 0)} uncommitted puts and "
                                           f"{states.get('UG', 0)} uncommitted gets still locked after the drain")

    def restores(self) -> list[dict[str, Any]]:
        """The restores the faults ran (qsg.chaos.faults.restores.restore_structure): each 'restore began' event
        joined with its 'restore ended' one, by the restore's number."""
        spans: dict[Any, dict[str, Any]] = {}
        for f in self.faults:
            if f.get("restore") is None:
                continue
            r = spans.setdefault(f["restore"], {"restore": f["restore"], "structure": f.get("structure")})
            if "outcome" in f:
                r.update(t1=f["t"], outcome=f["outcome"], cf1=f.get("cf"),
                         written_into_new_cf=int(f.get("written_into_new_cf") or 0))
            else:
                r.update(t0=f["t"], cf0=f.get("cf"), queues=f.get("queues") or [])
        return [r for r in spans.values() if "t0" in r and "t1" in r]

    def check_restores(self) -> None:
        """A restore owns its structure from its start to the end of its load, on the CF it started on."""
        done = []
        for r in self.restores():
            moved = r["cf0"] is not None and r["cf1"] is not None and r["cf0"] != r["cf1"]
            if r["written_into_new_cf"] or (moved and r["outcome"] == "ok"):
                self.find("restore-foreign-cf", [], f"restore {r['restore']} of {r['structure']} (t={r['t0']}.."
                                                    f"{r['t1']}, {r['outcome']}) started on CF {r['cf0']} and "
                                                    f"wrote into CF {r['cf1']}: {r['written_into_new_cf']} keys "
                                                    f"only a restore writes were there right after it")
            if r["outcome"] == "ok":
                done.append(r)
        done.sort(key=lambda r: r["t1"])
        for i, later in enumerate(done):
            for earlier in done[:i]:
                if earlier["structure"] != later["structure"] or not later["t0"] < earlier["t1"]:
                    continue
                queues = set(later["queues"])
                acked = [u for u in self.uows.values() if u.known and u.outcome == COMMITTED
                         and earlier["t1"] < u.end < later["t1"]
                         and any(o.args.get("queue") in queues for o in u.ops)]
                msgs = [m for u in acked for o in u.ops if o.args.get("queue") in queues
                        for m in (o.args.get("msg"), o.result.get("msg")) if m]
                self.find("restore-wiped", msgs, f"restore {later['restore']} of {later['structure']} (t="
                                                 f"{later['t0']}..{later['t1']}) completed after restore "
                                                 f"{earlier['restore']} (t={earlier['t0']}..{earlier['t1']}) had "
                                                 f"restored it while it ran: it loaded an older plan over that "
                                                 f"result and the {len(acked)} units of work acknowledged in "
                                                 f"between ({', '.join(sorted(u.key for u in acked)[:10])})")

    def check_liveness(self) -> None:
        """Every member serves again within its bound after every fault's heal, and keeps serving until the next
        fault: the runner records, per fault, when each member first passed a probe after the heal (its "serving
        again" events, with the bound) and each member's process at every injection, recovery and the workload's
        end. A history without them (older runs) is not judged."""
        for f in self.faults:
            if f.get("phase") != SERVING_AGAIN:
                continue
            after, bound = f.get("after_heal_s"), f.get("bound_s")
            if bound is None:
                continue
            if after is None:
                self.find("liveness", [], f"{f.get('member')} did not serve again after fault {f.get('fault')} "
                                          f"({f.get('kind')}) healed (bound {bound} s)")
            elif float(after) > float(bound):
                self.find("liveness", [], f"{f.get('member')} served again {after} s after fault {f.get('fault')} "
                                          f"({f.get('kind')}) healed: more than its bound of {bound} s")
        recovered: tuple[Any, dict[str, Any]] | None = None  # (fault, pids) at the last recovery
        marks = sorted((e for e in [*self.faults, *self.notes] if "pids" in e), key=lambda e: e["t"])
        for e in marks:
            if e.get("phase") == "recovered":
                recovered = (e.get("fault"), e["pids"])
                continue
            if recovered is None:
                continue
            fault, before = recovered
            when = f"fault {e.get('fault')} ({e.get('kind')})" if e.get("phase") == "inject" else \
                f"the {e.get('what') or 'next mark'}"
            for name, pid in sorted(before.items()):
                now = e["pids"].get(name)
                if pid is not None and now != pid:
                    self.find("liveness", [], f"{name} served again after fault {fault}, then stopped: its process "
                                              f"{pid} {'had ended' if now is None else f'was replaced by {now}'} by "
                                              f"{when}, with no fault between")
            recovered = None

    def check_isolation(self) -> None:
        """An application of the group's service token that acted as another user, or read another user's work:
        every attempt the snoop fault makes must be refused (its op completes ``fail``, or ``ok`` with no breach)."""
        for o in self.ops:
            if o.op != SNOOP_OP:
                continue
            self.counts["snoop attempts"] += 1
            if o.outcome == "ok" and o.result.get("breach"):
                self.find("isolation", [], f"op {o.id} ({o.client}): {o.args.get('what')} as "
                                           f"{o.args.get('as_user') or 'no user'} (token {o.args.get('token')}) on "
                                           f"{o.args.get('target')}: not refused: {o.result.get('detail', '')}")
            elif o.outcome == "fail":
                self.counts["snoop attempts refused"] += 1

    def run(self) -> CheckResult:
        self.build()
        self.infer()
        self.check_messages()
        self.check_order()
        self.check_restore_order()
        self.check_stuck()
        self.check_restores()
        self.check_liveness()
        self.check_isolation()
        check_uows(self.ops, self.find, self.counts)
        check_pubsub(self.ops, self.find, self.counts, self.disturbed(), self.purged, self.topic_purges)
        self.counts.update(rest_counts(self.ops))
        self.counts.update(kombu_counts(self.ops))
        self.counts["operations"] = len(self.ops)
        self.counts["units of work"] = len(self.uows)  # MQ units of work; UOWs sent to a service count apart
        self.counts["messages put"] = len(self.puts)
        self.counts["messages delivered"] = len(self.deliveries)
        self.counts["gets whose client left while they waited"] = sum(1 for o in self.ops if o.result.get("left"))
        self.counts["committed units of work"] = sum(1 for u in self.uows.values() if u.outcome == COMMITTED)
        self.result.counts = dict(self.counts)
        return self.result


def check(events: Iterable[dict[str, Any]]) -> CheckResult:
    """Check a history (the events of load_history, or History's lines)."""
    return Checker(events).run()


__all__ = ["ABORTED", "COMMITTED", "CheckResult", "Checker", "FINDING_KINDS", "Finding", "MUST_BE_ZERO",
           "UNDETERMINED", "UNKNOWN", "check"]
