"""What clients running lifecycles (a put, then a get, each outside syncpoint) were told, request by request, and
the promise a member's queue must keep against it after a fault: no acknowledged get's message back, no put told
refused delivered, no acknowledged put lost unless a get whose outcome is unknown may have taken it, nothing that no
client had acknowledged or had in doubt."""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sqm.service.client import Client


@dataclass
class LifecycleLedger:
    acked_puts: set[bytes] = field(default_factory=set)
    refused_puts: set[bytes] = field(default_factory=set)
    unknown_puts: set[bytes] = field(default_factory=set)
    acked_gets: set[bytes] = field(default_factory=set)
    doubtful_gets: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, c: Client, queue: str, body: bytes, refused: tuple[type[BaseException], ...] = ()) -> bool:
        """Put `body` outside syncpoint and note what the client was told; False when it was not acknowledged."""
        try:
            c.put(queue, body, syncpoint=False)
        except refused:
            with self.lock:
                self.refused_puts.add(body)
            return False
        except Exception:  # noqa: BLE001 - its outcome unknown to the client: in doubt
            with self.lock:
                self.unknown_puts.add(body)
            return False
        with self.lock:
            self.acked_puts.add(body)
        return True

    def get(self, c: Client, queue: str, nothing: tuple[type[BaseException], ...] = (), **options: Any) -> bool | None:
        """Get outside syncpoint and note the message; True when one was acknowledged, None when the queue had
        none (an error of `nothing`), False when the outcome is unknown."""
        try:
            got = c.get(queue, syncpoint=False, **options).body
        except nothing:
            return None
        except Exception:  # noqa: BLE001 - whether a message was taken is unknown
            with self.lock:
                self.doubtful_gets += 1
            return False
        with self.lock:
            self.acked_gets.add(got)
        return True

    def check(self, there: Collection[bytes]) -> None:
        """The queue's messages after the fault (`there`, as read back) keep the ledger's promise."""
        held = set(there)
        assert len(held) == len(there), "a message is there twice"
        assert not held & self.acked_gets, "an acknowledged get's message came back"
        assert not held & self.refused_puts, "a put told refused was delivered"
        lost = self.acked_puts - self.acked_gets - held
        assert len(lost) <= self.doubtful_gets, f"acknowledged puts lost: {len(lost)}"
        assert held <= self.acked_puts | self.unknown_puts | self.refused_puts, \
            "a message no client had acknowledged or had in doubt"
