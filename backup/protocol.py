"""The fuzzy backup protocol of US 6,948,093: copy a structure's persistent messages grouped by state, in the
patent's order, while the group keeps working.

  0 begin: mark the backup running in the CF and set the recovery floor (replay start)
  1 uncommitted gets (a first pass: closes the window of a get that began before the backup and is backed out
    after step 3)
  2 uncommitted puts
  3 committed puts
  4 uncommitted gets
  5 expired messages
  6 end: clear the running mark

Each step's membership is a true snapshot (cfemu/scripts/snapshot.lua takes every id in one atomic script);
the descriptors and data are fetched afterwards in pipelined batches (cfemu.bulk), and an entry that changed or
vanished meanwhile is copied as it is then (or skipped): any copy taken during the backup is consistent under
the redo rule. The only log record the backup causes is the patent's exception: a get backed out while the
backup runs carries its data in the BACKOUT record (enforced by cfemu/scripts/backout.lua).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from cfemu import bulk
from cfemu.bulk import Wire
from cfemu.cf import Structure
from cfemu.entry import Entry

T = TypeVar("T")

STEPS: tuple[tuple[str, str], ...] = (
    ("UG", "uncommitted gets (first pass)"),
    ("UP", "uncommitted puts"),
    ("CP", "committed puts"),
    ("UG", "uncommitted gets"),
    ("EX", "expired messages"),
)


@dataclass
class StepCount:
    snapshot: int = 0  # ids in the step's snapshot
    copied: int = 0  # persistent entries copied
    skipped_nonpersistent: int = 0
    vanished: int = 0  # gone between snapshot and fetch (its later history is in the log)
    excluded: int = 0  # persistent entries left out by the caller's `keep` test (EXCLINT: the log has them)
    bytes: int = 0


def _select(count: StepCount, fetched: Iterable[tuple[T | None, bytes | None]], persistent: Callable[[T], bool],
            keep: Callable[[T], bool] | None) -> Iterator[tuple[T, bytes]]:
    """The copies a step keeps: present (not gone since the snapshot), persistent, and accepted by `keep`."""
    for item, data in fetched:
        if item is None or data is None:
            count.vanished += 1
            continue
        if not persistent(item):
            count.skipped_nonpersistent += 1
            continue
        if keep is not None and not keep(item):
            count.excluded += 1
            continue
        count.copied += 1
        count.bytes += len(data)
        yield item, data


def copy_step(structure: Structure, state: str, count: StepCount, batch: int = 2000,
              keep: Callable[[Entry], bool] | None = None) -> Iterator[tuple[Entry, bytes]]:
    """Snapshot the ids of every entry in `state`, then yield the current copy of each persistent one
    (of each one `keep` accepts, when given)."""
    ids = structure.snapshot(state)
    count.snapshot += len(ids)
    yield from _select(count, ((e, d) for _, e, d in structure.fetch(ids, batch=batch)),
                       lambda e: e.persistent, keep)


def copy_step_wire(structure: Structure, state: str, count: StepCount, batch: int = 2000,
                   keep: Callable[[Wire], bool] | None = None) -> Iterator[tuple[Wire, bytes]]:
    """copy_step with descriptors in wire form (cfemu.entry.Entry.wire()), the form a backup stores."""
    ids = structure.snapshot(state)
    count.snapshot += len(ids)
    yield from _select(count, bulk.fetch_wire(structure.cf.redis, structure.name, ids, batch),
                       lambda w: w.get("per", 1) == 1, keep)
