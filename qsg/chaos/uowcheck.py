"""The chaos checker's rules for units of work sent to a service (docs/uow.md; docs/invariants.md, invariant 9):
whole, in order, settled once, and every status seen one the state table allows.

The workload's conversation actions (qsg.chaos.conversations) record these operations, each with ``uow`` = the
action's key (``c3.17``, one sent or one received UOW per action) and ``svc``:

    usend  args msg, idx (0-based), of (messages planned)      result suow (the server's UOW id), status, messages
    urecv  args -                                              result msg, crc_ok, suow, recv (RECV_*), status
    usync  args option (COMMIT, BACKOUT, CANCEL, QUERY, LAST), role (sender / receiver / query), suow (the UOW it
           names, when known)                                  result status, suow
    ulogon args user

A failed call carries ``reason`` and ``error`` (the exception's class: EndOfUowError and NoMessageError share a
reason code). The drain (client ``udrain``) receives every UOW left, and then the final pass (client ``ufinal``)
QUERYs every UOW the history knows: its answer is the UOW's final status.

Findings (the message ids and the action keys involved):
  uow-interleaved  one receipt (a receiver's action) got messages of two UOWs, or a message whose UOW is not the
                   one the receive named;
  uow-order        a receipt's messages not in the sender's order from the first (idx 0, 1, ...), or RECV_ markers
                   that do not match (ONLY for one message; FIRST, MIDDLE..., LAST);
  uow-partial      a receiver committed (PROCESSED) fewer messages than the sender committed, was told "end of unit
                   of work" early, or got more messages than the UOW holds;
  uow-received-backedout  a message of a UOW its sender backed out (or whose final status is BACKEDOUT) received;
  uow-duplicated   a UOW two receivers committed (PROCESSED twice);
  uow-lost         a UOW its sender committed (ACCEPTED) that was never processed, not cancelled and not timed out,
                   or whose status (persistent) is no longer known;
  uow-cancelled-processed  a UOW processed by a receiver, and cancelled or timed out as well;
  uow-unsettled    a UOW still RECEIVED, ACCEPTED, DELIVERED or POSTPONED after the drain;
  uow-status       a status seen after another (the first's call completed before the second's began) that the
                   state table (sqm.conversations.uowstatus.TABLE) and the restart rule (after_restart) cannot reach from it, a
                   status not in the model, or PROCESSED with no receiver commit that may have done it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import product

from qsg.chaos.history import Find, Op
from sqm.conversations.uowstatus import (
    ACTIVE,
    BACKEDOUT,
    CANCELLED,
    PROCESSED,
    RECV_FIRST,
    RECV_LAST,
    RECV_MIDDLE,
    RECV_ONLY,
    STATUSES,
    TABLE,
    TIMEOUT,
    Control,
    after_restart,
)

CONV_OPS = ("ulogon", "usend", "urecv", "usync")
UOW_KINDS = ("uow-interleaved", "uow-order", "uow-partial", "uow-received-backedout", "uow-duplicated", "uow-lost",
             "uow-cancelled-processed", "uow-unsettled", "uow-status")
DRAIN_CLIENT, FINAL_CLIENT = "udrain", "ufinal"
END_OF_UOW = "EndOfUowError"
UNKNOWN_UOW = "UnknownUowError"
SENDER, RECEIVER = "sender", "receiver"


def _reachable() -> dict[str, set[str]]:
    """Every status reachable from each status: the state table's edges (any actor, any event) and the restart
    rule's (every combination of persistent UOW and persistent status), closed transitively."""
    edges: dict[str, set[str]] = {s: set() for s in STATUSES}
    for (_who, _event, frm), to in TABLE.items():
        edges[frm].add(to)
    for s, persistent, mult in product(STATUSES, (True, False), (0, 1)):
        after = after_restart(Control(uow="", service="", status=s, persistent=persistent, status_mult=mult))
        if after is not None and after.status != s:
            edges[s].add(after.status)
    reach: dict[str, set[str]] = {}
    for s in STATUSES:
        seen: set[str] = set()
        todo = [s]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[s] = seen
    return reach


REACHABLE = _reachable()


