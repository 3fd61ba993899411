"""The open connections of an HTTP door (a REST port, a metrics port, the console, an exporter), counted in total
and per peer address: a new connection past either cap is closed at once.

The doors answer peers that have not authenticated, and each connection holds a file descriptor (and, in the
exporters' servers, a thread): without a cap, one local peer holding idle connections exhausts the process's file
descriptors and keeps every other client out. The cap keeps a door's share of them bounded; the per-peer cap keeps
one address from taking the whole share. Thread-safe: the exporters admit on their accept thread and release on
each connection's own.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ConnectionCap:
    """At most ``total`` connections open at once, at most ``per_peer`` of them from one address."""

    total: int
    per_peer: int
    open: int = 0
    refused: int = 0  # connections closed at once because a cap was reached, since the start
    _peers: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.total < 1 or self.per_peer < 1:
            raise ValueError(f"connection caps must be at least 1, not {self.total} and {self.per_peer}")

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer``; or, past a cap, count the refusal and say which cap (the
        connection is then closed and not counted as open)."""
        with self._lock:
            if self.open >= self.total:
                self.refused += 1
                return f"{self.total} connections at once"
            if self._peers[peer] >= self.per_peer:
                self.refused += 1
                return f"{self.per_peer} connections at once from {peer}"
            self.open += 1
            self._peers[peer] += 1
            return None

    def release(self, peer: str) -> None:
        """A connection ``admit`` counted has closed."""
        with self._lock:
            self.open -= 1
            self._peers[peer] -= 1
            if self._peers[peer] <= 0:
                del self._peers[peer]


def peer_of(address: object) -> str:
    """The address part of a socket's peer name (the host of (host, port), or '?')."""
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "?"


__all__ = ["ConnectionCap", "peer_of"]
