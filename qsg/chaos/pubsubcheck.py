"""The chaos checker's rules for durable publish and subscribe (docs/pubsub.md; docs/invariants.md, invariant 10):
every publication that committed reaches every durable subscriber that subscribed before it exactly once, whole,
in commit order; nothing else reaches anyone.

The workload's publish/subscribe actions (qsg.chaos.pubsub_actions) record ``psub``, ``ppub``, ``precv`` and
``psync`` operations, each with ``uow`` = the action's key (one publication published, or one receipt: the
publications a subscriber received before its syncpoint). The drain (client ``pdrain``) receives for every durable
subscriber until nothing is left, so the history holds every delivery.

Outcome of a publication: COMMITTED when its publisher's COMMIT answered ok; ABORTED when it was backed out (a
BACKOUT, a publish or COMMIT that failed with the session backed out, or no COMMIT at all: a publication's messages
stay with the session until its COMMIT); otherwise UNKNOWN (the COMMIT's connection was lost, or it failed in a way
that does not say): inferred COMMITTED when anyone received it, else ABORTED (delivered to all or to none).

A subscriber *committed* a publication when a receipt of it ended with a COMMIT that answered ok, and *maybe*
committed it when that COMMIT's outcome is unknown. A durable subscriber is *eligible* for a publication whose
COMMIT began after the subscriber's first subscribe answered ok, and must not get one whose COMMIT had answered
before its first subscribe was asked (in between: either). A non-durable subscription lives as long as the member
it was made through; each incarnation (its home and subscribe time, as subscribe answered) is judged on its own.

Findings (message ids, and the publication or receipt key):
  pub-partial              a delivery that is not the publication's messages, all and in order (or that mixes
                           publications, or names another publication id than its publisher was given);
  pub-backedout-delivered  a publication that was backed out (or never committed) delivered to anyone;
  pub-lost                 a committed publication a durable eligible subscriber never committed (nor maybe):
                           eligible, subscribed before its COMMIT with no purge of the topic's structure since (a
                           purge discards the subscriptions); a publication a purge discarded is allowed;
  pub-split                a publication of unknown outcome that some subscriber received and an eligible durable
                           subscriber never committed: delivered to some, not all;
  pub-duplicated           a publication a durable subscriber (or one non-durable incarnation) committed twice, or
                           received again after committing it;
  pub-order                a subscriber committed publications out of commit order: B before A though A's COMMIT
                           answered "ok", outside the faults' windows, before B's was asked; or positions (commit
                           LRSN, id) that do not increase;
  pub-before-subscribe     a publication whose COMMIT answered before the subscriber subscribed, delivered to it
                           (allowed and counted when another publication's COMMIT, begun before it answered, was
                           still under way when the subscribe was asked: it may have been held back behind that
                           open one, and a subscribe starts below an open publication, docs/pubsub.md; and when its
                           COMMIT answered in a fault window, as pub-order allows: completed in the CF later, it
                           was open there when the subscribe started);
  pub-phantom              a delivered message no publisher published.
Also ``corrupted`` (a checksum mismatch). Counted: publications by outcome, deliveries, redeliveries after backout.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qsg.chaos.history import Find, Op

PUB_OPS = ("psub", "ppub", "precv", "psync", "psubs")
PUB_KINDS = ("pub-partial", "pub-backedout-delivered", "pub-lost", "pub-split", "pub-duplicated", "pub-order",
             "pub-before-subscribe", "pub-phantom")
PUBLISHER, SUBSCRIBER = "publisher", "subscriber"
COMMITTED, ABORTED, UNKNOWN = "committed", "aborted", "unknown"


def _done(o: Op) -> float:
    return o.t1 if o.t1 is not None else float("inf")


def _commit_of(syncs: list[Op]) -> Op | None:
    return next((o for o in syncs if o.args.get("option") == "COMMIT"), None)


def _committed(commit: Op | None) -> str:
    """What a unit of work's COMMIT call says of it: COMMITTED, ABORTED (never committed, or backed out) or
    UNKNOWN (the call's outcome is not known)."""
    if commit is None:
        return ABORTED
    if commit.outcome == "ok":
        return COMMITTED
    if commit.outcome == "fail" and commit.result.get("backed_out"):
        return ABORTED
    return UNKNOWN


@dataclass
class Publication:
    key: str
    client: str
    publishes: list[Op] = field(default_factory=list)
    syncs: list[Op] = field(default_factory=list)

    @property
    def pub(self) -> str:
        return next((str(o.result["pub"]) for o in self.publishes if o.outcome == "ok" and o.result.get("pub")), "")

    def msgs(self) -> list[str]:
        """Message ids in publishing order, of every publish that did not fail."""
        return [str(o.args["msg"]) for o in sorted(self.publishes, key=lambda o: int(o.args.get("idx", 0)))
                if o.outcome != "fail"]

    @property
    def complete(self) -> bool:
        return bool(self.publishes) and all(o.outcome == "ok" for o in self.publishes)

    @property
    def commit_op(self) -> Op | None:
        return _commit_of(self.syncs)

    @property
    def outcome(self) -> str:
        """As _committed; never committed: its messages never left the session."""
        if any(o.outcome == "fail" and o.result.get("backed_out") for o in self.publishes):
            return ABORTED
        return _committed(self.commit_op)


@dataclass
class Delivery:
    op: Op
    sub: str
    receipt: str
    pub_key: str  # the publication's key ("" when its messages are nobody's)
    msgs: list[str]


@dataclass
class Receipt:
    key: str
    sub: str
    recvs: list[Op] = field(default_factory=list)
    syncs: list[Op] = field(default_factory=list)

    @property
    def commit(self) -> Op | None:
        return _commit_of(self.syncs)

    @property
    def state(self) -> str:
        """COMMITTED, UNKNOWN (its COMMIT's outcome is not known) or ABORTED."""
        return _committed(self.commit)


class PubSubChecker:
    def __init__(self, ops: Iterable[Op], find: Find, counts: Counter[str],
                 disturbed: Iterable[tuple[float, float]] = (), purged: Mapping[str, float] | None = None,
                 topic_purges: Iterable[tuple[float, float]] = ()) -> None:
        self.ops = [o for o in ops if o.op in PUB_OPS]
        self.find = find
        self.counts = counts
        self.disturbed = list(disturbed)  # the faults' windows (checker.disturbed)
        self.purged = dict(purged or {})  # message -> when a purge discarded it (checker.purged)
        self.topic_purges = list(topic_purges)  # (from, to) of each purge of the topic's structure
        self.pubs: dict[str, Publication] = {}
        self.by_msg: dict[str, tuple[str, int]] = {}  # message id -> (publication key, index)
        self.by_id: dict[str, str] = {}  # publication id -> key
        self.receipts: dict[tuple[str, str], Receipt] = {}
        self.subscribes: dict[str, list[Op]] = defaultdict(list)
        self.durable: dict[str, bool] = {}
        self.deliveries: list[Delivery] = []
        self.outcome: dict[str, str] = {}

    # --- the picture -------------------------------------------------------------------------------------------
    def build(self) -> None:
        for o in self.ops:
            key = str(o.args.get("uow") or f"op{o.id}")
            if o.op == "psub":
                self.subscribes[str(o.args["sub"])].append(o)
                self.durable[str(o.args["sub"])] = bool(o.args.get("durable"))
            elif o.op == "ppub":
                p = self.pubs.setdefault(key, Publication(key, o.client))
                p.publishes.append(o)
                self.by_msg[str(o.args["msg"])] = (key, int(o.args.get("idx", 0)))
            elif o.op == "precv":
                self.receipts.setdefault((key, str(o.args["sub"])), Receipt(key, str(o.args["sub"]))).recvs.append(o)
            elif o.op == "psync" and o.args.get("role") == PUBLISHER:
                self.pubs.setdefault(key, Publication(key, o.client)).syncs.append(o)
            elif o.op == "psync" and o.args.get("role") == SUBSCRIBER:
                self.receipts.setdefault((key, str(o.args["sub"])), Receipt(key, str(o.args["sub"]))).syncs.append(o)
        for p in self.pubs.values():
            if p.pub:
                self.by_id[p.pub] = p.key
        for r in self.receipts.values():
            for o in r.recvs:
                if o.outcome == "ok":
                    self._delivery(r, o)

    def _delivery(self, r: Receipt, o: Op) -> None:
        pairs = [(str(m), bool(ok)) for m, ok in (o.result.get("msgs") or [])]
        msgs = [m for m, _ in pairs]
        for m, ok in pairs:
            if not ok:
                self.find("corrupted", [m], f"checksum mismatch in publication {o.result.get('pub')} received by "
                                            f"{r.sub} at op {o.id} ({o.client})", r.key)
        unknown = [m for m in msgs if m not in self.by_msg]
        if unknown or not msgs:
            self.find("pub-phantom", unknown, f"{r.sub} received publication {o.result.get('pub')} at op {o.id} "
                                              f"({o.client}) holding messages nobody published: {msgs}", r.key)
            return
        keys = {self.by_msg[m][0] for m in msgs}
        key = self.by_msg[msgs[0]][0]
        d = Delivery(o, r.sub, r.key, key, msgs)
        p = self.pubs[key]
        named = str(o.result.get("pub") or "")
        if len(keys) > 1:
            self.find("pub-partial", msgs, f"{r.sub} received one publication {named} at op {o.id} ({o.client}) "
                                           f"holding messages of several: {sorted(keys)}", r.key)
            return
        if p.pub and named != p.pub:
            self.find("pub-partial", msgs, f"{r.sub} received {p.key}'s messages at op {o.id} ({o.client}) as "
                                           f"publication {named}, its publisher was given {p.pub}", r.key)
        want = p.msgs()
        # A publication whose publishes all answered holds exactly those messages; one with an unknown publish may
        # lack it, but holds the rest in order and none twice.
        whole = msgs == want if p.complete else [m for m in want if m in msgs] == msgs and len(set(msgs)) == len(msgs)
        if not whole:
            self.find("pub-partial", msgs, f"{r.sub} received {p.key} at op {o.id} ({o.client}) as {msgs}; it was "
                                           f"published as {want}", r.key)
        self.deliveries.append(d)

    # --- the rules ---------------------------------------------------------------------------------------------
    def decide(self) -> None:
        delivered = {d.pub_key for d in self.deliveries}
        for p in self.pubs.values():
            out = p.outcome
            self.counts[f"publications {out}"] += 1
            if out == UNKNOWN:
                out = COMMITTED if p.key in delivered else ABORTED
                self.counts[f"publications of unknown outcome: {out}"] += 1
            self.outcome[p.key] = out
        for d in self.deliveries:
            if self.outcome[d.pub_key] == ABORTED:
                p = self.pubs[d.pub_key]
                c = p.commit_op
                b = next((o for o in p.syncs if o.args.get("option") == "BACKOUT"), None)
                why = (f"its COMMIT (op {c.id}) was {c.outcome}" if c is not None else
                       f"backed out (op {b.id})" if b is not None else "never committed")
                self.find("pub-backedout-delivered", d.msgs, f"{d.sub} received {p.key} ({p.client}, {why}) at op "
                                                             f"{d.op.id} ({d.op.client})", p.key)
        self.counts["publication deliveries"] += len(self.deliveries)

    def _incarnation(self, sub: str, at: float) -> tuple[Any, float]:
        """(identity, when it was first asked for) of the subscription a receive begun at ``at`` received for."""
        first: dict[Any, float] = {}
        current: tuple[Any, float] = (None, float("-inf"))
        for o in self.subscribes.get(sub, []):
            if o.outcome != "ok":
                continue
            ident = (o.result.get("home"), o.result.get("subscribed_pc"))
            first.setdefault(ident, o.t0)
            if _done(o) <= at:
                current = (ident, first[ident])
        return current

    def check_subscribers(self) -> None:
        by_sub: dict[str, list[Delivery]] = defaultdict(list)
        for d in sorted(self.deliveries, key=lambda d: d.op.t0):
            by_sub[d.sub].append(d)
        for sub in sorted(set(by_sub) | {s for s, durable in self.durable.items() if durable}):
            ds = by_sub.get(sub, [])
            if self.durable.get(sub, True):
                self._durable(sub, ds)
            else:
                groups: dict[Any, list[Delivery]] = defaultdict(list)
                starts: dict[Any, float] = {}
                for d in ds:
                    ident, t0 = self._incarnation(sub, d.op.t0)
                    groups[ident].append(d)
                    starts[ident] = t0
                for ident, group in groups.items():
                    self._judge(f"{sub} (non-durable, incarnation {ident})", group, starts[ident])

    def _durable(self, sub: str, ds: list[Delivery]) -> None:
        attempts = self.subscribes.get(sub, [])
        asked = min((o.t0 for o in attempts), default=float("inf"))
        answered = min((_done(o) for o in attempts if o.outcome == "ok"), default=float("inf"))
        subscribed = sorted(_done(o) for o in attempts if o.outcome == "ok")
        mine = self._judge(sub, ds, asked)
        for p in self.pubs.values():
            c = p.commit_op
            if self.outcome[p.key] != COMMITTED or c is None or not self._subscribed_through(subscribed, c):
                continue
            ok, maybe = mine.get(p.key, (0, 0))
            if ok or maybe:
                continue
            if any(m in self.purged for m in p.msgs()):
                # A purge discarded it (the subscriber's copy, or another's: the purge names messages, not
                # queues): allowed, as the queue rules allow a purged message never delivered.
                self.counts["publications purged (allowed)"] += 1
                continue
            known = p.outcome == COMMITTED
            self.find("pub-lost" if known else "pub-split", p.msgs(),
                      f"{p.key} ({p.client}, {'committed' if known else 'unknown outcome, received by another'}, "
                      f"COMMIT op {c.id} at t={c.t0}) never committed by durable subscriber {sub}, subscribed at "
                      f"t={answered}", p.key)

    def _subscribed_through(self, subscribed: list[float], commit: Op) -> bool:
        """Was a durable subscription in place through this COMMIT: one answered before the COMMIT was asked, and
        no purge of the topic's structure since (a purge discards the subscriptions with everything else; the
        subscriber subscribes again, from then on)?"""
        since = max((t for t in subscribed if t < commit.t0), default=None)
        if since is None:
            return False
        return not any(since < end and start < _done(commit) for start, end in self.topic_purges)

    def _judge(self, who: str, ds: list[Delivery], asked: float) -> dict[str, tuple[int, int]]:
        """The rules for one subscription's deliveries (in the order asked): not before it subscribed, not twice,
        in commit order. Returns publication key -> (receipts committed, receipts maybe committed)."""
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        committed_at: dict[str, float] = {}
        twice: set[str] = set()  # found duplicated already (one finding per publication)
        seq: list[Delivery] = []
        for d in ds:
            p = self.pubs[d.pub_key]
            c = p.commit_op
            if c is not None and _done(c) < asked:
                if not self._ordered(c):
                    # its COMMIT answered in a fault window: it may have taken effect in the CF after the subscribe
                    # (completed once the CF or its restore was back), open there until then
                    self.counts["publications committed in a fault window, received by a later subscriber "
                                "(allowed)"] += 1
                elif self._held_back(p, c, asked):
                    self.counts["publications held back at a subscribe, received (allowed)"] += 1
                else:
                    self.find("pub-before-subscribe", d.msgs, f"{who} received {p.key}, whose COMMIT (op {c.id}) "
                                                              f"answered at t={c.t1}, before it subscribed "
                                                              f"(t={asked})", d.receipt)
            if d.pub_key in committed_at and d.op.t0 > committed_at[d.pub_key] and d.pub_key not in twice:
                twice.add(d.pub_key)
                self.find("pub-duplicated", d.msgs, f"{who} received {p.key} again at op {d.op.id} (t={d.op.t0}) "
                                                    f"after committing it at t={committed_at[d.pub_key]}", d.receipt)
            r = self.receipts[(d.receipt, d.sub)]
            state = r.state
            if state == COMMITTED:
                counts[d.pub_key][0] += 1
                commit = r.commit
                assert commit is not None
                committed_at.setdefault(d.pub_key, _done(commit))
                if self.outcome[d.pub_key] == COMMITTED:  # one that never committed is found already
                    seq.append(d)
            elif state == UNKNOWN:
                counts[d.pub_key][1] += 1
            else:
                self.counts["publication redeliveries after backout"] += 1
        for key, (ok, _) in counts.items():
            if ok > 1 and key not in twice:
                self.find("pub-duplicated", self.pubs[key].msgs(), f"{who} committed {key} {ok} times", key)
        self._order(who, seq)
        return {k: (v[0], v[1]) for k, v in counts.items()}

    def _held_back(self, p: Publication, commit: Op, asked: float) -> bool:
        """Whether ``p`` (its COMMIT answered before the subscribe was asked) may have been held back at the
        subscribe: another publication's COMMIT (its puts are made then) began before ``p``'s answered, and had not
        answered when the subscribe was asked, so it may have been open below ``p`` while the subscribe read where
        to start."""
        for q in self.pubs.values():
            cq = q.commit_op
            if q is not p and cq is not None and cq.t0 < _done(commit) and self._open_until(cq) > asked:
                return True
        return False

    def _open_until(self, commit: Op) -> float:
        """Until when a publication may have been open in the CF: its COMMIT's answer, or, for one answered in a
        fault window (_ordered), the end of that window: it may have been completed in the CF only then."""
        if self._ordered(commit):
            return _done(commit)
        end = _done(commit)
        return max([end, *(w1 for w0, w1 in self.disturbed if commit.t0 < w1 and w0 < end)])

    def _order(self, who: str, seq: list[Delivery]) -> None:
        last: tuple[int, str] | None = None
        seen: set[str] = set()
        for i, d in enumerate(seq):
            if d.pub_key in seen:
                continue  # a duplicate: found above
            seen.add(d.pub_key)
            pos = (int(d.op.result.get("lrsn") or 0), str(d.op.result.get("pub") or ""))
            if last is not None and pos <= last:
                self.find("pub-order", d.msgs, f"{who} committed {d.pub_key} at position {pos} after position "
                                               f"{last}", d.receipt)
            last = pos
            c = self.pubs[d.pub_key].commit_op
            for later in seq[i + 1:]:
                lc = self.pubs[later.pub_key].commit_op
                if (c is not None and lc is not None and self._ordered(lc) and _done(lc) < c.t0
                        and later.pub_key != d.pub_key):
                    self.find("pub-order", [*d.msgs, *later.msgs],
                              f"{who} committed {d.pub_key} before {later.pub_key}, though {later.pub_key}'s COMMIT "
                              f"answered (t={lc.t1}) before {d.pub_key}'s was asked (t={c.t0})", d.receipt)
                    break

    def _ordered(self, commit: Op) -> bool:
        """Does this COMMIT's answer say when the publication took effect? Only an answer "ok" given outside every
        fault window, as the queue order rule (checker.check_order): a COMMIT whose outcome the publisher never
        learnt, or one made while the CF was lost, is completed later (by the member once the CF or its restore
        is back, or by peer recovery), after publications committed meanwhile: visible late, as allowed."""
        end = _done(commit)
        return commit.outcome == "ok" and not any(commit.t0 < w1 and w0 < end for w0, w1 in self.disturbed)

    def run(self) -> None:
        if not self.ops:
            return
        self.build()
        self.decide()
        self.check_subscribers()
        self.counts["publications"] = len(self.pubs)
        self.counts["publication messages"] = len(self.by_msg)


def check_pubsub(ops: Iterable[Op], find: Find, counts: Counter[str],
                 disturbed: Iterable[tuple[float, float]] = (), purged: Mapping[str, float] | None = None,
                 topic_purges: Iterable[tuple[float, float]] = ()) -> None:
    """Apply the publish/subscribe rules to a history's pub/sub operations (the others are left alone);
    `disturbed`: the faults' windows; `purged`: the messages purges discarded, and when; `topic_purges`: the
    purges of the topic's structure (from, to)."""
    PubSubChecker(ops, find, counts, disturbed, purged, topic_purges).run()


__all__ = ["PUB_KINDS", "PUB_OPS", "PubSubChecker", "check_pubsub"]
