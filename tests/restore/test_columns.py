"""The columnar engine's readers (restore.columns, restore/_columns.c) against the house's own readers: the same
records, fields and places as sqm.log's reader, the same errors for damaged logs and backups."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import duckdb
import msgpack
import pyarrow as pa
import pytest

from backup.files import BackupWriter, ChecksumMismatchError, CorruptFrameError, read_backup
from cfemu.entry import Entry
from restore import _columns  # type: ignore[attr-defined]
from restore.columns import (
    ENTRY_ID_SQL,
    SRC_BACKUP,
    SRC_DD,
    SRC_E,
    SRC_I,
    SRC_IDS,
    Pieces,
    Scanned,
    Source,
    entry_id,
    log_segments_read,
    read_back,
    scan_backup_file,
    scan_segment,
)
from restore.log_slices import LogSlice
from sqm.core import records
from sqm.log import LogCorruptError, RecordLog

S = "APP1"


def _history(log: RecordLog, n: int, rng: random.Random) -> None:
    for i in range(n):
        u = f"QM1.1.{i}"
        e = Entry(f"m{i}", f"Q{i % 3}", lrsn=100 + i).wire()
        log.append(records.put(u, 100 + 4 * i, structure=S, gen=1, entry=e, data=rng.randbytes(rng.randint(0, 300))))
        log.append(records.get(u, 101 + 4 * i, structure=S, gen=1, entry_id=f"m{i - 1}", queue="Q0"))
        if i % 5 == 0:
            got = Entry(f"m{i - 1}", "Q0", state="UG", lrsn=101 + 4 * i, uow=u).wire()
            log.append(records.backout(u, 102 + 4 * i, {S: 1, "APP2": 3}, data=[[S, got, b"back"], ["APP2", got, b"x"]],
                                       at=100 + 4 * i))
        elif i % 7 == 0:
            log.append(records.recovery(u, 102 + 4 * i, {S: 1}, commit=True, of="QM1", by="QM2"))
        else:
            log.append(records.commit(u, 102 + 4 * i, {S: 1}))
        if i % 11 == 0:
            log.append(records.expire(103 + 4 * i, structure=S, ids=[f"m{i}", f"x{i}"]))
        if i % 13 == 0:
            log.append(records.relog(103 + 4 * i, structure=S, gen=1,
                                     entry=Entry(f"m{i}", "Q1", state="UP", lrsn=99, uow=u).wire(), data=b"r"))
    log.force()


def _log(tmp_path: Path, n: int = 300, segment_bytes: int = 8192) -> Path:
    d = tmp_path / "logs" / "QM1"
    with RecordLog(d, "QM1", segment_bytes=segment_bytes) as log:
        _history(log, n, random.Random(n))
    return d


def _scan_log(d: Path, min_lrsn: int, spill: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """The log's records from `min_lrsn` on as the C reader reads them: the recs rows, then [the other tables'
    rows, the sources]."""
    rows: list[dict[str, Any]] = []
    tables: dict[str, list[dict[str, Any]]] = {"ev": [], "descs": [], "ss": []}
    sources: list[Source] = []
    for job, (segno, path, last) in enumerate(log_segments_read(d, min_lrsn)):
        out: list[Scanned] = []
        sources += scan_segment(d, segno, path, "QM1", is_last=last, min_lrsn=min_lrsn, first_rid=job << 20,
                                source=len(sources), spill=spill, emit=out.append)
        for sc in out:
            rows += sc.tables["recs"].to_pylist()
            for name in tables:
                tables[name] += sc.tables[name].to_pylist()
    return rows, [tables, sources]


def test_the_c_readers_crc32c_is_the_frames_checksum() -> None:
    """Also at the lengths where the native CRC runs three chains side by side and joins them (three blocks of 256
    bytes, of 8 KiB), and across their ends."""
    rng = random.Random(1)
    for n in (0, 1, 7, 8, 9, 63, 64, 767, 768, 769, 1000, 1535, 1536, 4099, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 9,
              6 * 8192 + 3 * 256 + 5, 100_003):
        data = rng.randbytes(n)
        assert _columns.crc32c(data) == crc32c.crc32c(data)


def test_a_log_read_into_columns_holds_every_record_and_field_the_logs_reader_gives(tmp_path: Path) -> None:
    d = _log(tmp_path)
    min_lrsn = 150
    want = list(LogSlice(str(d), None, min_lrsn).records())
    rows, (tables, sources) = _scan_log(d, min_lrsn, tmp_path)
    assert len({seg for (_, _, seg, _), _ in want}) > 3  # several segments
    assert [(r["l"], r["m"], r["seg"], r["off"]) for r in rows] == [key for key, _ in want]
    for row, (_, rec) in zip(rows, want, strict=True):
        assert (row["k"], row["u"], row["s"], row["g"], row["at"], row["o"], row["by"]) == (
            rec["k"], rec.get("u"), rec.get("s"), rec.get("g"), rec.get("at"), rec.get("o"), rec.get("by"))
        assert row["eu"] == ((rec["e"].get("u") or "") if "e" in rec else None)
    by_rid = {r["rid"]: rec for r, (_, rec) in zip(rows, want, strict=True)}
    ids = {(e["rid"], e["src"], entry_id(e["eid"]), e["dds"]) for e in tables["ev"]}
    expected = set()
    for rid, rec in by_rid.items():
        if "e" in rec:
            expected.add((rid, SRC_E, rec["e"]["id"], None))
        if "i" in rec:
            expected.add((rid, SRC_I, rec["i"], None))
        expected |= {(rid, SRC_IDS, i, None) for i in rec.get("ids", ())}
        expected |= {(rid, SRC_DD, c[1]["id"], c[0]) for c in rec.get("dd", ())}
    assert ids == expected and any(src == SRC_DD for _, src, _, _ in ids)
    assert {(s["rid"], s["s"], s["g"]) for s in tables["ss"]} == {
        (rid, s, g) for rid, rec in by_rid.items() for s, g in rec.get("ss", {}).items()}
    # every descriptor and its data read back from where the columns say they are
    descs = tables["descs"]
    got = read_back(sources, [(x["f"], x["boff"], x["blen"], x["doff"], x["dlen"]) for x in descs])
    for x, (desc, data) in zip(descs, got, strict=True):
        rec = by_rid[x["rid"]]
        carried = (rec["e"], rec.get("d", b"")) if x["src"] == SRC_E else (rec["dd"][x["pos"]][1],
                                                                            rec["dd"][x["pos"]][2])
        assert msgpack.unpackb(desc) == carried[0] and data == carried[1]
        assert (entry_id(x["eid"]), x["q"], x["st"], x["u"], x["l"]) == (
            carried[0]["id"], carried[0]["q"], carried[0].get("st"), carried[0].get("u") or "", carried[0]["l"])


def _corrupt(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _reference_error(d: Path, min_lrsn: int = 0) -> str:
    with pytest.raises(LogCorruptError) as e:
        list(LogSlice(str(d), None, min_lrsn).records())
    return str(e.value)


def test_a_damaged_frame_mid_log_raises_what_the_logs_reader_raises(tmp_path: Path) -> None:
    d = _log(tmp_path, 60, segment_bytes=1 << 20)
    seg = d / "seg-00000001.log"
    _corrupt(seg, seg.stat().st_size // 2)
    want = _reference_error(d)
    with pytest.raises(LogCorruptError) as e:
        _scan_log(d, 0, tmp_path)
    assert str(e.value) == want


def test_a_torn_end_of_a_live_log_ends_it_as_the_logs_reader_does(tmp_path: Path) -> None:
    d = _log(tmp_path, 40, segment_bytes=1 << 20)
    seg = d / "seg-00000001.log"
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # half a frame header
    rows, _ = _scan_log(d, 0, tmp_path)
    assert [(r["l"], r["off"]) for r in rows] == [(k[0], k[3]) for k, _ in LogSlice(str(d), None, 0).records()]


def _append_raw(d: Path, body: bytes) -> None:
    seg = sorted(d.glob("seg-*.log"))[-1]
    with open(seg, "ab") as f:
        f.write(len(body).to_bytes(4, "little") + crc32c.crc32c(body).to_bytes(4, "little") + body)
        f.flush()
        os.fsync(f.fileno())


def test_a_record_that_is_not_utf_8_is_refused_as_the_logs_reader_refuses_it(tmp_path: Path) -> None:
    d = _log(tmp_path, 10, segment_bytes=1 << 20)
    _append_raw(d, msgpack.packb({"k": "GET", "l": 500, "u": "QM1.1.99", "s": S, "g": 1, "i": "m1", "q": "Q0",
                                  "r": b"\xff\xfe".decode("latin-1")}).replace(b"\xc3\xbf\xc3\xbe", b"\xff\xfe\x20\x20"))
    want = _reference_error(d)
    with pytest.raises(LogCorruptError) as e:
        _scan_log(d, 0, tmp_path)
    assert str(e.value) == want and "undecodable" in want


def test_a_record_the_c_reader_does_not_take_is_read_by_the_logs_reader_and_packed_again(tmp_path: Path) -> None:
    """A map key repeated (msgpack keeps the last): the C reader stops, the house's reader decodes it, and it is
    read again from memory, with its own place in the log."""
    d = _log(tmp_path, 10, segment_bytes=1 << 20)
    body = b"\x86" + b"".join(msgpack.packb(x) for x in ("k", "GET", "l", 500, "u", "QM1.1.99", "s", S, "i", "m1",
                                                          "i", "m2"))
    _append_raw(d, body)
    with RecordLog(d, "QM1") as log:  # and a record after it, read from the segment again
        log.append(records.commit("QM1.1.99", 501, {S: 1}))
        log.force()
    rows, (tables, _) = _scan_log(d, 0, tmp_path)
    want = list(LogSlice(str(d), None, 0).records())
    assert [(r["l"], r["off"], r["k"]) for r in rows] == [(k[0], k[3], rec["k"]) for k, rec in want]
    repacked = rows[-2]
    assert [entry_id(e["eid"]) for e in tables["ev"] if e["rid"] == repacked["rid"]] == ["m2"]


def _backup(tmp_path: Path, n: int = 50) -> Path:
    w = BackupWriter(tmp_path / "b", roll_bytes=2000)
    for i in range(n):
        w.add(1, Entry(f"c{i}", "Q1", state="CP", lrsn=10 + i, order=(i, i)).wire(), bytes([i]) * i)
    w.finish({"id": "b", "group": "G", "structure": S, "entries": n, "bytes": n, "replay_from": 100, "gen": 1})
    return tmp_path / "b"


def _copies(backup_dir: Path, info: dict[str, Any], first_rid: int = 0) -> list[dict[str, Any]]:
    """The descs rows of one backup file as the C reader reads it."""
    out: list[Scanned] = []
    n = scan_backup_file(backup_dir, info, first_rid=first_rid, source=0, structure=S, emit=out.append)
    rows = [row for sc in out for row in sc.tables["descs"].to_pylist()]
    assert n == len(rows) == info["frames"]
    return rows


def test_a_backups_files_read_into_columns_hold_every_copy(tmp_path: Path) -> None:
    b = read_backup(_backup(tmp_path))
    want = list(b.copies())
    descs: list[dict[str, Any]] = []
    for j, info in enumerate(b.manifest["files"]):
        descs += _copies(b.path, info, j << 20)
    assert len(b.manifest["files"]) > 2
    assert [(x["src"], x["s"], entry_id(x["eid"]), x["l"], x["o1"], x["dlen"]) for x in descs] == [
        (SRC_BACKUP, s, d["id"], d["l"], d["o1"], len(data)) for s, d, data in want]


@pytest.mark.parametrize("damage", ["crc", "sha"])
def test_a_damaged_backup_file_is_refused(tmp_path: Path, damage: str) -> None:
    b = read_backup(_backup(tmp_path))
    info = b.manifest["files"][1]
    path = b.path / info["name"]
    if damage == "crc":  # as backup.files says it
        _corrupt(path, path.stat().st_size - 3)
        with pytest.raises(CorruptFrameError, match=r"bad CRC in the frame at byte \d+"):
            _copies(b.path, info)
        with path.open("r+b") as f:  # the last frame cut short
            f.truncate(path.stat().st_size - 3)
        with pytest.raises(CorruptFrameError, match=r"the frame at byte \d+ runs past the end of the file"):
            _copies(b.path, info)
    else:
        with pytest.raises(ChecksumMismatchError, match="blake3 does not match the manifest"):
            _copies(b.path, {**info, "blake3": "0" * 64})


def test_frames_that_run_past_a_chunk_are_read_again_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader holds CHUNK bytes of a file at a time: with chunks smaller than most frames, every frame runs
    past one, and the same records and copies come out."""
    d = _log(tmp_path, 80, segment_bytes=1 << 20)
    b = read_backup(_backup(tmp_path))
    whole_log = _scan_log(d, 0, tmp_path)[0]
    whole_backup = _copies(b.path, b.manifest["files"][0])
    monkeypatch.setattr("restore.columns.CHUNK", 37)
    assert _scan_log(d, 0, tmp_path)[0] == whole_log
    assert _copies(b.path, b.manifest["files"][0]) == whole_backup
    assert len(whole_backup) > 3


