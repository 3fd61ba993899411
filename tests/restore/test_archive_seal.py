"""restore.archive: each archived segment is sealed with the group's backup key, and only a file whose seal is
the group's, whose digest matches and whose segment is the log's is read (docs/spark.md, "The log archive";
docs/security.md, "The log archive").

Each test does what someone who could write the archive directory would do (the files as docs/spark.md describes
them, the same pyarrow and msgpack), and checks the readers: verified_segment, the Spark engine's choice of what
to read (_log_sources, which runs on the driver before Spark reads anything: no session needed), the audit and
`cfrestore archive`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cfemu import credentials
from cfemu.private_files import UnsafeDirectoryError
from restore.archive import ArchiveError, archive_logs, audit_message, seal_path, verified_segment
from restore.cli import main as cfrestore
from sqm.core import records
from sqm.log import LogReader, RecordLog
from sqm.log.format import read_manifest, trusted_segments
from tests.restore.test_archive import _journey

SEG1 = "seg-00000001.parquet"


@pytest.fixture
def archived(tmp_path: Path) -> Path:
    _journey(tmp_path / "logs")
    archive_logs(tmp_path / "logs", tmp_path / "archive")
    return tmp_path / "archive"


def live(logs: Path, member: str, segment: int) -> Any:
    return trusted_segments(logs / member, read_manifest(logs / member))[segment]


def forge_body(path: Path, entry_id: str, body: bytes) -> None:
    """The attack of the review's probe: a PUT's body replaced, the rows rewritten as a valid Parquet file."""
    t = pq.read_table(path)
    recs = [msgpack.unpackb(b, raw=False) for b in t.column("record").to_pylist()]
    for r in recs:
        if r["k"] == "PUT" and r["e"]["id"] == entry_id:
            r["d"] = body
    packed = pa.array([msgpack.packb(r, use_bin_type=True) for r in recs], pa.binary())
    pq.write_table(t.set_column(t.schema.get_field_index("record"), "record", packed), path)


def spark_sources(logs: Path, archive: Path) -> tuple[list[Any], list[str]]:
    pytest.importorskip("pyspark")
    from restore.engine_spark import SparkEngine

    return SparkEngine(archive_dir=archive)._log_sources([logs / "QM1", logs / "QM2"], 0)


def test_every_archived_segment_is_sealed_and_verifies(archived: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    files = sorted(archived.glob("*/seg-*.parquet"))
    assert files
    for f in files:
        seal = json.loads(seal_path(f).read_text())
        segment = int(f.stem.removeprefix("seg-"))
        info = live(logs, f.parent.name, segment)
        assert seal["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and seal["size"] == f.stat().st_size
        assert (seal["min_lrsn"], seal["max_lrsn"], seal["records"]) == (info.min_lrsn, info.max_lrsn, info.records)
        assert seal["signature"]["alg"] == "hmac-sha256"
        assert verified_segment(archived, f.parent.name, segment, info) == f
        assert f.stat().st_mode & 0o777 == 0o600 and seal_path(f).stat().st_mode & 0o777 == 0o600
    assert (archived / "QM1").stat().st_mode & 0o777 == 0o700
    _, read = spark_sources(logs, archived)
    assert sorted(read) == [str(f) for f in files]  # the genuine archive is read in place of the segments


def test_a_forged_archived_segment_is_refused_by_every_reader(archived: Path, tmp_path: Path) -> None:
    path = archived / "QM1" / SEG1
    forge_body(path, "X", b"FORGED")
    with pytest.raises(ArchiveError, match=f"{path}: not the file that was archived"):
        verified_segment(archived, "QM1", 1)
    with pytest.raises(ArchiveError, match=f"{path}: not the file that was archived"):
        spark_sources(tmp_path / "logs", archived)
    with pytest.raises(ArchiveError, match=f"{path}: not the file that was archived"):
        audit_message(archived, "X")


def test_a_seal_recomputed_without_the_key_is_refused(archived: Path) -> None:
    path = archived / "QM1" / SEG1
    forge_body(path, "X", b"FORGED")
    seal = json.loads(seal_path(path).read_text())
    seal.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), size=path.stat().st_size)
    seal_path(path).write_text(json.dumps(seal))
    with pytest.raises(ArchiveError, match="its seal's signature does not match"):
        verified_segment(archived, "QM1", 1)


@pytest.mark.parametrize("plant", ["huge", "link"])
def test_a_planted_huge_seal_or_a_link_in_its_place_is_refused_unread(archived: Path, tmp_path: Path,
                                                                       plant: str) -> None:
    """A seal is a few hundred bytes: a planted one of a gigabyte (sparse: no disk spent) is refused by its size
    before it is read, and a link in a seal's place (which may lead to a device or a FIFO) is never followed."""
    seal = seal_path(archived / "QM1" / SEG1)
    seal.unlink()
    if plant == "huge":
        with open(seal, "wb") as f:
            f.truncate(1 << 30)
        why = "more than the 65536 it can be"
    else:
        target = tmp_path / "elsewhere.json"
        target.write_text("{}")
        seal.symlink_to(target)
        why = "symbolic link"
    with pytest.raises(ArchiveError, match=why) as e:
        verified_segment(archived, "QM1", 1)
    assert "\n" not in str(e.value) and "cfrestore archive" in str(e.value)


