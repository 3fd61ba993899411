"""Damage done to a log on disk, as a bad copy or a host crash would do it."""

from __future__ import annotations

from pathlib import Path

from sqm.log.format import FRAME, read_header


def cut_at_a_frame_boundary(path: Path) -> int:
    """Remove the second half of the segment's frames, whole: the file still ends at a frame boundary."""
    with open(path, "rb") as f:
        header = read_header(f, path, allow_partial=False)
    assert header is not None
    data = path.read_bytes()
    off, bounds = header.length, []
    while off + FRAME.size <= len(data):
        length, _ = FRAME.unpack_from(data, off)
        off += FRAME.size + length
        bounds.append(off)
    assert len(bounds) >= 4
    cut = bounds[len(bounds) // 2 - 1]
    with open(path, "r+b") as f:
        f.truncate(cut)
    return cut
