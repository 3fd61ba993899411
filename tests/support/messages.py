"""Reading what a queue holds, for the tests."""

from __future__ import annotations

from cfemu.errors import NoMessageError
from sqm.core.messaging import Messaging


def drained(handle: Messaging, queue: str) -> list[bytes]:
    """Every message body on the queue, in get order, got in one unit of work and committed (through an in-process
    connection or a service client alike)."""
    out = []
    while True:
        try:
            out.append(handle.get(queue).body)
        except NoMessageError:
            handle.commit()
            return out
