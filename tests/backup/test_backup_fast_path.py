"""The backup's hot loop: descriptors go into the frames as the CF's msgpack bytes, persistence is
judged at sight when it can be, frames are written by a thread. Each shortcut must give the backup a decoder
cannot tell from the one decode-and-repack gave: the same frames, the same copies kept, a restorable backup."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from backup import files
from backup.files import BackupWriter, _packer, read_backup
from backup.protocol import StepCount, _persistent_at_sight, select_raw
from backup.run import run_backup
from cfemu import bulk
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import NoMessageError
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm


def _wire(i: int, **over: Any) -> dict[str, Any]:
    return {"id": f"{i:024x}", "q": "Q1", "p": i % 10, "per": 1, "mid": "m", "cid": "", "exp": 0, "pt": 1000 + i,
            "bc": 0, "pr": {"k": "v"}, "st": "CP", "l": 5000 + i, "u": "", "o1": 5000 + i, "o2": 4000 + i,
            "len": 3, **over}


def test_add_raw_writes_the_bytes_add_writes(tmp_path: Path) -> None:
    """A descriptor handed over already packed gives the same entry files, byte for byte, as add's packing,
    across the three msgpack bin headers and across rolled files."""
    sizes = [0, 1, 255, 256, 65535, 65536, 300_000]
    copies = [(_wire(i), os.urandom(n)) for i, n in enumerate(sizes * 3)]
    a = BackupWriter(tmp_path / "S" / "a", roll_bytes=200_000)
    for w, d in copies:
        a.add(3, w, d)
    b = BackupWriter(tmp_path / "S" / "b", roll_bytes=200_000)
    pack = _packer().pack
    b.add_raw(3, [(pack(w), d) for w, d in copies[:5]])
    b.add_raw(3, [(pack(w), d) for w, d in copies[5:]])
    ma, mb = a.finish({"id": "a"}), b.finish({"id": "b"})
    assert len(ma["files"]) > 2
    assert [f["blake3"] for f in ma["files"]] == [f["blake3"] for f in mb["files"]]
    for f in ma["files"]:
        assert (tmp_path / "S" / "a" / f["name"]).read_bytes() == (tmp_path / "S" / "b" / f["name"]).read_bytes()


def test_add_raw_of_whole_batches_writes_the_bytes_add_writes(tmp_path: Path) -> None:
    """Batches that fit in the current file are framed as a whole: the same files, byte for byte, as add's
    frames one by one, with batches of one size and of mixed sizes, and the files rolled between batches (a
    batch that would cross the roll is framed one by one)."""
    rng = random.Random(3)
    batches = [[(_wire(100 * b + i), os.urandom(rng.choice([0, 7, 255, 256, 1024, 70_000])))
                for i in range(rng.randrange(1, 40))] for b in range(60)]
    a = BackupWriter(tmp_path / "S" / "a", roll_bytes=1_000_000)
    b = BackupWriter(tmp_path / "S" / "b", roll_bytes=1_000_000)
    pack = _packer().pack
    for batch in batches:
        for w, d in batch:
            a.add(4, w, d)
        b.add_raw(4, [(pack(w), d) for w, d in batch])
    ma, mb = a.finish({"id": "a"}), b.finish({"id": "b"})
    assert len(ma["files"]) > 3
    assert [(f["blake3"], f["frames"]) for f in ma["files"]] == [(f["blake3"], f["frames"]) for f in mb["files"]]


def test_the_cf_bytes_read_back_as_the_wire_form(tmp_path: Path) -> None:
    """The CF's own descriptor bytes (Lua writes an empty property table as an empty array, strings in the raw
    family) read back as the decoded, repacked descriptor did: pr an empty map."""
    cf_bytes = msgpack.packb(_wire(1, pr=[], mid="x" * 40), use_bin_type=False)
    w = BackupWriter(tmp_path / "S" / "b")
    w.add_raw(2, [(cf_bytes, b"data")])
    w.finish({"id": "b", "structure": "S", "group": "G"})
    (step, wire, data), = read_backup(tmp_path / "S" / "b").frames()
    assert (step, wire, data) == (2, _wire(1, pr={}, mid="x" * 40), b"data")


def _cases() -> Iterator[dict[str, Any]]:
    yield _wire(1)
    yield _wire(2, per=0)
    yield {k: v for k, v in _wire(3).items() if k != "per"}  # no key: persistent by default
    yield {k: v for k, v in _wire(4).items() if k != "per"} | {"mid": "£per\x00"}  # the bytes in a string only
    yield {k: v for k, v in _wire(5).items() if k != "per"} | {"mid": "£per\x01"}
    yield _wire(6, per=0, mid="£per\x01")  # a string holding what a persistent key would look like
    yield _wire(7, per=0, pr={"per": 1})  # a property named per
    yield _wire(8, pr={"per": 0})
    yield _wire(9, per=True)
    yield _wire(10, per=False)
    yield _wire(11, per=2)
    yield _wire(12, per=0, cid="\udca3per\x01")  # a raw byte 0xa3, kept by surrogateescape


def test_persistence_at_sight_never_says_persistent_when_the_descriptor_is_not() -> None:
    """_persistent_at_sight answers True only where the decoded descriptor is persistent (it may answer False
    for a persistent one: the caller decodes it then), for hand-made traps and random strings full of the key's
    bytes."""
    seen = 0
    for w in _trap_cases():
        raw = msgpack.packb(w, use_bin_type=False, unicode_errors="surrogateescape")
        truth = bulk.unpack_wire(raw).get("per", 1) == 1
        if _persistent_at_sight(raw):
            assert truth, w
            seen += 1
    assert _persistent_at_sight(msgpack.packb(_wire(1), use_bin_type=False))
    assert seen > 200, "the shortcut should still take the descriptors without traps"


def _trap_cases() -> list[dict[str, Any]]:
    """Descriptors whose strings are full of the "per" key's bytes, with "per" 0, 1 or missing."""
    rng = random.Random(15)
    pieces = ["£per\x00", "£per\x01", "per", "\x01", "\x00", "a", "£"]
    cases = list(_cases())
    for i in range(3000):
        w = _wire(100 + i, per=rng.choice([0, 1, 1]),
                  mid="".join(rng.choice(pieces) for _ in range(rng.randrange(6))),
                  pr={"".join(rng.choice(pieces) for _ in range(2)): rng.choice([0, 1, "x"])})
        if rng.random() < 0.2:
            del w["per"]
        cases.append(w)
    return cases


