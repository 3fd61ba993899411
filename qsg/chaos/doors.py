"""The doors an operation of the chaos history went through besides the native client: its ``via`` argument, and
what a door does not tell that the native client does (a delivery's backout count)."""

from __future__ import annotations

from qsg.chaos.history import Op

VIA = "via"  # the history's argument naming the door an operation went through
REST = "rest"  # the messaging REST API (qsg.chaos.rest_actions)
KOMBU = "kombu"  # the kombu transport (qsg.chaos.kombu_actions)


def is_rest(o: Op) -> bool:
    return o.args.get(VIA) == REST


def is_kombu(o: Op) -> bool:
    return o.args.get(VIA) == KOMBU


def count_untold(o: Op) -> bool:
    """Whether a delivery's backout count is not in the history: the REST door tells none; kombu tells only whether
    it is a redelivery (a first delivery's count is 0, a redelivery's is not known)."""
    return is_rest(o) or is_kombu(o) and "backout_count" not in o.result


def kombu_counts(ops: list[Op]) -> dict[str, int]:
    """How much went through the kombu door: publishes acknowledged, deliveries acknowledged (committed)."""
    kombu = [o for o in ops if is_kombu(o)]
    return {"kombu publishes acknowledged": sum(1 for o in kombu if o.op == "put" and o.outcome == "ok"),
            "kombu deliveries": sum(1 for o in kombu if o.op == "get" and o.outcome == "ok"),
            "kombu deliveries acknowledged": sum(1 for o in kombu if o.op == "commit" and o.outcome == "ok"),
            "kombu deliveries requeued": sum(1 for o in kombu if o.op == "backout" and o.outcome == "ok")}


__all__ = ["KOMBU", "REST", "VIA", "count_untold", "is_kombu", "is_rest", "kombu_counts"]