def allowed_after(before: str, after: str) -> bool:
    """May a UOW seen in status ``before`` later be seen in ``after``?"""
    return before == after or after in REACHABLE.get(before, set())


@dataclass
class SentUow:
    key: str
    client: str
    sends: list[Op] = field(default_factory=list)
    syncs: list[Op] = field(default_factory=list)
    suow: str = ""

    def msgs(self) -> dict[str, int]:
        """Message id -> its index, for every send that did not fail (an unknown one may have been sent)."""
        return {o.args["msg"]: int(o.args.get("idx", 0)) for o in self.sends if o.outcome != "fail"}

    @property
    def complete(self) -> bool:
        """Every send answered ok: the UOW holds exactly these messages (if it was committed)."""
        return bool(self.sends) and all(o.outcome == "ok" for o in self.sends)

    def sync(self, option: str, outcome: str | None = None) -> list[Op]:
        return [o for o in self.syncs if o.args.get("option") == option and (outcome is None or o.outcome == outcome)]

    @property
    def committed(self) -> bool:
        """Known ACCEPTED by its sender's COMMIT."""
        return bool(self.sync("COMMIT", "ok"))

    @property
    def backed_out(self) -> bool:
        """Known backed out: BACKOUT answered ok, or a send or the commit failed with the UOW backed out."""
        return bool(self.sync("BACKOUT", "ok")) or any(
            o.outcome == "fail" and o.result.get("backed_out") for o in [*self.sends, *self.sync("COMMIT")])


@dataclass
class Receipt:
    key: str
    client: str
    recvs: list[Op] = field(default_factory=list)
    syncs: list[Op] = field(default_factory=list)

    @property
    def got(self) -> list[Op]:
        return [o for o in self.recvs if o.outcome == "ok" and o.result.get("msg")]

    @property
    def suow(self) -> str:
        return next((str(o.result.get("suow") or "") for o in self.got), "")

    def ended(self, option: str, outcome: str) -> bool:
        return any(o.args.get("option") == option and o.outcome == outcome for o in self.syncs)

    @property
    def saw_end(self) -> bool:
        return any(o.outcome == "fail" and o.result.get("error") == END_OF_UOW for o in self.recvs)


@dataclass
class Seen:
    """One status a call returned for a UOW, and when the call ran."""
    status: str
    t0: float
    t1: float
    op: Op