def test_the_c_selection_takes_at_sight_what_the_python_rule_takes() -> None:
    """backup._frames' select_append asks decide of exactly the descriptors _persistent_at_sight does not take at
    sight, on the trap cases: the C search for the key is the rule's."""
    assert files._frames is not None, "backup._frames was not built (make venv)"
    raws = [msgpack.packb(w, use_bin_type=False, unicode_errors="surrogateescape") for w in _trap_cases()]
    asked: list[bytes] = []
    files._frames.select_append(bytearray(), b"\x93\x00", list(raws), [b"d"] * len(raws), 1 << 30, True,
                                lambda raw: asked.append(raw) or True)
    assert asked == [raw for raw in raws if not _persistent_at_sight(raw)]
    assert 200 < len(asked) < len(raws) - 200


def test_select_raw_keeps_and_counts_what_decoding_keeps() -> None:
    raws = [msgpack.packb(w, use_bin_type=False, unicode_errors="surrogateescape") for w in _cases()]
    descs: list[bytes | None] = [*raws, None, raws[0]]
    datas: list[bytes | None] = [b"d"] * len(raws) + [b"gone", None]
    count = StepCount()
    kept = select_raw(count, descs, datas)
    expected = [r for r in raws if bulk.unpack_wire(r).get("per", 1) == 1]
    assert [r for r, _ in kept] == expected
    assert (count.copied, count.vanished, count.skipped_nonpersistent, count.bytes) == (
        len(expected), 2, len(raws) - len(expected), len(expected))
    young = StepCount()
    assert select_raw(young, descs, datas, keep=lambda w: w["pt"] < 1005) == [
        (r, b"d") for r in expected if bulk.unpack_wire(r)["pt"] < 1005]
    assert young.excluded == len(expected) - young.copied > 0


@pytest.fixture
def qsg(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, QueueManager]]:
    client = define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield client, qm
    qm.stop()


