"""The chaos workload's message bodies: ``CHAOS1|<id>|<crc32c of payload>|<payload>``, the id unique in the run
and the payload derived from it, so that any delivery says which message it is and whether it arrived intact.

Every body is ASCII text: the REST door (docs/rest.md) puts and gets text messages only, and its gets share the
queues with the native client's, so any message of the workload must be one a REST get can take (a body that is
not UTF-8 is refused there and left at the head of its queue)."""

from __future__ import annotations

import hashlib
from typing import Any

import crc32c

BODY_MAGIC = b"CHAOS1"


def make_body(msg_id: str, size: int) -> bytes:
    """CHAOS1|<id>|<crc32c of payload, hex>|<payload>; the payload (hex digits) is derived from the id
    (reproducible)."""
    seed = hashlib.sha256(msg_id.encode()).hexdigest().encode()
    payload = (seed * (size // len(seed) + 1))[:size]
    return b"|".join((BODY_MAGIC, msg_id.encode(), b"%08x" % crc32c.crc32c(payload), payload))


def parse_body(body: bytes) -> tuple[str | None, bool]:
    """(message id or None when the body is not a chaos message, checksum matches)."""
    parts = body.split(b"|", 3)
    if len(parts) != 4 or parts[0] != BODY_MAGIC:
        return None, False
    try:
        msg_id = parts[1].decode()
        ok = int(parts[2], 16) == crc32c.crc32c(parts[3])
    except ValueError:
        return None, False
    return msg_id, ok


def delivery_fields(m: Any, qmgr: str) -> dict[str, Any]:
    """What the history keeps of a message a get delivered (``m`` a client Message): the checker's delivery."""
    msg_id, crc_ok = parse_body(m.body)
    return {"msg": msg_id, "crc_ok": crc_ok, "queue": m.queue, "priority": m.priority, "persistent": m.persistent,
            "backout_count": m.backout_count, "qmgr": qmgr}


def pending_delivery(e: BaseException, qmgr: str) -> dict[str, Any]:
    """The delivery an unknown outcome carries: a get whose commit is pending delivered its message with the error
    (OutcomePendingError.message); the history records the get unknown, with the message delivered. {} for any
    other unknown outcome."""
    m = getattr(e, "message", None)
    return delivery_fields(m, qmgr) if isinstance(getattr(m, "body", None), bytes) else {}


__all__ = ["BODY_MAGIC", "delivery_fields", "make_body", "parse_body", "pending_delivery"]
