"""Tests of the per-SQM record log (sqm.log): real files, real fsync."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqm.log import (
    LogCorruptError,
    LogFormatError,
    LogLockedError,
    LogPosition,
    LogReader,
    RecordLog,
    RecordRefusedError,
    find_log_dirs,
    merged_records,
)
from sqm.log.format import FRAME, segment_name

FRAME_HEADER = FRAME.size


def rec(i: int, size: int = 20, kind: str = "PUT") -> dict[str, Any]:
    return {"k": kind, "l": i, "q": "Q1", "d": bytes([i % 256]) * size}


def write_log(d: Path, n: int, *, member: str = "QM1", segment_bytes: int = 64 * 2**20,
              size: int = 20) -> list[tuple[LogPosition, dict[str, Any]]]:
    out = []
    with RecordLog(d, member, segment_bytes=segment_bytes) as log:
        for i in range(n):
            r = rec(i, size)
            out.append((log.append(r), r))
    return out


def frame_end(pos: LogPosition, r: dict[str, Any]) -> int:
    return pos.offset + FRAME_HEADER + len(msgpack.packb(r, use_bin_type=True))


def read_all(d: Path) -> list[tuple[LogPosition, dict[str, Any]]]:
    return list(LogReader(d).records())


def seg_path(d: Path, segno: int) -> Path:
    return d / segment_name(segno)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ------------------------------------------------------------------------------------------- round trip


def test_round_trip_across_segment_rolls(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 300, segment_bytes=1024)
    segs = sorted(p.name for p in d.glob("seg-*.log"))
    assert len(segs) > 5
    assert segs[0] == "seg-00000001.log"
    for p in d.glob("seg-*.log"):
        assert p.stat().st_size <= 1024
    got = read_all(d)
    assert got == written
    positions = [p for p, _ in got]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    reader = LogReader(d)
    assert reader.member == "QM1"
    infos = reader.segments()
    assert [i.segment for i in infos] == list(range(1, len(segs) + 1))
    assert sum(i.records for i in infos) == 300
    assert infos[0].min_lrsn == 0 and infos[-1].max_lrsn == 299
    assert all(i.sealed for i in infos[:-1])
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["member"] == "QM1" and manifest["version"] == 1
    assert len(manifest["segments"]) == len(segs)


def test_writer_records_sees_unforced_appends_and_reader_sees_forced(tmp_path: Path) -> None:
    with RecordLog(tmp_path / "QM1", "QM1", segment_bytes=2048) as log:
        for i in range(50):
            log.append(rec(i))
        assert [r["l"] for _, r in log.records()] == list(range(50))
        pos = log.append_forced(rec(50))
        got = list(LogReader(tmp_path / "QM1").records())
        assert got[-1] == (pos, rec(50))
        assert [r["l"] for _, r in log.records(start=got[10][0])] == list(range(10, 51))
        assert log.stats.records == 51


def test_reopen_and_continue(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    first = write_log(d, 40, segment_bytes=1024)
    more = []
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert log.stats.torn_bytes_truncated == 0
        for i in range(40, 90):
            r = rec(i)
            more.append((log.append(r), r))
    assert more[0][0] > first[-1][0]
    assert read_all(d) == first + more
    with pytest.raises(LogFormatError):
        RecordLog(tmp_path / "nothing", "QM1", create=False)


def test_values_round_trip(tmp_path: Path) -> None:
    r = {"k": "PUT", "l": 2**62, "d": b"\x00\xff" * 10, "s": "héllo", "n": None, "f": 1.5, "x": [1, {"a": 2}]}
    with RecordLog(tmp_path / "QM1", "QM1") as log:
        log.append(r)
    assert read_all(tmp_path / "QM1")[0][1] == r
    with RecordLog(tmp_path / "QM2", "QM2") as log:
        with pytest.raises(TypeError):
            log.append({"k": "PUT", "l": "1"})
        with pytest.raises(KeyError):
            log.append({"l": 1})


# ------------------------------------------------------------------------------------------ torn tails


TORN_SHAPES = ["header", "body", "crc", "zeros"]


@pytest.mark.parametrize("shape", TORN_SHAPES)
def test_torn_tail_is_end_of_log_and_writer_truncates(tmp_path: Path, shape: str) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 30, segment_bytes=1024)
    last_pos, _ = written[-1]
    path = seg_path(d, last_pos.segment)
    size = path.stat().st_size
    if shape == "header":
        os.truncate(path, last_pos.offset + 3)
        expect = written[:-1]
    elif shape == "body":
        os.truncate(path, last_pos.offset + FRAME_HEADER + 5)
        expect = written[:-1]
    elif shape == "crc":
        flip_byte(path, last_pos.offset + 5)  # the stored CRC of the last frame, which ends at EOF
        expect = written[:-1]
    else:
        with open(path, "ab") as f:
            f.write(b"\x00" * 100)
        expect = written
    new_size = path.stat().st_size
    assert read_all(d) == expect  # silently the end of the log
    assert LogReader(d).end_position() == LogPosition(last_pos.segment, frame_end(*expect[-1]))
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        truncated = log.stats.torn_bytes_truncated
        assert truncated == new_size - (size if shape == "zeros" else last_pos.offset)
        after = [(log.append(rec(1000 + i)), rec(1000 + i)) for i in range(20)]
    assert read_all(d) == expect + after
    if shape != "zeros":
        assert after[0][0] == last_pos  # the torn frame's place is reused


def test_partial_segment_header_in_last_segment(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 30, segment_bytes=1024)
    nxt = seg_path(d, written[-1][0].segment + 1)
    nxt.write_bytes(b"CFLO")  # crash while creating the next segment
    assert read_all(d) == written
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert log.stats.torn_bytes_truncated == 4
        p = log.append(rec(99))
    assert p.segment == written[-1][0].segment + 1
    assert read_all(d) == [*written, (p, rec(99))]


# ------------------------------------------------------------------------------------------ corruption


def test_flipped_byte_in_middle_frame_is_corruption(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 20)
    pos, _ = written[7]
    path = seg_path(d, pos.segment)
    flip_byte(path, pos.offset + FRAME_HEADER + 3)
    with pytest.raises(LogCorruptError) as ei:
        read_all(d)
    msg = str(ei.value)
    assert str(path) in msg and f"offset {pos.offset}" in msg and "CRC mismatch" in msg
    assert ei.value.path == str(path) and ei.value.offset == pos.offset
    with pytest.raises(LogCorruptError, match="CRC mismatch"):
        RecordLog(d, "QM1")  # the writer refuses to open (and must not truncate)
    assert path.stat().st_size == frame_end(*written[-1])


def test_bad_crc_on_second_to_last_frame_is_corruption_not_torn(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 5)
    pos, _ = written[-2]
    path = seg_path(d, pos.segment)
    flip_byte(path, pos.offset + 4)
    with pytest.raises(LogCorruptError) as ei:
        read_all(d)
    assert ei.value.offset == pos.offset and "CRC mismatch" in str(ei.value)


def test_impossible_length_is_corruption(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 20)
    pos, _ = written[5]
    path = seg_path(d, pos.segment)
    with open(path, "r+b") as f:
        f.seek(pos.offset)
        f.write((123456789).to_bytes(4, "little"))
    with pytest.raises(LogCorruptError) as ei:
        read_all(d)
    msg = str(ei.value)
    assert "length 123456789 exceeds segment" in msg and str(path) in msg and f"offset {pos.offset}" in msg


def test_garbled_length_past_eof_followed_by_valid_frames_is_corruption(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 20)
    pos, _ = written[15]
    path = seg_path(d, pos.segment)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a plausible length that runs past EOF but inside the segment capacity
        f.seek(pos.offset)
        f.write((size - pos.offset + 1000).to_bytes(4, "little"))
    with pytest.raises(LogCorruptError, match="valid frame follows") as ei:
        read_all(d)
    assert ei.value.offset == pos.offset


def test_corruption_in_non_last_segment(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 200, segment_bytes=1024)
    in_seg2 = [p for p, _ in written if p.segment == 2]
    last_of_seg2 = in_seg2[-1]
    path = seg_path(d, 2)
    # The last frame of a non-last segment: a bad CRC there is corruption, not a torn tail.
    flip_byte(path, last_of_seg2.offset + FRAME_HEADER + 1)
    with pytest.raises(LogCorruptError) as ei:
        read_all(d)
    assert str(path) in str(ei.value) and f"offset {last_of_seg2.offset}" in str(ei.value)
    flip_byte(path, last_of_seg2.offset + FRAME_HEADER + 1)  # repair, then truncate it instead
    assert read_all(d) == written
    os.truncate(path, last_of_seg2.offset + 5)
    with pytest.raises(LogCorruptError, match="truncated frame header") as ei:
        read_all(d)
    assert ei.value.offset == last_of_seg2.offset
    # The writer scans untrusted segments, and a sealed one is trusted: delete the manifest to force a scan.
    (d / "manifest.json").unlink()
    with pytest.raises(LogCorruptError):
        RecordLog(d, "QM1", segment_bytes=1024)


def test_foreign_member_and_garbled_header(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    write_log(d, 10, segment_bytes=1024)
    with pytest.raises(LogFormatError, match="QM1"):
        RecordLog(d, "QM2")
    (d / "manifest.json").unlink()
    with pytest.raises(LogFormatError, match="belongs to member 'QM1'"):
        RecordLog(d, "QM2")
    assert LogReader(d).member == "QM1"
    with open(seg_path(d, 1), "r+b") as f:
        f.write(b"XXLOG1\n")
    with pytest.raises(LogFormatError, match="bad magic"):
        read_all(d)
    other = tmp_path / "other"
    other.mkdir()
    (other / "seg-00000001.log").write_bytes(b"not a log segment at all, really not" * 3)
    with pytest.raises(LogFormatError):
        RecordLog(other, "QM1")


def test_second_writer_refused(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    with RecordLog(d, "QM1") as log:
        log.append_forced(rec(1))
        with pytest.raises(LogLockedError, match="already open for writing"):
            RecordLog(d, "QM1")
        code = (
            "import sys\nfrom sqm.log import RecordLog, LogLockedError\n"
            "try:\n    RecordLog(sys.argv[1], 'QM1')\nexcept LogLockedError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2], timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert f"pid {os.getpid()}" in proc.stdout
        assert [r for _, r in LogReader(d).records()] == [rec(1)]  # readers do not need the lock
    with RecordLog(d, "QM1") as log:  # released on close
        assert [r for _, r in log.records()] == [rec(1)]


# ------------------------------------------------------------------------------------------- manifest


def test_manifest_lagging_or_missing(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    first = write_log(d, 30, segment_bytes=1024)
    stale = (d / "manifest.json").read_text()
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        more = [(log.append(rec(i)), rec(i)) for i in range(30, 150)]
    everything = first + more
    (d / "manifest.json").write_text(stale)  # the manifest lags several segment rolls
    assert read_all(d) == everything
    assert [r["l"] for _, r in LogReader(d).records(min_lrsn=100)] == list(range(100, 150))
    assert sum(i.records for i in LogReader(d).segments()) == 150
    (d / "manifest.json").unlink()
    assert read_all(d) == everything
    assert LogReader(d).end_position() > everything[-1][0]
    with RecordLog(d, "QM1", segment_bytes=1024) as log:  # rebuilds the manifest from the segments
        p = log.append(rec(150))
    manifest = json.loads((d / "manifest.json").read_text())
    assert sum(s["records"] for s in manifest["segments"]) == 151
    assert read_all(d) == [*everything, (p, rec(150))]


@pytest.mark.parametrize("which", ["last", "first"])
def test_a_segment_listed_in_the_manifest_but_deleted_is_corruption_named_by_file(tmp_path: Path,
                                                                                   which: str) -> None:
    """A segment the manifest lists that is missing is corruption, reported by file name by the reader, the writer
    (which refuses to open and never recreates it) and restore alike; the last segment too, whose loss leaves no
    gap in the numbering."""
    d = tmp_path / "QM1"
    write_log(d, 60, segment_bytes=1024)
    segs = sorted(d.glob("seg-*"))
    assert len(segs) >= 3
    victim = segs[-1] if which == "last" else segs[0]
    victim.unlink()
    with pytest.raises(LogFormatError, match=f"{victim.name}.*missing"):
        read_all(d)
    with pytest.raises(LogFormatError, match=f"{victim.name}.*missing"):
        LogReader(d).end_position()
    with pytest.raises(LogFormatError, match=f"{victim.name}.*missing"):
        merged_records([d])
    with pytest.raises(LogFormatError, match=f"{victim.name}.*missing"):
        RecordLog(d, "QM1", segment_bytes=1024).close()
    assert not victim.exists(), "a failed open must not recreate the lost segment"


def test_checkpoints(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    cps = []
    with RecordLog(d, "QM1", segment_bytes=2048) as log:
        assert log.last_checkpoint() is None
        for i in range(100):
            if i % 5 == 0:
                r = {"k": "CHECKPOINT", "l": i, "active": [f"u{i}"]}
                cps.append((log.checkpoint(r), r))
            else:
                log.append(rec(i))
        assert log.last_checkpoint() == cps[-1]
        assert [p for p, _ in log.checkpoints()] == [p for p, _ in cps[-16:]]
    manifest = json.loads((d / "manifest.json").read_text())
    assert [c["lrsn"] for c in manifest["checkpoints"]] == [r["l"] for _, r in cps[-16:]]
    assert LogReader(d).last_checkpoint() == cps[-1]
    with RecordLog(d, "QM1", segment_bytes=2048) as log:
        assert log.last_checkpoint() == cps[-1]
    empty = tmp_path / "QM2"
    write_log(empty, 3)
    assert LogReader(empty).last_checkpoint() is None


# ----------------------------------------------------------------------------------------- group commit


def test_group_commit_shares_fsyncs(tmp_path: Path) -> None:
    threads, rounds = 8, 40
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    with RecordLog(tmp_path / "QM1", "QM1") as log:
        def work(t: int) -> None:
            try:
                for i in range(rounds):
                    pos = log.append(rec(t * rounds + i))
                    barrier.wait()  # every thread has appended before anyone forces
                    log.force(pos)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                barrier.abort()
        ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert not errors
        st_ = log.stats
        assert st_.forces == threads * rounds
        assert st_.fsyncs < st_.forces / 2, (st_.fsyncs, st_.forces)
        assert st_.fsyncs <= rounds  # at most one flush per round: a flush covers everything appended before it
    got = sorted(r["l"] for _, r in read_all(tmp_path / "QM1"))
    assert got == list(range(threads * rounds))


def test_group_commit_free_running_is_durable(tmp_path: Path) -> None:
    threads, per = 8, 100
    seen: list[LogPosition] = []
    lock = threading.Lock()
    with RecordLog(tmp_path / "QM1", "QM1", segment_bytes=4096) as log:
        def work(t: int) -> None:
            for i in range(per):
                p = log.append_forced(rec(t * per + i))
                with lock:
                    seen.append(p)
        ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert log.stats.forces == threads * per
        assert log.stats.fsyncs <= log.stats.forces
        # Everything forced is visible to an independent reader while the writer is still open.
        positions = {p for p, _ in LogReader(tmp_path / "QM1").records()}
        assert positions == set(seen)


# ---------------------------------------------------------------------------------------------- reader


def test_reader_min_lrsn_skips_old_segments(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 300, segment_bytes=1024)
    nsegs = written[-1][0].segment
    # Corrupt segment 1: a reader that skips it (by manifest max LRSN) never notices.
    flip_byte(seg_path(d, 1), written[3][0].offset + FRAME_HEADER + 2)
    reader = LogReader(d)
    got = list(reader.records(min_lrsn=250))
    assert [r["l"] for _, r in got] == list(range(250, 300))
    first_needed = next(p for p, r in written if r["l"] == 250).segment
    assert reader.segments_opened == nsegs - first_needed + 1
    with pytest.raises(LogCorruptError):
        list(LogReader(d).records())
    with pytest.raises(LogCorruptError):
        list(LogReader(d).records(min_lrsn=3))


def test_min_lrsn_filters_out_of_order_records(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    lrsns = [5, 3, 9, 1, 7, 20, 11, 15, 2, 30]  # only approximately ordered
    with RecordLog(d, "QM1", segment_bytes=256) as log:
        for x in lrsns:
            log.append({"k": "PUT", "l": x, "d": b"y" * 60})
    assert [r["l"] for _, r in LogReader(d).records(min_lrsn=7)] == [x for x in lrsns if x >= 7]


def test_merged_records_and_find_log_dirs(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    with RecordLog(root / "QM2", "QM2", segment_bytes=512) as a, RecordLog(root / "QM1", "QM1") as b:
        for x in [1, 4, 2, 8, 6]:
            a.append({"k": "PUT", "l": x, "d": b"a" * 50})
        for x in [2, 3, 8, 5]:
            b.append({"k": "GET", "l": x})
    (root / "not-a-log").mkdir()
    dirs = find_log_dirs(root)
    assert dirs == [root / "QM1", root / "QM2"]
    merged = merged_records(dirs)
    assert [(r["l"], r["m"]) for r in merged] == [
        (1, "QM2"), (2, "QM1"), (2, "QM2"), (3, "QM1"), (4, "QM2"), (5, "QM1"), (6, "QM2"), (8, "QM1"),
        (8, "QM2"),
    ]
    assert merged[0] == {"k": "PUT", "l": 1, "d": b"a" * 50, "m": "QM2"}
    assert [(r["l"], r["m"]) for r in merged_records(dirs, min_lrsn=3, max_lrsn=6)] == [
        (3, "QM1"), (4, "QM2"), (5, "QM1"), (6, "QM2"),
    ]
    shutil.copytree(root / "QM1", root / "QM1-copy")
    with pytest.raises(LogFormatError, match="twice"):
        merged_records(find_log_dirs(root))


# ------------------------------------------------------------------------------------------ hypothesis


records_st = st.lists(
    st.fixed_dictionaries({
        "k": st.sampled_from(["PUT", "GET", "COMMIT", "BACKOUT"]),
        "l": st.integers(min_value=0, max_value=2**40),
        "d": st.binary(max_size=300),
    }),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=records_st, segment_bytes=st.sampled_from([512, 2048, 1 << 20]), cut=st.floats(0, 1))
def test_truncation_anywhere_in_last_segment_yields_a_prefix(
    records: list[dict[str, Any]], segment_bytes: int, cut: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "QM1"
        with RecordLog(d, "QM1", segment_bytes=segment_bytes) as log:
            positions = [log.append(r) for r in records]
        last_seg = max(int(p.name[4:12]) for p in d.glob("seg-*.log"))
        path = seg_path(d, last_seg)
        size = path.stat().st_size
        keep = int(size * cut)
        os.truncate(path, keep)
        got = read_all(d)
        n = len(got)
        assert got == list(zip(positions, records))[:n]
        # Exactly the frames that end at or before the cut survive.
        expected_n = sum(
            1 for p, r in zip(positions, records) if p.segment < last_seg or frame_end(p, r) <= keep
        )
        assert n == expected_n
        with RecordLog(d, "QM1", segment_bytes=segment_bytes) as log:
            extra = {"k": "PUT", "l": 1, "d": b"after"}
            p = log.append(extra)
        assert read_all(d) == [*got, (p, extra)]


def test_a_force_that_fails_in_any_way_fails_the_log_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only an I/O error: anything that fails inside the flush leaves what reached the disk unknown, so the log
    is not trusted again, as after a failed fsync: OSError now and for every later force and append, and close
    forces nothing more."""
    import sqm.log.writer as writer

    log = RecordLog(tmp_path / "QM1", "QM1")
    log.append(rec(1))
    log.force()
    pos = log.append(rec(2))

    def broken(fd: int) -> None:
        raise ValueError("a bug in the flush")

    monkeypatch.setattr(writer, "_fdatasync", broken)
    with pytest.raises(OSError, match="a bug in the flush"):
        log.force(pos)
    monkeypatch.undo()
    with pytest.raises(OSError, match="unusable"):
        log.append(rec(3))
    with pytest.raises(OSError, match="unusable"):
        log.force()
    log.close()
    other = RecordLog(tmp_path / "QM2", "QM2")
    other.append(rec(1))
    with pytest.raises(ValueError, match="beyond the last appended"):  # a caller's bad position is its own error
        other.force(LogPosition(9, 9))
    other.force()  # and the log goes on
    other.close()


