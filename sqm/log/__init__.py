"""The per-queue-manager durable record log (active log + BSDS, i.e. a write-ahead log).

A log directory holds append-only segment files of checksummed msgpack frames and a ``manifest.json``
(the bootstrap data set). See docs/log-format.md.
"""

from sqm.log.format import (
    FORMAT_VERSION,
    LogCorruptError,
    LogFormatError,
    LogLockedError,
    LogPosition,
    SegmentInfo,
)
from sqm.log.reader import LogReader, find_log_dirs, holds_log, merged_records, one_log_per_member
from sqm.log.writer import (
    ArchiveOutcome,
    LogFullError,
    LogStats,
    RecordLog,
    RecordRefusedError,
    writer_is_open,
)

__all__ = [
    "ArchiveOutcome",
    "FORMAT_VERSION",
    "LogFullError",
    "RecordRefusedError",
    "LogCorruptError",
    "LogFormatError",
    "LogLockedError",
    "LogPosition",
    "LogReader",
    "LogStats",
    "RecordLog",
    "SegmentInfo",
    "find_log_dirs",
    "holds_log",
    "merged_records",
    "one_log_per_member",
    "writer_is_open",
]