def test_a_files_chunks_are_read_into_one_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk of a file is read into the same buffer: a buffer made afresh for each chunk is memory the kernel
    maps, faults in, zeroes and unmaps again every chunk (BENCHMARKS.md, "The readers' buffer"). The records and
    copies are the same as read whole."""
    d = _log(tmp_path, 80, segment_bytes=1 << 20)
    b = read_backup(_backup(tmp_path))
    whole_log = _scan_log(d, 0, tmp_path)[0]
    whole_backup = _copies(b.path, b.manifest["files"][0])
    read_into: list[Any] = []  # the buffers themselves, kept: no two of them can share an id
    preadv = os.preadv

    def counting(fd: int, views: list[memoryview], off: int) -> int:
        read_into.append(views[0].obj)
        return preadv(fd, views, off)

    monkeypatch.setattr("restore.columns.CHUNK", 4096)
    monkeypatch.setattr("restore.columns.os.preadv", counting)
    assert _scan_log(d, 0, tmp_path)[0] == whole_log
    assert len(list(d.glob("seg-*.log"))) == 1
    assert len(read_into) > 3 and len({id(x) for x in read_into}) == 1
    read_into.clear()
    monkeypatch.setattr("restore.columns.CHUNK", 256)  # a backup file here is 2,000 bytes, each frame below 256
    assert _copies(b.path, b.manifest["files"][0]) == whole_backup
    assert len(read_into) > 1 and len({id(x) for x in read_into}) == 1


def test_reads_that_return_fewer_bytes_than_asked_read_the_same(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A read may return fewer bytes than asked before a file's end (NFS, FUSE): the reader reads on until its
    chunk is whole, and the same records and copies come out, the backup's sha256 and frame count checked."""
    d = _log(tmp_path, 80, segment_bytes=1 << 20)
    b = read_backup(_backup(tmp_path))
    whole_log = _scan_log(d, 0, tmp_path)[0]
    whole_backup = [_copies(b.path, info) for info in b.manifest["files"]]
    rng = random.Random(3)
    preadv = os.preadv

    def short(fd: int, views: list[memoryview], off: int) -> int:
        return preadv(fd, [views[0][:max(1, rng.randrange(len(views[0]) + 1))]], off)

    monkeypatch.setattr("restore.columns.CHUNK", 4096)
    monkeypatch.setattr("restore.columns.os.preadv", short)
    assert _scan_log(d, 0, tmp_path)[0] == whole_log
    assert [_copies(b.path, info) for info in b.manifest["files"]] == whole_backup


