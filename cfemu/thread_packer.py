"""msgpack packing by a Packer kept per thread: ``msgpack.packb`` makes and frees a Packer at every call, which
costs about as much again as packing a small map (a log record, a service reply: several per message).

A Packer keeps its buffer at the longest output it made, so one that packed a large object (a 100 MiB message)
is not kept past it: the thread would hold that memory for as long as it lives, outside every budget.

A Packer packs into its one buffer and hands out what the buffer holds, so a pack nested in another on the same
Packer (Python code run while it packs: a finalizer the garbage collector runs when packing a dict subclass
allocates, a signal handler run by that code) would hand out the outer object's bytes so far with its own, and the
outer one would lose them: two records that differ from what was asked. The thread's Packer is taken while it packs.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

KEEP_BELOW = 1 << 20  # a Packer whose output was longer is dropped with it, and the next call makes a new one
_local = threading.local()


def pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)``, by the calling thread's Packer."""
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=True)
    else:  # taken while it packs: a pack nested in this one makes its own (see the module's docstring)
        _local.packer = None
    body = packer.pack(obj)  # a value it cannot pack raises (the Packer is then not kept)
    if len(body) <= KEEP_BELOW:
        _local.packer = packer
    return body


def kept() -> bool:
    """Whether the calling thread keeps a Packer now."""
    return getattr(_local, "packer", None) is not None


__all__ = ["KEEP_BELOW", "kept", "pack"]