def test_a_backup_holds_every_persistent_copy_as_the_cf_has_it(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path) -> None:
    """Against the CF itself (real redis-server, descriptors as the Lua scripts wrote them): the frames decode
    to exactly what the decoding fetch reads, for every persistent entry, properties or none, strings that hold
    the key's bytes; non-persistent ones are counted and left out."""
    client, qm = qsg
    conn = qm.connect()
    sizes = [0, 10, 1024, 70_000]
    for i in range(40):
        conn.put("Q1", os.urandom(sizes[i % 4]), persistent=i % 5 != 0, priority=i % 10,
                 properties={"per": i % 2, "n": i} if i % 3 == 0 else None,
                 msgid=f"£per\x01{i}".encode() if i % 7 == 0 else None)
    conn.commit()
    conn.put("Q2", b"uncommitted")
    manifest = run_backup(client, "APP1", tmp_path / "bk", batch=7)
    frames = list(read_backup(tmp_path / "bk" / "APP1" / manifest["id"]).frames())
    ids = [w["id"] for _, w, _ in frames]
    current = dict(zip(ids, bulk.fetch_wire(client, "APP1", ids), strict=True))
    for _, wire, data in frames:
        assert (wire, data) == current[wire["id"]]
    assert len(frames) == manifest["entries"] == 33
    assert manifest["nonpersistent_skipped"] == 8
    assert {w["q"] for _, w, _ in frames} == {"Q1", "Q2"}
    assert sum(len(d) for _, _, d in frames) == manifest["bytes"]


def _fill_every_state(client: redis.Redis, qm: QueueManager) -> int:
    """The CF holding an entry of every kind the backup's steps tell apart: committed puts of every bin head
    (0 B to 300 kB), non-persistent ones, properties and message ids that hold the "per" key's bytes, uncommitted
    puts, uncommitted gets, and expired messages. Returns the expiry sweep's count."""
    conn = qm.connect()
    sizes = [0, 1, 255, 256, 65535, 65536, 300_000]
    for i in range(60):
        conn.put("Q1" if i % 2 else "Q2", bytes([i]) * sizes[i % len(sizes)], persistent=i % 6 != 0,
                 priority=i % 10, properties={"per": i % 2, "n": i} if i % 3 == 0 else None,
                 msgid=f"£per\x01{i}".encode() if i % 7 == 0 else None)
    for i in range(5):
        conn.put("Q2", b"expires" * i, expiry_ms=1)
    conn.commit()
    held = qm.connect()  # uncommitted gets
    for _ in range(4):
        held.get("Q1")
    unc = qm.connect()  # uncommitted puts
    for i in range(6):
        unc.put("Q1", b"u" * (i * 100), persistent=i % 3 != 0)
    deadline = time.monotonic() + 30
    expired = 0
    while expired < 5 and time.monotonic() < deadline:  # the expiry times pass, then the sweep takes them
        expired += qm.expire_messages()
    return expired


