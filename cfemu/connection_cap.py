"""The open connections of an HTTP door (a REST port, a metrics port, the console, an exporter), counted in total
and per peer address.

The doors answer peers that have not authenticated, and each connection holds a file descriptor (and, in the
exporters' servers, a thread): without a cap, one local peer holding idle connections exhausts the process's file
descriptors and keeps every other client out. The cap keeps a door's share of them bounded; the per-peer cap keeps
one address from taking the whole share.

- Past the per-peer cap a new connection is closed at once.
- Past the total cap, the door makes room rather than refuse the newcomer: a connection that has no request under
  way is closed (evicted) in its place: one that has not sent a whole request head yet before one idle between
  requests, of those one from the address that holds the most connections, of those the oldest; only when every
  connection has a request under way is the newcomer closed at once. A cap that
  only refused was held by a few local addresses (127.0.0.2, 127.0.0.3, ...: each under its per-peer cap) sending a
  partial request head on every connection and reopening each the door closed: no other client got in.

Thread-safe: the exporters admit on their accept thread and release on each connection's own.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Protocol

Waiting = Literal["head", "idle"] | None


class Held(Protocol):
    """One connection a door holds, as the cap sees it."""

    def waiting(self) -> Waiting:
        """What it waits for: "head" (no whole request head yet), "idle" (between requests), None (a request is
        under way: never evicted)."""

    def evict(self) -> None:
        """Close it (called on the thread that admits, outside the cap's lock; its release is then a no-op)."""


@dataclass
class ConnectionCap:
    """At most ``total`` connections open at once, at most ``per_peer`` of them from one address."""

    total: int
    per_peer: int
    open: int = 0
    refused: int = 0  # connections closed at once because a cap was reached, since the start
    evicted: int = 0  # connections closed to make room for a newer one, since the start
    _peers: Counter[str] = field(default_factory=Counter)
    _held: dict[Held, str] = field(default_factory=dict)  # the evictable connections, oldest first, and their peer
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.total < 1 or self.per_peer < 1:
            raise ValueError(f"connection caps must be at least 1, not {self.total} and {self.per_peer}")

    def admit(self, peer: str, held: Held | None = None) -> str | None:
        """Count a new connection from ``peer`` (``held``: how the cap may evict it later); past the total cap,
        evict the oldest connection that waits (see the module doc) to make room. None when it is admitted, else
        the refusal counted, saying which cap (the connection is then closed and not counted as open)."""
        victim: Held | None = None
        with self._lock:
            if self._peers[peer] >= self.per_peer:
                self.refused += 1
                return f"{self.per_peer} connections at once from {peer}"
            if self.open >= self.total:
                victim = self._oldest_waiting()
                if victim is None:
                    self.refused += 1
                    return f"{self.total} connections at once (each with a request under way)"
                self._forget(victim)
                self.evicted += 1
            self.open += 1
            self._peers[peer] += 1
            if held is not None:
                self._held[held] = peer
        if victim is not None:
            victim.evict()
        return None

    def _oldest_waiting(self) -> Held | None:
        """The connection to evict: one waiting for its head before one idle, then one of the address that holds
        the most connections, then the oldest. By the address first: an evicted connection reopened at once evicts
        another in turn, and taken by age alone that round would come to a newcomer of another address before its
        head had arrived."""
        best: tuple[int, int] | None = None
        chosen: Held | None = None
        for held, peer in self._held.items():
            waiting = held.waiting()
            if waiting is None:
                continue
            rank = (1 if waiting == "head" else 0, self._peers[peer])
            if best is None or rank > best:  # strictly: the oldest of equals stays
                best, chosen = rank, held
        return chosen

    def _forget(self, held: Held) -> None:
        peer = self._held.pop(held)
        self.open -= 1
        self._peers[peer] -= 1
        if self._peers[peer] <= 0:
            del self._peers[peer]

    def release(self, peer: str, held: Held | None = None) -> None:
        """A connection ``admit`` counted has closed (one it evicted is not counted any more: a no-op)."""
        with self._lock:
            if held is not None:
                if held in self._held:
                    self._forget(held)
                return
            self.open -= 1
            self._peers[peer] -= 1
            if self._peers[peer] <= 0:
                del self._peers[peer]


def peer_of(address: object) -> str:
    """The address part of a socket's peer name (the host of (host, port), or '?')."""
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "?"


__all__ = ["ConnectionCap", "Held", "Waiting", "peer_of"]
