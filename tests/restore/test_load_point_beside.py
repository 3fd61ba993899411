"""The restore point's copies written beside the load (restore.load.Beside): the CF is sent the next batch while
the point frames and checksums the one before; every batch is written, in order; a failure of either side stops
the other."""

from __future__ import annotations

import threading
import time

import pytest

from restore.load import Beside

Copies = list[tuple[bytes, bytes]]


def batch(k: int) -> Copies:
    return [(f"desc-{k}".encode(), f"data-{k}".encode())]


def test_the_next_batch_is_handed_over_while_the_point_still_writes_the_one_before() -> None:
    """The writer is held inside batch 0: handing over batch 1 does not wait for it (the loading thread goes on
    to send batch 2 meanwhile). In the loading thread, as before, batch 1 could not be sent until batch 0's copies
    were written: the CF idled for that time."""
    release = threading.Event()
    written: list[Copies] = []

    def write(copies: Copies) -> None:
        release.wait(10)
        written.append(copies)

    with Beside(write) as point:
        point.put(batch(0))
        t0 = time.monotonic()
        point.put(batch(1))
        assert time.monotonic() - t0 < 1.0
        assert written == []  # batch 0 is still being written
        release.set()
        point.put(batch(2))
    assert written == [batch(0), batch(1), batch(2)]  # all of them, in order, once the `with` is left
    assert not point.thread.is_alive()


def test_the_point_is_at_most_one_batch_behind_so_its_memory_stays_bounded() -> None:
    """One batch being written and one waiting: the third hand-over waits for the writer (batch_bytes_for counts
    the copies of two batches for the restore point)."""
    release = threading.Event()
    with Beside(lambda copies: release.wait(10)) as point:
        point.put(batch(0))
        time.sleep(0.1)  # the writer took batch 0
        point.put(batch(1))
        blocked = threading.Thread(target=point.put, args=(batch(2),), daemon=True)
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive()
        release.set()
        blocked.join(5)
        assert not blocked.is_alive()


def test_a_failed_point_stops_the_load_at_its_next_batch() -> None:
    def write(copies: Copies) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"), Beside(write) as point:
        point.put(batch(0))
        deadline = time.monotonic() + 5
        while point.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        point.put(batch(1))
        pytest.fail("the load went on after the point failed")


def test_a_failure_of_the_last_batch_is_raised_when_the_load_ends() -> None:
    def write(copies: Copies) -> None:
        if copies == batch(1):
            raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"), Beside(write) as point:
        point.put(batch(0))
        point.put(batch(1))


def test_a_load_that_fails_leaves_without_writing_what_is_still_pending() -> None:
    """The load stops (NotOwnerError, say): the thread ends without writing the batches still handed over, and
    the restore point is aborted by its caller."""
    release = threading.Event()
    written: list[Copies] = []

    def write(copies: Copies) -> None:
        release.wait(10)
        written.append(copies)

    with pytest.raises(RuntimeError, match="taken over"), Beside(write) as point:
        point.put(batch(0))
        time.sleep(0.1)
        point.put(batch(1))
        threading.Timer(0.2, release.set).start()
        raise RuntimeError("taken over")
    assert not point.thread.is_alive()
    assert written == [batch(0)]
