"""The reports of a store migration (EntireX's PSTORE-REPORT): one JSON line per record unloaded or loaded, signed
with the group's backup key, and their comparison.

A report is a JSON lines file:

  line 1     the head: {"report": "unload" | "load", "format", "migration", "structure", "group", "cf", "started"}
  lines 2..  one record each: {"entry", "id", "queue", "type", "elements", "length", "digest", "list", "pos",
             "date", "time", "action"}
  last line  the trailer: {"end": {"records": N, "sha256": of every byte above it, "signature": {alg, key, mac}}}

Records are written as the work goes (a line per entry once it is unloaded, or once the target holds it), so a
report whose process was killed midway has no trailer: ``read_report`` says the unload or load did not finish. The
trailer's MAC (HMAC-SHA256 with the group's backup key over the lines' digest and count, as backup manifests are
signed: backup/files.py, cfemu/credentials.py) makes an altered report fail: a line changed, added or removed, or a
trailer rewritten by someone without the key.

Record types (EntireX's Record Type): ``message`` (an entry of a plain queue, or of a service's ``.UOWDATA``),
``uow-status`` (an entry of a service's ``.UOWCTL``: identifier = the UOW id, elements = its messages), ``uow-last``
(a user's SYNCPOINT LAST pointer on ``.UOWCTL``, correlation id ``L``: identifier = the UOW it points to),
``conversation`` (a conversation's record on ``.UOWCTL``, correlation id ``V``: identifier = the conversation id,
elements = its active UOWs),
``publication`` (``<T>.PUB``), ``subscription`` (``<T>.SUB``) and ``definition`` (the structure and each queue).
``digest`` is the SHA-256 of the record's content (the descriptor in its normal form, then the data; a definition's
canonical JSON with its structure name left out, so that a load under another name compares equal): two reports
that agree record for record on entry, type, list, position and digest prove the target holds what the source held.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import msgpack

from backup.files import SIGNATURE_ALG, canonical_json, resolve_keys, signing_key
from cfemu.credentials import BackupKeys, key_id
from cfemu.entry import Entry
from cfemu.private_files import open_private
from cfemu.record_types import (  # shared with a member's running report
    CONVERSATION,
    DEFINITION,
    UOW_LAST,
    UOW_STATUS,
    record_type,
)

REPORT_FORMAT = 1
_MAC_CONTEXT = b"cfemu migration report v1\n"  # what the MAC is of: only a report's trailer, never another message
UNLOADED, LOADED, CREATED, DELETED = "unloaded", "loaded", "created", "deleted"
_COMPARED = ("queue", "type", "id", "elements", "length", "digest", "list", "pos")  # what must agree per record


class ReportError(ValueError):
    """A report that cannot be trusted or read; the message is one line naming the file and the problem."""


class PartialReportError(ReportError):
    """No trailer: the unload or load that wrote it did not finish (killed midway, or failed)."""


class TamperedReportError(ReportError):
    """The lines do not match the trailer's digest or count, or the trailer's signature does not match."""


def normal_wire(wire: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """A descriptor in the one form both sides compute it from: the Entry fields, the data's length."""
    d = Entry.from_wire(dict(wire)).wire()
    d["len"] = len(data)
    return d


def entry_digest(wire: Mapping[str, Any], data: bytes) -> str:
    return hashlib.sha256(canonical_json(normal_wire(wire, data)) + b"\0" + data).hexdigest()


def entry_record(wire: Mapping[str, Any], data: bytes, *, list_name: str, pos: int, action: str) -> dict[str, Any]:
    """The report record of one CF entry (wire form as read from a CF, its data) at position pos of list_name."""
    queue = str(wire["q"])
    kind = record_type(queue, str(wire.get("cid") or ""))
    ident, elements = str(wire["id"]), 1
    if kind in (UOW_STATUS, UOW_LAST, CONVERSATION):  # the body: a Control (uow, messages, ...), {uow, at}, or a
        # conversation's record (conversation, active, ...): sqm.conversations.uowstatus, .convrecord
        try:
            control = msgpack.unpackb(data, raw=False)
            ident = str(control.get("uow") or control.get("conversation") or ident)
            elements = int(control.get("messages") or control.get("active") or 0)
        except (ValueError, TypeError, AttributeError, msgpack.UnpackException):
            pass  # reported under the entry id; the digest still covers its bytes
    return {"entry": str(wire["id"]), "id": ident, "queue": queue, "type": kind, "elements": elements,
            "length": len(data), "digest": entry_digest(wire, data), "list": list_name, "pos": pos,
            **_when(), "action": action}


