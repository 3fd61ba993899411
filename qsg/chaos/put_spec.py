"""One message a chaos client puts, as its plan draws it (through the native client or the REST door): the id, the
queue, the priority, persistence, the expiry and the payload's size its body is made from (qsg.chaos.bodies)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PutSpec:
    msg: str
    queue: str
    priority: int
    persistent: bool
    expiry_ms: int
    size: int


def door_puts(rnd: random.Random, next_msg: Callable[[], str], queues: Sequence[str],
              persistent_p: float) -> tuple[PutSpec, ...]:
    """1-3 puts of a door's action (REST, kombu), drawn from the plan's generator: priority 0 mostly, 5 or 9
    sometimes; persistent with probability ``persistent_p``; 5% with an expiry."""
    return tuple(PutSpec(next_msg(), rnd.choice(queues), rnd.choice((0, 0, 0, 0, 5, 9)), rnd.random() < persistent_p,
                         rnd.choice((1500, 4000)) if rnd.random() < 0.05 else 0, rnd.randint(64, 1024))
                 for _ in range(rnd.randint(1, 3)))


__all__ = ["PutSpec", "door_puts"]
