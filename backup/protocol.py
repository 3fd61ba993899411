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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgpack

from backup.files import BackupWriter
from cfemu import bulk
from cfemu.bulk import Wire
from cfemu.cf import Structure

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
    seconds: float = 0.0  # how long the step took, its snapshot and copies (the scheduler's phase histograms)


# The descriptor's "per" key as every writer of the CF's descriptors encodes it (a fixstr: Entry.pack, and the Lua
# scripts' cmsgpack, which re-encode the whole table), followed by its value.
_PER_KEY = msgpack.packb("per", use_bin_type=False)
_PERSISTENT = 1


def _persistent_at_sight(raw: bytes) -> bool:
    """True when the raw descriptor is, without decoding it, surely a persistent one: "per" occurs once, and is
    followed by 1. That one occurrence is the key itself when the key is there (its value right behind it), and
    when the key is not there the entry counts as persistent anyway (Entry's default). Anything else (the bytes
    inside a string or a property name as well, a 0, another encoding) answers False: the caller decodes."""
    i = raw.find(_PER_KEY)
    return (i >= 0 and len(raw) > i + 4 and raw[i + 4] == _PERSISTENT
            and raw.find(_PER_KEY, i + 4) < 0)


def _decider(count: StepCount, keep: Callable[[Wire], bool] | None) -> Callable[[bytes], bool]:
    """Whether a present descriptor not taken at sight is copied: decoded, persistent, and accepted by `keep`;
    what it leaves out is counted in `count`."""
    def decide(raw: bytes) -> bool:
        wire = bulk.unpack_wire(raw)
        if wire.get("per", 1) != 1:
            count.skipped_nonpersistent += 1
            return False
        if keep is not None and not keep(wire):
            count.excluded += 1
            return False
        return True

    return decide


def select_raw(count: StepCount, descs: list[bytes | None], datas: Sequence[bytes | None],
               keep: Callable[[Wire], bool] | None = None) -> list[tuple[bytes, bytes]]:
    """The copies one fetched batch keeps: present (not gone since the snapshot), persistent, and accepted by
    `keep`, counted in `count`, with each descriptor as the CF's bytes: a persistent descriptor is seen at sight
    (_persistent_at_sight) and not decoded; any other is decoded, and every one is when `keep` must look at it
    (EXCLINT). The reference of backup/_frames.c's select_append (write_part)."""
    out: list[tuple[bytes, bytes]] = []
    append = out.append
    at_sight = _persistent_at_sight if keep is None else None
    decide = _decider(count, keep)
    nbytes = 0
    for raw, data in zip(descs, datas, strict=True):
        if raw is None or data is None:
            count.vanished += 1
            continue
        if (at_sight is None or not at_sight(raw)) and not decide(raw):
            continue
        append((raw, data))
        nbytes += len(data)
    count.copied += len(out)
    count.bytes += nbytes
    return out


def write_part(writer: BackupWriter, step: int, count: StepCount, descs: list[bytes | None],
               datas: Sequence[bytes | None], keep: Callable[[Wire], bool] | None = None) -> None:
    """One fetched part's copies (as select_raw selects them, counted in `count`) written by `writer` as frames
    of `step`: selected and framed in one pass in C where backup._frames was built (BackupWriter.add_selected: no
    Python object made per entry copied), else select_raw then add_raw. Both write the same bytes
    (tests/backup/test_frames_native.py)."""
    if not writer.selects_natively:
        writer.add_raw(step, select_raw(count, descs, datas, keep))
        return
    copied, nbytes, vanished = writer.add_selected(step, descs, datas, _decider(count, keep), at_sight=keep is None)
    count.copied += copied
    count.bytes += nbytes
    count.vanished += vanished


def copy_step_raw(structure: Structure, state: str, count: StepCount, batch: int = 2000,
                  keep: Callable[[Wire], bool] | None = None, before_read: Callable[[], None] | None = None,
                  depth: Callable[[], int] | None = None) -> Iterator[list[tuple[bytes, bytes]]]:
    """Snapshot the ids of every entry in `state`, then yield, batch by batch, the current copy of each persistent
    one (of each one `keep` accepts, when given; select_raw), its descriptor as the CF's msgpack bytes (which a
    backup frame holds as they are: the same map, docs/backup-format.md). before_read: the pacing hook
    (cfemu.bulk.fetch_raw); depth: how many reads may be in flight (fetch_raw; the pacer's say)."""
    for descs, datas in _fetch_step(structure, state, count, batch, before_read, depth):
        yield select_raw(count, descs, datas, keep)


def copy_step(writer: BackupWriter, step: int, structure: Structure, state: str, count: StepCount,
              batch: int | Callable[[], int] = 2000, keep: Callable[[Wire], bool] | None = None,
              before_read: Callable[[], None] | None = None,
              depth: Callable[[], int] | None = None) -> Iterator[None]:
    """copy_step_raw's copies written by `writer` as frames of `step`, part by part as they are fetched
    (write_part); yields after each part (the caller's progress and checks). batch: ids a read, or a function
    asked before each read (cfemu.bulk.fetch_raw; the pacer's say)."""
    for descs, datas in _fetch_step(structure, state, count, batch, before_read, depth):
        write_part(writer, step, count, descs, datas, keep)
        yield


def _fetch_step(structure: Structure, state: str, count: StepCount, batch: int | Callable[[], int],
                before_read: Callable[[], None] | None,
                depth: Callable[[], int] | None) -> Iterator[tuple[list[bytes | None], Sequence[bytes | None]]]:
    """The step's snapshot (counted), then its entries' raw descriptors and data, part by part."""
    ids = structure.snapshot_raw(state)
    count.snapshot += len(ids)
    yield from bulk.fetch_raw(structure.cf.redis, structure.name, ids, batch, before_read=before_read,
                              depth=depth or bulk.FETCH_DEPTH)