def definition_record(kind: str, name: str, definition: Mapping[str, Any], *, action: str) -> dict[str, Any]:
    """The report record of a definition (kind "structure" or "queue"), with the structure's name left out of the
    digest (a structure def's name, a queue def's structure) so that a load under another name compares equal."""
    dropped = "name" if kind == "structure" else "structure"
    raw = canonical_json({k: v for k, v in definition.items() if k != dropped})
    queue = name if kind == "queue" else ""
    return {"entry": f"{kind}:{queue}", "id": queue or "structure", "name": name, "queue": queue, "type": DEFINITION, "elements": 1, "length": len(raw), "digest": hashlib.sha256(raw).hexdigest(),
            "list": kind, "pos": 0, **_when(), "action": action}


def _when() -> dict[str, str]:
    now = datetime.now(UTC)
    return {"date": f"{now:%Y-%m-%d}", "time": f"{now:%H:%M:%S}.{now.microsecond // 1000:03d}"}


def _trailer_mac(key: bytes, head: bytes, records: int, sha: str) -> str:
    body = canonical_json({"head": hashlib.sha256(head).hexdigest(), "records": records, "sha256": sha})
    return hmac.new(key, _MAC_CONTEXT + body, hashlib.sha256).hexdigest()


class ReportWriter:
    """Writes one report, line by line (each line flushed: a killed process leaves what it reported, no trailer);
    close() writes the signed trailer and fsyncs."""

    def __init__(self, path: Path, head: Mapping[str, Any], *, backup_keys: BackupKeys | None = None) -> None:
        self._key = signing_key(backup_keys, "sign the migration report with")
        self.path = Path(path)
        fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self._file: IO[bytes] = os.fdopen(fd, "wb")
        self._sha = hashlib.sha256()
        self.records = 0
        self._head = self._line({"format": REPORT_FORMAT, **head})

    def _line(self, obj: Mapping[str, Any]) -> bytes:
        raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        self._sha.update(raw)
        self._file.write(raw)
        return raw

    def add(self, record: Mapping[str, Any]) -> None:
        self._line(record)
        self.records += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> str:
        """The trailer, signed; returns the digest of the lines."""
        sha = self._sha.hexdigest()
        trailer = {"end": {"records": self.records, "sha256": sha, "signature": {
            "alg": SIGNATURE_ALG, "key": key_id(self._key), "mac": _trailer_mac(self._key, self._head,
                                                                              self.records, sha)}}}
        self._file.write(json.dumps(trailer, sort_keys=True, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return sha

    def abandon(self) -> None:
        """A failed unload or load: the report stays as written, without a trailer (it shows how far it got). Never
        raises: the failure that abandons it (a full disk, which fails this flush too) is what its caller reports,
        and the caller's cleanup goes on after it."""
        try:
            self._file.flush()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._file.close()  # closes the file even when its own flush fails


@dataclass
class Report:
    path: Path
    head: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    sha256: str = ""


def read_report(path: str | Path, *, backup_keys: BackupKeys | None = None) -> Report:
    """The report at `path`, checked: complete (its trailer), unaltered (digest, count, the group's signature)."""
    path = Path(path)
    keys = resolve_keys(backup_keys)
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such report") from None
    if not raw_lines:
        raise PartialReportError(f"{path}: empty report: the unload or load wrote nothing (killed at its start?)")
    try:
        parsed = [json.loads(line) for line in raw_lines]
    except ValueError as e:
        raise TamperedReportError(f"{path}: a line is not JSON ({e}): damaged or altered") from None
    head, last = parsed[0], parsed[-1]
    if not isinstance(head, dict) or "report" not in head:
        raise ReportError(f"{path}: not a migration report (no head line)")
    if head.get("format") != REPORT_FORMAT:
        raise ReportError(f"{path}: report format {head.get('format')!r} is not supported (this tool reads "
                          f"{REPORT_FORMAT})")
    if len(parsed) < 2 or not isinstance(last, dict) or "end" not in last:
        raise PartialReportError(f"{path}: the {head.get('report')} report ends after {len(parsed) - 1} records "
                                 "without its trailer: the {0} did not finish (killed midway, or failed)"
                                 .format(head.get("report")))
    end = last["end"]
    body = b"".join(raw_lines[:-1])
    sha = hashlib.sha256(body).hexdigest()
    records = [r for r in parsed[1:-1] if isinstance(r, dict)]
    if sha != end.get("sha256") or len(records) != end.get("records") or len(records) != len(parsed) - 2:
        raise TamperedReportError(f"{path}: the report's lines do not match its trailer ({len(records)} records, "
                                  f"the trailer says {end.get('records')}; digest {'matches' if sha == end.get('sha256') else 'differs'}): "
                                  "altered after it was written")
    sig = end.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != SIGNATURE_ALG:
        raise TamperedReportError(f"{path}: the report's trailer carries no {SIGNATURE_ALG} signature: refused")
    key = keys.find(str(sig.get("key")))
    if key is None:
        raise TamperedReportError(f"{path}: signed with a key this process does not hold (key id {sig.get('key')}; "
                                  f"held: {', '.join(key_id(k) for k in keys.checking()) or 'none'}): another "
                                  "group's report? pass its secrets directory (--keys-dir)")
    if not hmac.compare_digest(_trailer_mac(key, raw_lines[0], len(records), sha), str(sig.get("mac"))):
        raise TamperedReportError(f"{path}: the trailer's signature does not match: the report was altered after it "
                                  "was signed")
    return Report(path, head, records, sha)


@dataclass
class Comparison:
    """What compare found: `differences` empty means the target holds exactly what the source held."""

    unloaded: int
    loaded: int
    by_type: dict[str, list[int]]  # type -> [unloaded, loaded]
    differences: list[str]

    @property
    def equal(self) -> bool:
        return not self.differences

    def to_dict(self) -> dict[str, Any]:
        return {"equal": self.equal, "unloaded": self.unloaded, "loaded": self.loaded,
                "by_type": {k: {"unloaded": v[0], "loaded": v[1]} for k, v in sorted(self.by_type.items())},
                "differences": self.differences}


def compare(unload: Report, load: Report, *, limit: int = 1000) -> Comparison:
    """Record by record: every unloaded record loaded with the same content at the same place, nothing more. The
    two must be of the same migration. Each difference is one line naming the record and what differs."""
    diffs: list[str] = []
    if unload.head.get("report") != "unload":
        diffs.append(f"{unload.path} is a {unload.head.get('report')} report, not an unload report")
    if load.head.get("report") != "load":
        diffs.append(f"{load.path} is a {load.head.get('report')} report, not a load report")
    if unload.head.get("migration") != load.head.get("migration"):
        diffs.append(f"the reports are of different migrations ({unload.head.get('migration')} unloaded, "
                     f"{load.head.get('migration')} loaded)")
    src = {r["entry"]: r for r in unload.records}
    dst = {r["entry"]: r for r in load.records}
    by_type: dict[str, list[int]] = {}
    for r in unload.records:
        by_type.setdefault(r["type"], [0, 0])[0] += 1
    for r in load.records:
        by_type.setdefault(r["type"], [0, 0])[1] += 1
    for entry, r in src.items():
        other = dst.get(entry)
        if other is None:
            diffs.append(f"{r['type']} {r['id']} (entry {entry}, queue {r['queue']}) was unloaded and not loaded")
            continue
        for name in _COMPARED:
            if r.get(name) != other.get(name):
                diffs.append(f"{r['type']} {r['id']} (entry {entry}): {name} {r.get(name)!r} unloaded, "
                             f"{other.get(name)!r} loaded")
    for entry, r in dst.items():
        if entry not in src:
            diffs.append(f"{r['type']} {r['id']} (entry {entry}, queue {r['queue']}) was loaded but never unloaded")
    if len(diffs) > limit:
        diffs = [*diffs[:limit], f"... and {len(diffs) - limit} more differences"]
    return Comparison(len(unload.records), len(load.records), by_type, diffs)


def iter_records(report: Report) -> Iterator[dict[str, Any]]:
    yield from report.records