def test_a_force_of_records_close_already_forced_succeeds(tmp_path: Path) -> None:
    """A committer whose COMMIT the log's close forced (a member stopping while its last batch commits) is told its
    record is durable, not that the log is closed: its commit goes on, as decided."""
    log = RecordLog(tmp_path / "QM1", "QM1")
    pos = log.append(rec(1))
    log.close()
    log.force(pos)  # durable: no error
    assert [r["l"] for _, r in LogReader(tmp_path / "QM1").records()] == [1]


def test_a_segment_that_cannot_be_made_fails_the_log_and_closes_no_other_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next segment cannot be created (a full disk, no descriptors left) after the sealed one's descriptor
    was closed: the log is failed for good, and its close neither writes to nor closes the file that has since
    been given that descriptor's number."""
    log = RecordLog(tmp_path / "QM1", "QM1", segment_bytes=1024)
    sealed_fd = log._fd

    def no_room(segno: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(log, "_create_segment", no_room)
    with pytest.raises(RecordRefusedError):
        for i in range(100):
            log.append(rec(i, 100))
    other = os.open(tmp_path / "another-file", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert other == sealed_fd  # the lowest free number: the one the sealed segment had
        with pytest.raises(OSError, match="unusable"):
            log.append(rec(200))
        log.close()
        os.fstat(other)  # still open: the log's close did not close it
        assert os.path.getsize(tmp_path / "another-file") == 0  # and nothing was written to it
    finally:
        os.close(other)


def test_the_logs_under_a_log_root_are_its_directories_that_hold_one(tmp_path: Path) -> None:
    """find_log_dirs: a member's directory with its log is found; a file, an empty directory (a mount point with
    its volume not mounted) and a root that is not there are not."""
    with RecordLog(tmp_path / "QM1", "QM1") as log:
        log.append({"k": "X", "l": 1})
        log.force()
    (tmp_path / "QM2").mkdir()
    (tmp_path / "notes.txt").write_text("not a log")
    assert find_log_dirs(tmp_path) == [tmp_path / "QM1"]
    assert find_log_dirs(tmp_path / "missing") == []
