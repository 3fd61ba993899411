"""Slices of the members' logs: the shares of a restore's log scan that worker processes read side by side.

A partitioned plan (restore.partitioned) files each record by the entries and the UOW it names, and every
partition is sorted by the records' places in the merged log before it is folded, so the records may be read in
any order and by any number of readers: a slice is a run of one member's segments, read on its own (each
record tagged with its member and its place, as restore/reference.py's stream_logs does).

The slices are made before the backup is read, the logs are read after it: a member still logging meanwhile (the
re-plan after the claim of an ACTIVE structure) may start new segments, which the slice of its log's last segment
reads too, as stream_logs reads each log to its end when it gets to it. A LogCorruptError found by a worker process is
sent back as itself (it does not survive pickle on its own: the engine's caller would see a worker that stopped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqm.core.records import Record
from sqm.log import LogCorruptError, LogReader, one_log_per_member
from sqm.log.format import log_segments, read_manifest, trusted_segments

Key = tuple[Any, ...]  # a record's place in the merged log: (LRSN, member, segment, offset)


class SentCorruptError(LogCorruptError):
    """A LogCorruptError that pickles (a worker process sends it back): it arrives as the LogCorruptError it is."""

    def __reduce__(self) -> tuple[Any, ...]:
        return LogCorruptError, (self.path, self.offset, self.what)


@dataclass(frozen=True)
class _Segments:
    """The segment numbers a slice reads: its own, and when it ends its log (`to_end`) every later one."""

    own: frozenset[int]
    to_end: bool

    def __contains__(self, segno: object) -> bool:
        return segno in self.own or (self.to_end and isinstance(segno, int) and segno > max(self.own, default=-1))


@dataclass(frozen=True)
class LogSlice:
    """The segments `segments` (None: all) of the log in `directory`, from LRSN `replay_from` on; `to_end`: and
    every segment after them that the log has when it is read (the slice holds the log's last segment)."""

    directory: str
    segments: tuple[int, ...] | None
    replay_from: int
    to_end: bool = False

    def member(self) -> str:
        return LogReader(self.directory).member

    def records(self) -> Iterator[tuple[Key, Record]]:
        """Each record, tagged with its member in "m", and with its place in the merged log."""
        reader = LogReader(self.directory)
        member = reader.member
        only = None if self.segments is None else _Segments(frozenset(self.segments), self.to_end)
        try:
            for pos, rec in reader.records(min_lrsn=self.replay_from, segments=only):
                rec["m"] = member
                yield (rec["l"], member, pos.segment, pos.offset), rec
        except LogCorruptError as e:
            raise SentCorruptError(e.path, e.offset, e.what) from None


def log_slices(log_dirs: list[Path], replay_from: int, count: int) -> list[LogSlice]:
    """The segments of `log_dirs` that may hold records from `replay_from` on, in about `count` slices of like
    size (a slice never spans two logs; a log of one segment is one slice), largest first, so that readers
    taking them in turn end at about the same time."""
    segs: list[tuple[str, int, int]] = []  # (directory, segment, bytes)
    slices: list[tuple[int, LogSlice]] = []
    one_log_per_member(log_dirs)  # and a directory that is no log is refused here, as a reading of it would be
    for d in log_dirs:
        manifest = read_manifest(d)
        trusted = trusted_segments(d, manifest)
        listed = log_segments(d, manifest)
        if not listed:  # a log with no segment yet: whatever it has when it is read
            slices.append((0, LogSlice(str(d), (), replay_from, to_end=True)))
        for segno, path in listed:
            info = trusted.get(segno)
            if (segno != listed[-1][0] and info is not None and info.max_lrsn is not None
                    and info.max_lrsn < replay_from):  # as LogReader.records: the last one may still grow
                continue
            size = 0
            with contextlib.suppress(OSError):
                size = path.stat().st_size
            segs.append((str(d), segno, size))
    target = max(1, sum(s for _, _, s in segs) // max(1, count))
    run: list[int] = []
    run_dir, run_bytes = "", 0
    for directory, segno, size in [*segs, ("", -1, 0)]:  # a sentinel ends the last run
        if run and (directory != run_dir or run_bytes >= target):
            slices.append((run_bytes, LogSlice(run_dir, tuple(run), replay_from, to_end=directory != run_dir)))
            run, run_bytes = [], 0
        if segno >= 0:
            run.append(segno)
            run_dir, run_bytes = directory, run_bytes + size
    slices.sort(key=lambda s: -s[0])
    return [s for _, s in slices]
