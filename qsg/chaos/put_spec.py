"""One message a chaos client puts, as its plan draws it (through the native client or the REST door): the id, the
queue, the priority, persistence, the expiry and the payload's size its body is made from (qsg.chaos.bodies)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PutSpec:
    msg: str
    queue: str
    priority: int
    persistent: bool
    expiry_ms: int
    size: int


__all__ = ["PutSpec"]
