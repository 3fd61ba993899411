"""The chaos workload's message bodies: ``CHAOS1|<id>|<crc32c of payload>|<payload>``, the id unique in the run
and the payload derived from it, so that any delivery says which message it is and whether it arrived intact."""

from __future__ import annotations

import hashlib

import crc32c

BODY_MAGIC = b"CHAOS1"


def make_body(msg_id: str, size: int) -> bytes:
    """CHAOS1|<id>|<crc32c of payload, hex>|<payload>; the payload is derived from the id (reproducible)."""
    seed = hashlib.sha256(msg_id.encode()).digest()
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


__all__ = ["BODY_MAGIC", "make_body", "parse_body"]
