"""The checker's rule for the REST door's gets (qsg.chaos.rest_actions): at-most-once, and nothing more.

A REST get is a destructive get outside syncpoint whose message travels in the HTTP reply: there is no
acknowledgement after delivery (docs/rest.md), so a get whose exchange broke after the door committed it took a
message that nobody received. The history cannot tell which: such a get (``via: "rest"``, outcome unknown, no message
received) may account for one missing message, on its queue, that was there while the get could still run (its
server side may go on SETTLE_S past the client's end, as for any unknown outcome). Each unknown REST get accounts for
one message at most: missing messages are matched to distinct gets (a maximum bipartite matching), and a message
left without a get is lost as before. Everything else holds for REST operations as for the native client's: a put
answered 201 is committed, and no message is received twice (a REST get answered 200 is a committed get).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qsg.chaos.doors import REST, VIA, count_untold, is_rest
from qsg.chaos.history import Op


def unknown_rest_gets(ops: Sequence[Op]) -> list[Op]:
    """The REST gets that may have taken a message nobody received: outcome unknown, no message in the reply."""
    return [o for o in ops if o.op == "get" and is_rest(o) and o.outcome == "unknown" and "msg" not in o.result]


def rest_counts(ops: Sequence[Op]) -> dict[str, int]:
    """How much went through the REST door: puts acknowledged (201), gets that received a message (200)."""
    rest = [o for o in ops if is_rest(o)]
    return {"REST puts acknowledged": sum(1 for o in rest if o.op == "put" and o.outcome == "ok"),
            "REST gets received": sum(1 for o in rest if o.op == "get" and "msg" in o.result),
            "REST operations refused or unknown": sum(1 for o in rest if o.outcome != "ok"
                                                      and o.result.get("status") != 204)}


def ordering_counts(deliveries: Sequence[Op], consumed: Callable[[Op], bool]) -> dict[int, int]:
    """The backout count of each delivery of one message (op id -> count), that orders the message's deliveries.
    The native client's is the message's own (the member tells it); a REST get's is not told (the door has no such
    header), so it is one more than the highest count among the deliveries it followed (0 when none): those that
    completed before it was asked (they gave the message back before it could take it), and those that completed
    while it ran and did not consume the message (``consumed``: their unit of work is known committed), which gave
    it back while it waited. A delivery that consumed the message while the REST get ran came after the REST get's
    take, which was backed out: a member held up (paused, fenced) between its take and its reply answers long after
    the take (the door's ``ibm-mq-outcome: unknown``). Without this a REST get that waited (asked before a native get
    took the message, answered after that get's backout gave it back) or that took a message backed out before (its
    true count above 0) would sort before the deliveries it followed. A kombu redelivery's count is inferred the
    same way (kombu tells only that it is one: its count is at least 1); a first kombu delivery's is 0.
    """
    def end(o: Op) -> float:
        return o.t1 if o.t1 is not None else o.t0

    counts = {o.id: int(o.result.get("backout_count", 0) or 0) for o in deliveries if not count_untold(o)}
    for r in sorted((o for o in deliveries if count_untold(o)), key=end):
        followed = [counts[d.id] for d in deliveries if d is not r and d.id in counts
                    and (end(d) < r.t0 or end(d) < end(r) and not consumed(d))]
        counts[r.id] = max(max(followed) + 1 if followed else 0, 1 if r.result.get("redelivered") else 0)
    return counts


def could_take(g: Op, queue: str, available_from: float, settle_s: float) -> bool:
    """Whether REST get ``g`` could have taken a message of ``queue`` that was there from ``available_from`` on."""
    end = (g.t1 if g.t1 is not None else float("inf")) + settle_s
    return g.args.get("queue") == queue and end >= available_from


def match_missing(missing: Sequence[tuple[str, str, float]], gets: Sequence[Op],
                  settle_s: float) -> dict[str, Op]:
    """Missing messages (id, queue, since) matched to distinct unknown REST gets that could have taken them: as many
    as can be (augmenting paths); each get takes one message at most."""
    taker: dict[int, str] = {}  # get id -> the message it accounts for
    by_id = {g.id: g for g in gets}
    options = {m: [g.id for g in gets if could_take(g, q, since, settle_s)] for m, q, since in missing}

    def assign(m: str, seen: set[int]) -> bool:
        for gid in options[m]:
            if gid in seen:
                continue
            seen.add(gid)
            if gid not in taker or assign(taker[gid], seen):
                taker[gid] = m
                return True
        return False

    for m, _, _ in missing:
        if options[m]:
            assign(m, set())
    return {m: by_id[gid] for gid, m in taker.items()}


__all__ = ["REST", "VIA", "could_take", "is_rest", "match_missing", "ordering_counts", "rest_counts",
           "unknown_rest_gets"]
