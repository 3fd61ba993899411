"""Review of the restore load's stream (restore.load, restore.workers.Workers.stream, issue 16): a worker making
a load's batches holds no more of them than it must, and a load that fails or is stopped leaves no worker, thread
or spill file. Real processes, a real redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from restore.workers import Workers

ITEM = 48 << 20  # a load's batch of 1,000 messages of 48 KiB


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def big_items(size: int) -> Iterator[int | bytes]:
    """A worker's stream of two items of `size` bytes, then how much its peak memory grew meanwhile (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    start = _peak_kib()
    yield os.urandom(size)
    yield os.urandom(size)
    yield _peak_kib() - start


def test_a_worker_holds_an_item_and_its_frame_only_while_it_is_sent() -> None:
    """Each item of a stream is made, pickled and written, then let go. The worker held the item it had sent while
    it made the next one, and wrote each frame as a copy of its pickle joined to its header: three times an item
    (a load's batch: all its messages' data), against two (the item and its pickle)."""
    with Workers(1, processes=1) as pool:
        *items, growth_kib = pool.stream(big_items, ITEM)
    assert [len(i) for i in items] == [ITEM, ITEM]  # type: ignore[arg-type]
    assert growth_kib * 1024 < 2.5 * ITEM, f"the worker grew by {growth_kib >> 10} MiB for items of {ITEM >> 20}"