def test_the_backup_selected_in_c_is_the_backup_selected_in_python(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_backup through backup._frames (select_append: selection and framing in C) and through the reference
    (select_raw, add_raw in Python) of the same CF contents: the same entry files byte for byte, the same counts
    in every step, with EXCLINT (every descriptor decoded, the caller's test asked) and without."""
    client, qm = qsg
    assert files._frames is not None, "backup._frames was not built (make venv)"
    assert _fill_every_state(client, qm) >= 5
    by_path: dict[str, list[dict[str, Any]]] = {}
    for native in (True, False):
        monkeypatch.setattr(files, "_frames", files._frames if native else None)
        manifests = [run_backup(client, "APP1", tmp_path / f"bk-{native}", batch=7, exclint_s=e) for e in (0, 3600)]
        by_path[str(native)] = manifests
        monkeypatch.undo()
    for c, py in zip(by_path["True"], by_path["False"], strict=True):
        counts = ["snapshot", "copied", "skipped_nonpersistent", "vanished", "excluded", "bytes"]
        assert [[s[k] for k in counts] for s in c["steps"]] == [[s[k] for k in counts] for s in py["steps"]]
        assert [(f["size"], f["blake3"], f["frames"]) for f in c["files"]] == [
            (f["size"], f["blake3"], f["frames"]) for f in py["files"]]
        for key in ("entries", "bytes", "nonpersistent_skipped", "excluded", "replay_from"):
            assert c[key] == py[key], key
        for fc, fp in zip(c["files"], py["files"], strict=True):
            assert ((tmp_path / "bk-True" / "APP1" / c["id"] / fc["name"]).read_bytes()
                    == (tmp_path / "bk-False" / "APP1" / py["id"] / fp["name"]).read_bytes())
    whole, young = by_path["True"]
    assert {s["state"]: s["copied"] > 0 for s in whole["steps"]} == {"UG": True, "UP": True, "CP": True, "EX": True}
    assert whole["nonpersistent_skipped"] > 0 and whole["excluded"] == 0
    assert young["entries"] == 0 and young["excluded"] == whole["entries"]


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_backup_taken_while_the_group_works_copies_each_entry_whole(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        native: bool) -> None:
    """Puts, gets, commits and backouts while the backup runs, through either path: every frame is an entry as
    it was put (its data is the one its message id names, of the length its descriptor says), every id the step's
    snapshot took is accounted for (copied, left out as non-persistent, or gone), and the backup verifies."""
    client, qm = qsg
    if not native:
        monkeypatch.setattr(files, "_frames", None)
    loader = qm.connect()

    def body(n: int) -> bytes:
        return n.to_bytes(4, "big") * (n % 700)

    for n in range(1500):
        loader.put(f"Q{1 + n % 2}", body(n), msgid=f"m{n}".encode(), persistent=n % 9 != 0)
    loader.commit()
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def work() -> None:
        conn = qm.connect()
        n = 10_000
        try:
            while not stop.is_set():
                n += 1
                conn.put("Q1", body(n), msgid=f"m{n}".encode(), persistent=n % 9 != 0)
                if n % 4 == 0:
                    conn.backout()
                else:
                    conn.commit()
                try:
                    conn.get("Q1" if n % 2 else "Q2")
                except NoMessageError:
                    continue
                conn.backout() if n % 3 == 0 else conn.commit()
                done[0] += 1
        except BaseException as e:  # surfaces in the main thread's assert
            errors.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while done[0] < 20 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        before = done[0]
        manifest = run_backup(client, "APP1", tmp_path / "bk", batch=50)
        during = done[0] - before
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert during > 0, "the group should have worked while the backup ran"
    for s in manifest["steps"]:
        assert s["snapshot"] == s["copied"] + s["skipped_nonpersistent"] + s["vanished"] + s["excluded"], s
    frames = list(read_backup(tmp_path / "bk" / "APP1" / manifest["id"]).frames())
    assert len(frames) == manifest["entries"] >= 1000
    for _, wire, data in frames:
        n = int(bytes.fromhex(wire["mid"]).rstrip(b"\x00")[1:])  # the message id, in hex
        assert data == body(n) and wire["len"] == len(data) and wire["per"] == 1, wire


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_a_disk_that_fails_under_the_backup_leaves_nothing(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        failing: str) -> None:
    """A full disk at an entry file's write (the writing thread's, past the page cache where O_DIRECT is taken)
    or an I/O error at its fsync: the backup fails with the error, ends as failed in the CF (no running mark, no
    last backup), leaves no directory, no half-file and nothing in the catalog; the next one succeeds."""
    client, qm = qsg
    conn = qm.connect()
    for _ in range(40):
        conn.put("Q1", os.urandom(100_000))
    conn.commit()
    real = getattr(os, failing)
    seen: list[int] = []

    def fails(fd: int, *args: Any) -> Any:
        path = os.readlink(f"/proc/self/fd/{fd}")  # the entry files' calls fail, no other file's
        if "entries-" not in path:
            return real(fd, *args)
        seen.append(fd)
        if failing == "write" and len(seen) < 3:  # a half-made file first
            return real(fd, *args)
        code = errno.ENOSPC if failing == "write" else errno.EIO
        raise OSError(code, os.strerror(code), Path(path).name)

    monkeypatch.setattr(files.os, failing, fails)
    with pytest.raises(OSError, match="entries-0001.bin"):
        run_backup(client, "APP1", tmp_path / "bk", batch=5)  # a write chunk (1 MiB) every few parts
    monkeypatch.undo()
    assert seen
    assert list((tmp_path / "bk" / "APP1").iterdir()) == []
    info = CF(client).structure("APP1").info()
    assert "backup" not in info and "last_backup" not in info
    assert Admin(client).backups("APP1") == []
    assert run_backup(client, "APP1", tmp_path / "bk")["entries"] == 40


def test_a_manifest_that_cannot_be_written_withdraws_the_backup_it_ended(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is written after the backup ends in the CF (it holds the end's lrsn): a disk full at it fails
    the backup, leaves no directory, and the header's last_backup names the backup before it again, not one that
    is not there."""
    client, qm = qsg
    conn = qm.connect()
    conn.put("Q1", b"x")
    conn.commit()
    first = run_backup(client, "APP1", tmp_path / "bk")
    real = os.write

    def full_at_the_manifest(fd: int, data: Any) -> int:
        if "manifest.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "manifest.json")
        return real(fd, data)

    monkeypatch.setattr(files.os, "write", full_at_the_manifest)
    with pytest.raises(OSError, match="manifest.json"):
        run_backup(client, "APP1", tmp_path / "bk")
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "bk" / "APP1").iterdir()] == [first["id"]]
    info = CF(client).structure("APP1").info()
    assert info["last_backup"] == first["id"] and "backup" not in info
    assert [b["id"] for b in Admin(client).backups("APP1")] == [first["id"]]
