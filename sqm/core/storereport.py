"""A member's running persistent store report (seed 004's PSTORE-REPORT=YES; docs/pstore.md, "The running store
report"): one JSON line for every persistent record the member creates or deletes in normal operation.

A record is created when a unit of work that put a persistent message commits (the message is in the store from
then on), deleted when one that got a persistent message commits, or when expiry removes persistent messages. A
unit of work backed out creates and deletes nothing, and non-persistent messages are not in the store. The lines
are those of a migration's reports (backup.migrate_report) without the comparison's digest, list and position:

  {"report": "pstore", "format": 1, "member", "started"}                                   the head, once a run
  {"id", "entry", "queue", "type", "elements", "length", "date", "time", "action"}          each record

`type` is the record type by queue (cfemu.record_types); `length` is the message data's (0 for a deletion, as in
the seed's sample); `action` is `created` or `deleted`. Where the report goes: ``sqm run --pstore-report-file F``
(the seed's ``-p``), else $CFEMU_PSTORE_REPORT (its ETB_PSTORE_REPORT), else PSTORE.REPORT in the current directory.
Each line is written and flushed when its unit of work's outcome is applied; a run appends to the file (0600)."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cfemu.private_files import open_private
from cfemu.record_types import record_type
from sqm.core.records import Record
from sqm.core.uow import UnitOfWork

REPORT_ENV = "CFEMU_PSTORE_REPORT"
DEFAULT_NAME = "PSTORE.REPORT"
CREATED, DELETED = "created", "deleted"


def report_path(file: str | os.PathLike[str] | None, env: Mapping[str, str] = os.environ) -> Path:
    """The report's file: the flag's, else the environment's, else PSTORE.REPORT in the current directory."""
    return Path(file or env.get(REPORT_ENV) or DEFAULT_NAME)


def _when() -> dict[str, str]:
    now = datetime.now(UTC)
    return {"date": f"{now:%Y-%m-%d}", "time": f"{now:%H:%M:%S}.{now.microsecond // 1000:03d}"}


def _line(entry_id: str, queue: str, correlid: str, length: int, action: str) -> dict[str, Any]:
    return {"id": entry_id, "entry": entry_id, "queue": queue, "type": record_type(queue, correlid), "elements": 1,
            "length": length, "action": action}


class StoreReportError(PermissionError):
    """The report's path is not a file of this user's own to append to."""


def _open_own(path: Path) -> int:
    """The report opened for appending, created 0600 if missing. The report names every persistent message's id
    and queue, and its default place is the current directory, which may be one others write (/tmp): a symbolic
    link planted there would have the member append to a file of the link's choosing, and a file planted there
    would hand the lines to its owner. Both are refused, naming the path."""
    try:
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreReportError(f"the store report {path} is a symbolic link: refusing to follow it (name the "
                                   "file itself)") from None
        if e.errno == errno.ENXIO:  # a FIFO no one reads (opened without waiting for one)
            raise StoreReportError(f"the store report {path} is not a regular file: refusing to append to it"
                                   ) from None
        raise
    st = os.fstat(fd)
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.geteuid() else "")
    if why:
        os.close(fd)
        raise StoreReportError(f"the store report {path} {why}: refusing to append to it")
    os.set_blocking(fd, True)
    return fd


class StoreReport:
    """The open report of one member's run."""

    def __init__(self, path: Path, member: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = os.fdopen(_open_own(path), "a", encoding="utf-8")
        self._write({"report": "pstore", "format": 1, "member": member, **_when()})

    def _write(self, line: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(line, sort_keys=True) + "\n")
            self._file.flush()

    def note(self, uow: UnitOfWork, record: Record) -> None:
        """A persistent PUT or GET record of the unit of work: reported if and when it commits."""
        if record["k"] == "PUT":
            e = record["e"]
            uow.store_notes.append(_line(str(e["id"]), str(e["q"]), str(e.get("cid") or ""), len(record["d"]),
                                         CREATED))
        elif record["k"] == "GET":
            uow.store_notes.append(_line(str(record["i"]), str(record["q"]), "", 0, DELETED))

    def outcome(self, uow: UnitOfWork, committed: bool) -> None:
        """The unit of work's outcome is applied: what it created and deleted is reported when it committed."""
        notes, uow.store_notes = uow.store_notes, []
        if committed:
            for line in notes:
                self._write({**line, **_when()})

    def expired(self, ids: list[str]) -> None:
        for entry_id in ids:
            self._write({**_line(entry_id, "", "", 0, DELETED), **_when()})

    def close(self) -> None:
        with self._lock:
            self._file.close()


__all__ = ["CREATED", "DEFAULT_NAME", "DELETED", "REPORT_ENV", "StoreReport", "report_path"]
