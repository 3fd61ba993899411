"""cfemu.bulk.Bulks made from a list (what cfemu._bulk.read_bulks makes of a reply holding those strings)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cfemu.bulk import Bulks


def bulks_of(items: Sequence[bytes | None]) -> Bulks:
    """The strings (None: null) laid one after the other in a blob, each after a filler byte, so that no span
    starts at 0 as the first would in a list's own bytes."""
    blob = bytearray()
    spans: list[int] = []
    for item in items:
        blob += b"$"
        if item is None:
            spans += (0, -1)
        else:
            spans += (len(blob), len(item))
            blob += item
    return Bulks(bytes(blob), struct.pack(f"={len(spans)}q", *spans))