def test_a_seal_made_with_another_groups_key_is_refused(archived: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-secrets"
    credentials.create_backup_key(other)
    other_keys = credentials.backup_keys(other)
    path = archived / "QM1" / SEG1
    seal_path(path).unlink()
    path.unlink()
    archive_logs(tmp_path / "logs", archived, backup_keys=other_keys)  # rewrites the one segment, under that key
    with pytest.raises(ArchiveError, match=f"{path}: its seal is not signed with a backup key of this group"):
        verified_segment(archived, "QM1", 1)
    assert verified_segment(archived, "QM1", 1, backup_keys=other_keys) == path


def test_a_seal_moved_to_another_segment_is_refused(archived: Path) -> None:
    """Another genuine, sealed segment put in a segment's place with its seal: another member's, or this member's
    under another number."""
    src = archived / "QM2" / SEG1
    for member, segment in (("QM1", 1), ("QM2", 7)):
        target = archived / member / f"seg-{segment:08d}.parquet"
        shutil.copy(src, target)
        shutil.copy(seal_path(src), seal_path(target))
        with pytest.raises(ArchiveError, match=f"{target}: its seal is for QM2's segment 1"):
            verified_segment(archived, member, segment)


def test_an_archive_from_before_seals_is_refused_in_one_line_and_archived_anew(
        archived: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for seal in archived.glob("*/*.seal"):
        seal.unlink()
    path = archived / "QM1" / SEG1
    with pytest.raises(ArchiveError, match=f"{path}: no seal .*run 'cfrestore archive' again to re-archive it"):
        spark_sources(tmp_path / "logs", archived)
    with pytest.raises(ArchiveError, match="no seal"):
        audit_message(archived, "X")
    assert cfrestore(["audit", "X", "--archive-dir", str(archived)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no seal" in err and "Traceback" not in err
    again = archive_logs(tmp_path / "logs", archived)
    assert again.skipped == 0 and again.archived  # every file without its seal written anew, sealed
    assert verified_segment(archived, "QM1", 1) == path
    assert [r["k"] for r in audit_message(archived, "X")][:3] == ["PUT", "COMMIT", "END"]


def test_a_sealed_archive_of_another_log_is_refused_against_the_live_segment(archived: Path, tmp_path: Path) -> None:
    """The member's log made again (its segment 1 now holds other records): the archive of the old one is genuine
    but not this log's segment; the restore refuses it, and archiving again replaces it."""
    logs = tmp_path / "logs"
    old_info = live(logs, "QM1", 1)
    (logs / "QM1").rename(tmp_path / "QM1-old")
    qm1 = RecordLog(logs / "QM1", "QM1", segment_bytes=700)
    for i in range(30):
        qm1.append(records.end("QM1.2.1", 1000 + i))
    qm1.close()
    info = live(logs, "QM1", 1)
    assert (info.min_lrsn, info.records) != (old_info.min_lrsn, old_info.records)
    path = archived / "QM1" / SEG1
    with pytest.raises(ArchiveError, match=f"{path}: archived from another log than QM1's segment 1"):
        spark_sources(logs, archived)
    archive_logs(logs, archived)
    assert verified_segment(archived, "QM1", 1, live(logs, "QM1", 1)) == path
    assert pq.read_table(path).column("lrsn").to_pylist()[0] == 1000
    assert LogReader(logs / "QM1").member == "QM1"


@pytest.mark.parametrize("where", ["archive", "member"])
def test_an_archive_directory_others_can_write_is_refused(archived: Path, tmp_path: Path, where: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    unsafe = archived if where == "archive" else archived / "QM1"
    unsafe.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match=f"{unsafe} is writable by other users"):
        spark_sources(tmp_path / "logs", archived)
    with pytest.raises(UnsafeDirectoryError, match=f"{unsafe} is writable by other users"):
        verified_segment(archived, "QM1", 1)
    with pytest.raises(UnsafeDirectoryError):
        audit_message(archived, "X")
    rc = cfrestore(["archive", "--log-root", str(tmp_path / "logs"), "--archive-dir", str(archived)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{unsafe} is writable by other users" in err


def test_cfrestore_archive_refuses_a_shared_directory_before_writing(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _journey(tmp_path / "logs")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rc = cfrestore(["archive", "--log-root", str(tmp_path / "logs"), "--archive-dir", str(shared)])
    assert rc == 2 and "is writable by other users" in capsys.readouterr().err
    assert list(shared.iterdir()) == [] and shared.stat().st_mode & 0o7777 == 0o1777
    fresh = tmp_path / "fresh" / "archive"  # one made by the archive: the owner's only
    assert cfrestore(["archive", "--log-root", str(tmp_path / "logs"), "--archive-dir", str(fresh)]) == 0
    assert fresh.stat().st_mode & 0o777 == 0o700


def test_archiving_without_a_backup_key_writes_nothing(tmp_path: Path) -> None:
    from backup.files import NoBackupKeyError

    _journey(tmp_path / "logs")
    with pytest.raises(NoBackupKeyError, match="no backup key to sign the archive with"):
        archive_logs(tmp_path / "logs", tmp_path / "archive", backup_keys=credentials.BackupKeys(source="nowhere"))
    assert not (tmp_path / "archive").exists()
