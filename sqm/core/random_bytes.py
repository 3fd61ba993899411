"""Random bytes for the ids a put makes (an entry's id, a message id): the kernel's CSPRNG (os.urandom), fetched a
few kilobytes at a time rather than twice per message.

Each os.urandom call is a getrandom system call, made with the GIL released: with the service's connection threads
waiting for the GIL, every such release hands the GIL to another thread and back, two context switches for 36
bytes (BENCHMARKS.md, "peers", seventh look). The bytes are the same kernel randomness, handed out once each: a
lock keeps two threads from taking the same ones, and a child process made by fork starts with none of its
parent's (they would repeat the parent's ids).
"""

from __future__ import annotations

import os
import threading

CHUNK = 4096  # bytes fetched from the kernel at once

_lock = threading.Lock()
_pool = b""
_at = 0


def random_bytes(n: int) -> bytes:
    """``n`` bytes (at most CHUNK) of the kernel's randomness, never handed out before in this process."""
    global _pool, _at
    if not 0 < n <= CHUNK:
        raise ValueError(f"random_bytes takes 1-{CHUNK} bytes at a time, not {n}")
    with _lock:
        end = _at + n
        if end > len(_pool):
            _pool, _at, end = os.urandom(CHUNK), 0, n
        out = _pool[_at:end]
        _at = end
    return out


def _forget() -> None:
    """In a child made by fork: the parent's bytes are the parent's."""
    global _pool, _at, _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _pool, _at = b"", 0


os.register_at_fork(after_in_child=_forget)

__all__ = ["CHUNK", "random_bytes"]