def test_pieces_read_back_whole_from_reads_that_return_fewer_bytes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """read_back reads on where a read returns fewer bytes than asked (as read_pieces does in C), and a source cut
    short since it was read is an OSError naming the place, never a descriptor or data restored short."""
    path = tmp_path / "source"
    data = random.Random(4).randbytes(50_000)
    path.write_bytes(data)
    pieces = [(0, 0, 100, 100, 900), (0, 5_000, 3_000, 20_000, 25_000), (0, 49_000, 1_000, 0, 0)]
    expected = [(data[b:b + bl], data[d:d + dl] if dl else b"") for _, b, bl, d, dl in pieces]
    rng = random.Random(5)
    preadv = os.preadv

    def short(fd: int, views: list[memoryview], off: int) -> int:
        return preadv(fd, [views[0][:max(1, rng.randrange(len(views[0]) + 1))]], off)

    monkeypatch.setattr("restore.columns.os.preadv", short)
    assert read_back([Source(str(path))], pieces) == expected
    monkeypatch.undo()
    with pytest.raises(OSError, match=r"ends at byte 50000, inside a piece"):
        read_back([Source(str(path))], [(0, 49_000, 1_001, 0, 0)])


def test_without_its_c_readers_the_columnar_engine_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension is optional (an image without a C compiler installs the package without it): asking for the
    columnar engine there fails at once, naming what is missing and the way out."""
    from restore.engine import get_engine

    monkeypatch.setattr("restore.columns._columns", None)
    with pytest.raises(RuntimeError, match=r"C readers \(restore._columns\).*--engine local"):
        get_engine("columnar", workers=1)


def test_entries_are_read_back_from_a_segment_archived_after_it_was_read(tmp_path: Path) -> None:
    """Linear logging may archive a sealed segment while a restore runs: its descriptors and data are read back
    from the archive the log's manifest names."""
    d = tmp_path / "logs" / "QM1"
    log = RecordLog(d, "QM1", segment_bytes=4096)
    _history(log, 40, random.Random(2))
    rows, (tables, sources) = _scan_log(d, 0, tmp_path)
    pieces = [(x["f"], x["boff"], x["blen"], x["doff"], x["dlen"]) for x in tables["descs"]]
    before = read_back(sources, pieces)
    assert log.archive(3, tmp_path / "archive")  # segments 1 and 2 moved, after they were read
    assert not (d / "seg-00000001.log").exists()
    assert read_back(sources, pieces) == before
    log.close()


