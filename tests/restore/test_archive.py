"""restore.archive: closed log segments as Parquet, idempotent archiving, and the audit query."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from cfemu.entry import Entry
from restore.archive import SCHEMA, archive_logs, audit_message
from restore.cli import main as cfrestore
from sqm.core import records
from sqm.core.records import entry_ids
from sqm.log import LogCorruptError, LogReader, RecordLog

SEGMENT = 700  # bytes: a few records per segment


def _put(lrsn: int, uow: str, eid: str, queue: str = "Q1", structure: str = "APP1") -> dict[str, Any]:
    return records.put(uow, lrsn, structure=structure, gen=0, entry=Entry(id=eid, queue=queue).wire(),
                       data=os.urandom(8))


def _journey(logs: Path) -> None:
    """Message X: put on QM1 and committed; got on QM2 and backed out; got on QM1 and committed. Other traffic
    (message Y, another structure) around it."""
    qm1 = RecordLog(logs / "QM1", "QM1", segment_bytes=SEGMENT)
    qm2 = RecordLog(logs / "QM2", "QM2", segment_bytes=SEGMENT)
    qm1.append(_put(10, "QM1.1.1", "X"))
    qm1.append(_put(11, "QM1.1.1", "Y"))
    qm1.append(records.commit("QM1.1.1", 12, {"APP1": 0}))
    qm1.append(records.end("QM1.1.1", 13))
    qm2.append(records.get("QM2.1.1", 20, structure="APP1", gen=0, entry_id="X", queue="Q1"))
    qm2.append(records.backout("QM2.1.1", 21, {"APP1": 0}))
    qm2.append(records.end("QM2.1.1", 22))
    qm2.append(_put(23, "QM2.1.2", "Z", structure="APP2"))
    qm2.append(records.commit("QM2.1.2", 24, {"APP2": 0}))
    qm1.append(records.get("QM1.1.2", 30, structure="APP1", gen=0, entry_id="X", queue="Q1"))
    qm1.append(records.commit("QM1.1.2", 31, {"APP1": 0}))
    qm1.append(records.end("QM1.1.2", 32))
    for _ in range(20):  # roll both logs on so that the records above sit in closed segments
        qm1.append(records.end("QM1.1.9", 40))
        qm2.append(records.end("QM2.1.9", 40))
    qm1.close()
    qm2.close()


def test_closed_segments_become_parquet_files_with_every_record(tmp_path: Path) -> None:
    _journey(tmp_path / "logs")
    result = archive_logs(tmp_path / "logs", tmp_path / "archive")
    for member in ("QM1", "QM2"):
        reader = LogReader(tmp_path / "logs" / member)
        segments = sorted((tmp_path / "logs" / member).glob("seg-*.log"))
        files = sorted((tmp_path / "archive" / member).glob("seg-*.parquet"))
        assert [f.stem for f in files] == [s.stem for s in segments[:-1]]  # the last one is still open
        rows = [row for f in files for row in pq.read_table(f).to_pylist()]
        expected = [(pos, rec) for pos, rec in reader.records() if pos.segment < len(segments)]
        assert files and len(rows) == len(expected)
        for row, (pos, rec) in zip(rows, expected):
            assert (row["lrsn"], row["member"], row["segment"], row["offset"]) == (rec["l"], member, pos.segment,
                                                                                   pos.offset)
            assert row["kind"] == rec["k"] and row["entry_ids"] == entry_ids(rec)
            assert row["uow"] == (rec.get("u") or None)
    assert pq.read_schema(files[0]) == SCHEMA
    assert result.records == sum(len(pq.read_table(p)) for p in result.archived)
    assert not list((tmp_path / "archive").rglob("*.tmp"))


def test_archiving_again_skips_what_is_archived_and_adds_newly_closed_segments(tmp_path: Path) -> None:
    _journey(tmp_path / "logs")
    first = archive_logs(tmp_path / "logs", tmp_path / "archive")
    mtimes = {p: p.stat().st_mtime_ns for p in first.archived}
    again = archive_logs(tmp_path / "logs", tmp_path / "archive")
    assert again.archived == [] and again.skipped == len(first.archived)
    assert {p: p.stat().st_mtime_ns for p in first.archived} == mtimes
    with RecordLog(tmp_path / "logs" / "QM1", "QM1", segment_bytes=SEGMENT) as log:
        for _ in range(20):
            log.append(records.end("QM1.1.10", 50))
    more = archive_logs(tmp_path / "logs", tmp_path / "archive")
    assert more.archived and all(p.parent.name == "QM1" for p in more.archived)
    assert more.skipped == len(first.archived)


def test_a_corrupt_closed_segment_is_refused_and_nothing_is_written_for_it(tmp_path: Path) -> None:
    _journey(tmp_path / "logs")
    seg = tmp_path / "logs" / "QM2" / "seg-00000001.log"
    raw = bytearray(seg.read_bytes())
    raw[-3] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with pytest.raises(LogCorruptError, match="seg-00000001.log"):
        archive_logs(tmp_path / "logs", tmp_path / "archive")
    assert not (tmp_path / "archive" / "QM2").exists() or not list((tmp_path / "archive" / "QM2").iterdir())


def test_audit_tells_where_a_message_went(tmp_path: Path) -> None:
    _journey(tmp_path / "logs")
    archive_logs(tmp_path / "logs", tmp_path / "archive")
    story = [(r["l"], r["m"], r["k"], r.get("u")) for r in audit_message(tmp_path / "archive", "X")]
    assert story == [
        (10, "QM1", "PUT", "QM1.1.1"), (12, "QM1", "COMMIT", "QM1.1.1"), (13, "QM1", "END", "QM1.1.1"),
        (20, "QM2", "GET", "QM2.1.1"), (21, "QM2", "BACKOUT", "QM2.1.1"), (22, "QM2", "END", "QM2.1.1"),
        (30, "QM1", "GET", "QM1.1.2"), (31, "QM1", "COMMIT", "QM1.1.2"), (32, "QM1", "END", "QM1.1.2"),
    ]
    assert audit_message(tmp_path / "archive", "nobody") == []


def test_cfrestore_archive_and_audit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _journey(tmp_path / "logs")
    logs, archive = str(tmp_path / "logs"), str(tmp_path / "archive")
    assert cfrestore(["archive", "--log-root", logs, "--archive-dir", archive, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["archived"] and out["skipped"] == 0
    assert cfrestore(["archive", "--log-root", logs, "--archive-dir", archive]) == 0
    assert "0 segments" in capsys.readouterr().out
    assert cfrestore(["audit", "X", "--archive-dir", archive, "--json"]) == 0
    kinds = [r["kind"] for r in json.loads(capsys.readouterr().out)]
    assert kinds == ["PUT", "COMMIT", "END", "GET", "BACKOUT", "END", "GET", "COMMIT", "END"]
    assert cfrestore(["audit", "X", "--archive-dir", archive]) == 0
    assert "get X from APP1/Q1 uow QM2.1.1" in capsys.readouterr().out


def test_cfrestore_archive_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cfrestore(["archive", "--log-root", str(tmp_path / "nothing"), "--archive-dir",
                      str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no record logs" in err
    assert not (tmp_path / "a").exists()
    assert cfrestore(["audit", "X", "--archive-dir", str(tmp_path / "a")]) == 2
    assert "no archived segments" in capsys.readouterr().err