class UowChecker:
    def __init__(self, ops: Iterable[Op], find: Find, counts: Counter[str]) -> None:
        self.ops = [o for o in ops if o.op in CONV_OPS]
        self.find = find
        self.counts = counts
        self.sent: dict[str, SentUow] = {}
        self.receipts: dict[str, Receipt] = {}
        self.msg_of: dict[str, tuple[str, int]] = {}  # message id -> (sent key, index)
        self.by_suow: dict[str, SentUow] = {}
        self.seen: dict[str, list[Seen]] = defaultdict(list)  # suow -> statuses seen
        self.final: dict[str, Op] = {}  # suow -> the final pass's QUERY

    # --- the picture -------------------------------------------------------------------------------------------
    def build(self) -> None:
        for o in self.ops:
            key = str(o.args.get("uow") or f"op{o.id}")
            if o.op == "usend":
                s = self.sent.setdefault(key, SentUow(key, o.client))
                s.sends.append(o)
                self.msg_of[o.args["msg"]] = (key, int(o.args.get("idx", 0)))
                if o.outcome == "ok" and o.result.get("suow"):
                    s.suow = str(o.result["suow"])
            elif o.op == "urecv":
                self.receipts.setdefault(key, Receipt(key, o.client)).recvs.append(o)
            elif o.op == "usync":
                role = o.args.get("role")
                if role == SENDER:
                    self.sent.setdefault(key, SentUow(key, o.client)).syncs.append(o)
                elif role == RECEIVER:
                    self.receipts.setdefault(key, Receipt(key, o.client)).syncs.append(o)
                if o.client == FINAL_CLIENT and o.args.get("option") == "QUERY" and o.args.get("suow"):
                    self.final[str(o.args["suow"])] = o  # the last one recorded wins
            self._observe(o)
        for s in self.sent.values():
            if s.suow:
                self.by_suow[s.suow] = s

    def _observe(self, o: Op) -> None:
        if o.outcome != "ok" or o.op not in ("usend", "urecv", "usync"):
            return
        status = o.result.get("status")
        suow = o.result.get("suow") or o.args.get("suow")
        if not status or not suow or suow == "BOTH":
            return  # no trace kept (None), or a call about no UOW
        self.seen[str(suow)].append(Seen(str(status), o.t0, o.t1 if o.t1 is not None else o.t0, o))

    def _find(self, kind: str, msgs: Iterable[str], detail: str, key: str = "") -> None:
        self.find(kind, msgs, detail, key)

    # --- the rules ---------------------------------------------------------------------------------------------
    def check_receipts(self) -> None:
        """Whole or not at all, one UOW at a time, in order, with consistent RECV_ markers."""
        for r in self.receipts.values():
            got = r.got
            if not got:
                continue
            msgs = [str(o.result["msg"]) for o in got]
            for o in got:
                if not o.result.get("crc_ok", True):
                    self._find("corrupted", [str(o.result["msg"])], f"checksum mismatch at op {o.id} ({o.client})",
                               r.key)
            unknown = [m for m in msgs if m not in self.msg_of]
            if unknown:
                self._find("phantom", unknown, f"receipt {r.key} ({r.client}) got messages nobody sent", r.key)
                continue
            keys = {self.msg_of[m][0] for m in msgs}
            named = {str(o.result.get("suow") or "") for o in got}
            wrong = [m for m in msgs if self.sent[self.msg_of[m][0]].suow not in ("", *named)]
            if len(keys) > 1 or len(named) > 1 or wrong:
                self._find("uow-interleaved", msgs, f"receipt {r.key} ({r.client}) got messages of sent UOWs "
                                                    f"{sorted(keys)} under UOW ids {sorted(named)}", r.key)
                continue
            s = self.sent[keys.pop()]
            idx = [self.msg_of[m][1] for m in msgs]
            if idx != list(range(len(idx))):
                self._find("uow-order", msgs, f"receipt {r.key} ({r.client}) got {s.key}'s messages in the order "
                                              f"{idx}", r.key)
            n = len(s.msgs()) if s.complete else None
            if n is not None:
                want = [RECV_ONLY] if n == 1 else [RECV_FIRST, *[RECV_MIDDLE] * (n - 2), RECV_LAST]
                markers = [str(o.result.get("recv")) for o in got]
                if markers != want[:len(markers)]:
                    self._find("uow-order", msgs, f"receipt {r.key} ({r.client}) of {s.key} ({n} messages): "
                                                  f"markers {markers}, expected {want[:len(markers)]}", r.key)
                if len(got) > n:
                    self._find("uow-partial", msgs, f"receipt {r.key} ({r.client}) got {len(got)} messages of "
                                                    f"{s.key}, which holds {n}", r.key)
                elif len(got) < n and (r.ended("COMMIT", "ok") or r.saw_end):
                    why = "committed" if r.ended("COMMIT", "ok") else "was told end of unit of work"
                    self._find("uow-partial", msgs, f"receipt {r.key} ({r.client}) {why} after {len(got)} of "
                                                    f"{s.key}'s {n} messages", r.key)
            if s.backed_out or self._final_status(s) == BACKEDOUT:
                self._find("uow-received-backedout", msgs, f"receipt {r.key} ({r.client}) got messages of {s.key}, "
                                                           "which its sender backed out", r.key)
            self.counts["UOW receipts"] += 1

    def _final_status(self, s: SentUow) -> str | None:
        q = self.final.get(s.suow) if s.suow else None
        return str(q.result.get("status")) if q is not None and q.outcome == "ok" and q.result.get("status") else None

    def check_settled(self) -> None:
        """An ACCEPTED UOW is processed exactly once, unless cancelled or timed out (then never)."""
        processed: dict[str, list[Receipt]] = defaultdict(list)  # sent key -> receipts that committed (ok)
        maybe: dict[str, list[Receipt]] = defaultdict(list)  # ... whose commit's outcome is unknown
        for r in self.receipts.values():
            got = r.got
            if not got or str(got[0].result.get("msg")) not in self.msg_of:
                continue
            key = self.msg_of[str(got[0].result["msg"])][0]
            if r.ended("COMMIT", "ok"):
                processed[key].append(r)
            elif r.ended("COMMIT", "unknown"):
                maybe[key].append(r)
        for s in self.sent.values():
            msgs = sorted(s.msgs())
            done = processed.get(s.key, [])
            final = self._final_status(s)
            self.counts[f"UOWs final {final or 'unknown'}"] += 1
            if len(done) > 1:
                self._find("uow-duplicated", msgs, f"{s.key} ({s.client}, UOW {s.suow}) processed by "
                                                   f"{', '.join(r.key for r in done)}", s.key)
            cancelled = bool(s.sync("CANCEL", "ok")) or final in (CANCELLED, TIMEOUT) or any(
                x.status in (CANCELLED, TIMEOUT) for x in self.seen.get(s.suow, []))
            if done and cancelled:
                self._find("uow-cancelled-processed", msgs, f"{s.key} ({s.client}, UOW {s.suow}) processed by "
                                                            f"{done[0].key} and {final or 'CANCELLED'} as well", s.key)
            if final in ACTIVE:
                self._find("uow-unsettled", msgs, f"{s.key} ({s.client}, UOW {s.suow}) still {final} after the "
                                                  "drain", s.key)
            if final == PROCESSED and not done and not maybe.get(s.key):
                self._find("uow-status", msgs, f"{s.key} ({s.client}, UOW {s.suow}) is PROCESSED, but no receiver's "
                                               "commit of it succeeded or was left unknown", s.key)
            if not s.committed or cancelled or done or maybe.get(s.key):
                continue
            q = self.final.get(s.suow) if s.suow else None
            if q is None or (q.outcome != "ok" and q.result.get("error") != UNKNOWN_UOW):
                self.counts["committed UOWs without a final status"] += 1
                continue
            if final != PROCESSED and final not in ACTIVE:  # (an active one is unsettled, above)
                why = f"its status is {final}" if final else "its status is no longer known"
                self._find("uow-lost", msgs, f"{s.key} ({s.client}, UOW {s.suow}) was committed by its sender, "
                                             f"never processed, neither cancelled nor timed out: {why}", s.key)

    def check_statuses(self) -> None:
        """Each status seen is reachable from every status seen for the UOW by a call that completed before."""
        for suow, seen in self.seen.items():
            bad = [x for x in seen if x.status not in STATUSES]
            if bad:
                self._find("uow-status", [], f"UOW {suow}: status {bad[0].status!r} (op {bad[0].op.id}, "
                                             f"{bad[0].op.client}) is not one of the model's", self._key(suow))
                continue
            seen.sort(key=lambda x: x.t0)
            for b in seen:
                a = next((a for a in seen if a.t1 < b.t0 and not allowed_after(a.status, b.status)), None)
                if a is not None:
                    self._find("uow-status", [], f"UOW {suow}: {b.status} (op {b.op.id} {b.op.args.get('option') or b.op.op}"
                                                 f", {b.op.client}, t={b.t0}) after {a.status} (op {a.op.id} "
                                                 f"{a.op.args.get('option') or a.op.op}, {a.op.client}, done at "
                                                 f"t={a.t1}): the state table does not lead there", self._key(suow))
                    break
            self.counts["UOW statuses seen"] += len(seen)

    def _key(self, suow: str) -> str:
        s = self.by_suow.get(suow)
        return s.key if s is not None else suow

    def run(self) -> None:
        if not self.ops:
            return
        self.build()
        self.check_receipts()
        self.check_settled()
        self.check_statuses()
        self.counts["UOWs sent"] = len(self.sent)
        self.counts["UOWs committed by their sender"] = sum(1 for s in self.sent.values() if s.committed)
        self.counts["UOW messages"] = len(self.msg_of)


def check_uows(ops: Iterable[Op], find: Find, counts: Counter[str]) -> None:
    """Apply the UOW rules to a history's conversation operations (the others are left alone)."""
    UowChecker(ops, find, counts).run()


__all__ = ["CONV_OPS", "DRAIN_CLIENT", "FINAL_CLIENT", "REACHABLE", "UOW_KINDS", "UowChecker", "allowed_after",
           "check_uows"]