def test_pieces_are_read_back_in_any_order_as_the_files_hold_them(tmp_path: Path) -> None:
    """Pieces of two files in a shuffled order, near each other (read by one pread of their span) and far apart,
    a descriptor with its data after it or not, data larger than a span, no data: each row gets its own bytes."""
    rng = random.Random(4)
    blobs = [rng.randbytes(3 << 20), rng.randbytes(1 << 20)]
    paths = []
    for k, blob in enumerate(blobs):
        paths.append(tmp_path / f"f{k}")
        paths[-1].write_bytes(blob)
    rows = []
    for _ in range(400):
        f = rng.randrange(2)
        size = len(blobs[f])
        boff, blen = rng.randrange(size - 300), rng.randrange(1, 300)
        choice = rng.random()
        if choice < 0.4:  # the data right after the descriptor
            doff, dlen = boff + blen + rng.randrange(4), rng.randrange(0, 2000)
        elif choice < 0.5 and f == 0:  # data larger than one read's span
            doff, dlen = rng.randrange(1 << 20), (3 << 19) + rng.randrange(1000)
        else:
            doff, dlen = rng.randrange(size - 5000), rng.randrange(0, 5000)
        dlen = max(0, min(dlen, size - doff))
        rows.append((f, boff, blen, doff, dlen))
    pieces = Pieces([Source(str(p)) for p in paths])
    try:
        descs, datas = pieces.read(*(pa.array(col, pa.int64()) for col in zip(*rows, strict=True)))
        # a slice of a longer array: its own values only
        tail = pa.array([r[1] for r in rows] * 2, pa.int64()).slice(len(rows))
        again, _ = pieces.read(*(pa.array(col, pa.int64()) for col in list(zip(*rows, strict=True))[:1]), tail,
                               *(pa.array(col, pa.int64()) for col in list(zip(*rows, strict=True))[2:]))
    finally:
        pieces.close()
    assert pieces.fds == [-1, -1]
    assert descs == [blobs[f][b:b + n] for f, b, n, _, _ in rows]
    assert datas == [blobs[f][d:d + n] for f, _, _, d, n in rows]
    assert again == descs
    with pytest.raises(ValueError, match="missing"):
        Pieces([Source(str(paths[0]))]).read(*(pa.array([0, None], pa.int64()) for _ in range(5)))


def test_the_c_readers_allocate_nothing_that_needs_the_gil_while_they_run_without_it(tmp_path: Path) -> None:
    """The scan runs without the GIL (reader threads beside DuckDB's): its columns must grow with the raw allocator.
    Under PYTHONMALLOC=debug, Python stops the process on a PyMem_Malloc-family call made without the GIL."""
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from tests.restore import test_columns as t;"
        "from backup.files import read_backup;"
        "d = Path(sys.argv[2]); rows, _ = t._scan_log(t._log(d, n=400), 0, d / 'spill');"
        "b = read_backup(t._backup(d));"
        "copies = [c for info in b.manifest['files'] for c in t._copies(b.path, info)];"
        "print(len(rows), len(copies))"
    )
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "spill").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(root), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONMALLOC": "debug"})
    assert done.returncode == 0, done.stderr[-2000:]
    records, copies = map(int, done.stdout.split())
    assert records > 1000 and copies == 50


def test_entry_ids_of_every_shape_are_held_apart_and_read_back(tmp_path: Path) -> None:
    """The readers hold an id of 24 lowercase hex digits (the ids members make) as its 12 bytes, any other id as its
    text after a marker that keeps it from being 12 bytes long: no two ids are held alike, and entry_id (and its
    SQL twin, which the plan's output uses) gives each back as it was."""
    hexed = "0123456789abcdef01234567"
    ids = [hexed, hexed.upper(), hexed[:12], bytes.fromhex(hexed).decode("latin-1").encode().decode(),
           "~" + hexed[:11], "!~" + hexed[:10], "!" + hexed[:10], "~~" + hexed[:10], hexed[:11], "é" * 6, "x", ""]
    d = tmp_path / "logs" / "QM1"
    with RecordLog(d, "QM1") as log:
        for k, eid in enumerate(ids):
            log.append(records.put(f"QM1.1.{k}", 10 + k, structure=S, gen=1, entry=Entry(eid, "Q1").wire(), data=b""))
        log.force()
    _, (tables, _) = _scan_log(d, 0, tmp_path)
    held = [e["eid"] for e in tables["ev"]]
    assert len(set(held)) == len(ids) and held[0] == bytes.fromhex(hexed)
    assert all(len(h) != 12 for h in held[1:])
    assert [entry_id(h) for h in held] == ids
    con = duckdb.connect()
    con.execute(ENTRY_ID_SQL)
    assert [t for (t,) in con.execute("SELECT entry_id(x) FROM (SELECT unnest(?::BLOB[]) AS x)", [held]).fetchall()] \
        == ids
