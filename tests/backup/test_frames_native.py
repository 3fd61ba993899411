"""backup._frames (backup/_frames.c) frames add_raw's whole batches in C, and selects and frames a fetched part in
one pass (add_selected); backup.files and backup.protocol keep the same framing and selection in Python, the
reference and the fallback where the extension was not built. The two must write the same files, byte for byte
and frame by frame: whole batches, batches that cross a file's roll, batches of more than a write chunk allows
(framed one by one), every msgpack bin head, every kind of descriptor the selection tells apart."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import blake3
import pytest

from backup import files
from backup.files import BackupWriter, _packer, read_backup
from backup.protocol import StepCount, select_raw, write_part
from cfemu.bulk import Bulks
from tests.support.bulks import bulks_of


def _wire(i: int) -> dict[str, Any]:
    return {"id": f"{i:024x}", "q": "Q1", "p": i % 10, "per": 1, "mid": f"m{i}", "cid": "", "exp": 0,
            "pt": 1000 + i, "bc": 0, "pr": {"k": "v"} if i % 3 else {}, "st": "CP", "l": 5000 + i, "u": "",
            "o1": 5000 + i, "o2": 4000 + i, "len": 3}


def _batches() -> list[list[tuple[bytes, bytes]]]:
    """Batches of mixed sizes (0 B to 300 kB: each bin head), a few of more than 4 MiB, rolled files between."""
    rng = random.Random(7)
    pack = _packer().pack
    sizes = [0, 1, 255, 256, 1024, 65535, 65536, 300_000]
    out = [[(pack(_wire(100 * b + i)), os.urandom(rng.choice(sizes))) for i in range(rng.randrange(1, 40))]
           for b in range(50)]
    big = [(pack(_wire(9000 + i)), os.urandom(300_000)) for i in range(15)]  # 4.5 MB: over a whole batch's bound
    return out[:10] + [big] + out[10:30] + [big] + out[30:]


def _write(directory: Path, batches: list[list[tuple[bytes, bytes]]], step: int) -> dict[str, Any]:
    w = BackupWriter(directory, roll_bytes=3_000_000)
    for batch in batches:
        w.add_raw(step, batch)
    return w.finish({"id": directory.name, "structure": "S", "group": "G"})


def test_the_extension_is_built_with_the_package() -> None:
    assert files._frames is not None, "backup._frames was not built: make venv (pip install -e .) builds it"


@pytest.mark.parametrize("step", [0, 3, 5])
def test_c_and_python_framing_write_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   step: int) -> None:
    batches = _batches()
    c = _write(tmp_path / "S" / "c", batches, step)
    monkeypatch.setattr(files, "_frames", None)
    py = _write(tmp_path / "S" / "py", batches, step)
    assert len(c["files"]) > 3, "the batches should roll the entry files"
    assert [(f["name"], f["size"], f["blake3"], f["frames"]) for f in c["files"]] == [
        (f["name"], f["size"], f["blake3"], f["frames"]) for f in py["files"]]
    for f in c["files"]:
        assert (tmp_path / "S" / "c" / f["name"]).read_bytes() == (tmp_path / "S" / "py" / f["name"]).read_bytes()
    frames_c = list(read_backup(tmp_path / "S" / "c").frames())
    assert frames_c == list(read_backup(tmp_path / "S" / "py").frames())
    assert len(frames_c) == sum(map(len, batches))
    assert [d for _, _, d in frames_c] == [d for batch in batches for _, d in batch]


def test_a_batch_that_fits_exactly_is_framed_whole_and_one_byte_over_rolls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is the same in C and in Python: a batch that ends exactly at roll_bytes stays in the file, one
    byte more moves its frames to the next one."""
    pack = _packer().pack
    first = [(pack(_wire(1)), b"x" * 1000)]
    probe = BackupWriter(tmp_path / "S" / "probe")
    probe.add_raw(2, first)
    size = probe._size
    probe.add_raw(2, first)
    one = probe._size - size
    probe.abort()
    native = files._frames
    for short, entry_files in ((0, 1), (1, 2)):
        seen = []
        for mod in (native, None):
            monkeypatch.setattr(files, "_frames", mod)
            d = tmp_path / "S" / f"{short}-{mod is None}"
            w = BackupWriter(d, roll_bytes=size + 3 * one - short)
            w.add_raw(2, first)
            w.add_raw(2, first * 3)
            m = w.finish({"id": d.name})
            seen.append([(f["size"], f["frames"], f["blake3"]) for f in m["files"]])
        assert seen[0] == seen[1]
        assert len(seen[0]) == entry_files


def test_without_the_extension_the_backup_is_framed_in_python(tmp_path: Path) -> None:
    """Installed where no C compiler was: backup._frames cannot be imported, backup.files frames in Python, and
    the backup reads back whole."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["backup._frames"] = None  # what an install without the extension gives: an ImportError
        from pathlib import Path
        from cfemu import credentials
        from backup import files
        assert files._frames is None
        keys = credentials.backup_keys(Path({str(tmp_path / "secrets")!r}))
        w = files.BackupWriter(Path({str(tmp_path / "S" / "b")!r}), backup_keys=keys)
        pack = files._packer().pack
        w.add_raw(3, [(pack({{"id": str(i)}}), bytes([i]) * i) for i in range(200)])
        w.add_raw(3, [(pack({{"id": str(i)}}), bytes([i]) * i) for i in range(200, 256)])
        w.finish({{"id": "b"}})
        frames = list(files.read_backup(Path({str(tmp_path / "S" / "b")!r}), backup_keys=keys).frames())
        assert [d for _, _, d in frames] == [bytes([i]) * i for i in range(256)], frames[:3]
        print("framed in python", len(frames))
    """)
    from cfemu import credentials
    credentials.create_backup_key(tmp_path / "secrets")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "framed in python 256"


# --- select_append: a fetched part selected and framed in one pass (backup.protocol.write_part) -----------------
def _fetched_parts() -> list[tuple[list[bytes | None], list[bytes | None]]]:
    """Parts as the fetch hands them over: persistent descriptors as the CF writes them, and every kind the
    selection must tell apart (not persistent, no "per" key, the key's bytes in a string or a property, gone
    entries: a None descriptor or data), data of every bin head, a few parts of more than a write chunk."""
    rng = random.Random(11)
    pack = _packer().pack
    sizes = [0, 1, 255, 256, 1024, 65535, 65536, 300_000]

    def desc(i: int) -> bytes:
        w = _wire(i)
        kind = rng.randrange(9)
        if kind == 1:
            w["per"] = 0
        elif kind == 2:
            del w["per"]
        elif kind == 3:
            w["mid"] = "\udca3per\x01"  # a raw byte 0xa3 (surrogateescape): the key's bytes in a string
        elif kind == 4:
            w["pr"] = {"per": rng.choice([0, 1])}
        elif kind == 5:
            w["per"] = rng.choice([True, False, 2])
        return pack(w)

    parts: list[tuple[list[bytes | None], list[bytes | None]]] = []
    for b in range(60):
        n = rng.randrange(0, 40)
        descs: list[bytes | None] = [desc(100 * b + i) for i in range(n)]
        datas: list[bytes | None] = [os.urandom(rng.choice(sizes)) for _ in range(n)]
        for i in range(n):
            if rng.random() < 0.1:
                (descs if rng.random() < 0.5 else datas)[i] = None
        parts.append((descs, datas))
    big = ([pack(_wire(90_000 + i)) for i in range(15)], [os.urandom(300_000) for _ in range(15)])
    return parts[:10] + [big] + parts[10:40] + [big] + parts[40:]  # type: ignore[list-item]


def _write_parts(directory: Path, parts: list[tuple[list[bytes | None], list[bytes | None]]], step: int,
                 keep: Any, *, as_read: bool = False) -> tuple[dict[str, Any], list[StepCount]]:
    """as_read: each part's data as the fetch reads them from the CF's socket (Bulks: the reply's bytes)."""
    w = BackupWriter(directory, roll_bytes=3_000_000)
    counts = []
    for descs, datas in parts:
        count = StepCount()
        write_part(w, step, count, list(descs), bulks_of(datas) if as_read else list(datas), keep)
        counts.append(count)
    return w.finish({"id": directory.name, "structure": "S", "group": "G"}), counts


@pytest.mark.parametrize("as_read", [False, True], ids=["data as bytes", "data in the reply's bytes (Bulks)"])
@pytest.mark.parametrize("exclint", [False, True], ids=["at sight", "every descriptor decoded (EXCLINT)"])
def test_selecting_in_c_writes_what_select_raw_and_add_raw_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 exclint: bool, as_read: bool) -> None:
    """The C pass (add_selected) and the reference (select_raw, then add_raw framed in Python) keep the same
    copies, count them alike, and write the same files byte for byte, across rolled files and parts of more than
    a write chunk; the C pass also from data left in a reply's bytes (cfemu.bulk.Bulks)."""
    parts = _fetched_parts()
    keep = (lambda wire: wire["pt"] % 3 != 0) if exclint else None
    assert BackupWriter(tmp_path / "S" / "probe").selects_natively
    c, c_counts = _write_parts(tmp_path / "S" / "c", parts, 3, keep, as_read=as_read)
    monkeypatch.setattr(files, "_frames", None)
    py, py_counts = _write_parts(tmp_path / "S" / "py", parts, 3, keep)
    assert c_counts == py_counts
    total = StepCount()
    for k in c_counts:
        total.copied, total.vanished = total.copied + k.copied, total.vanished + k.vanished
        total.skipped_nonpersistent += k.skipped_nonpersistent
        total.excluded += k.excluded
    assert total.copied > 500 and total.vanished > 20 and total.skipped_nonpersistent > 50
    assert (total.excluded > 50) == exclint
    assert len(c["files"]) > 3, "the parts should roll the entry files"
    assert [(f["name"], f["size"], f["blake3"], f["frames"]) for f in c["files"]] == [
        (f["name"], f["size"], f["blake3"], f["frames"]) for f in py["files"]]
    for f in c["files"]:
        assert (tmp_path / "S" / "c" / f["name"]).read_bytes() == (tmp_path / "S" / "py" / f["name"]).read_bytes()
    kept = [(raw, d) for descs, datas in parts for raw, d in select_raw(StepCount(), descs, datas, keep)]
    assert [d for _, _, d in read_backup(tmp_path / "S" / "c").frames()] == [d for _, d in kept]


def test_selecting_in_c_asks_the_decider_once_an_entry_and_passes_on_its_error(tmp_path: Path) -> None:
    """decide is asked only of descriptors not persistent at sight, once each, also where the part is then framed
    frame by frame; an error it raises comes out of add_selected with nothing of the part written."""
    pack = _packer().pack
    plain, odd = pack(_wire(1)), pack({**_wire(2), "per": 0})
    w = BackupWriter(tmp_path / "S" / "b")
    asked: list[bytes] = []

    def decide(raw: bytes) -> bool:
        asked.append(raw)
        return False

    big = os.urandom(3 << 20)
    assert w.add_selected(2, [plain, odd, plain, None], [big, b"x", big, b"y"], decide) == (2, 2 * len(big), 1)
    assert asked == [odd]
    size = w._size

    def broken(raw: bytes) -> bool:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        w.add_selected(2, [plain, odd], [b"a", b"b"], broken)
    assert w._size == size
    with pytest.raises(TypeError, match="bytes or None"):
        w.add_selected(2, [plain, "text"], [b"a", b"b"], decide)  # type: ignore[list-item]
    w.abort()


def test_selecting_in_c_refuses_data_spans_outside_their_reply(tmp_path: Path) -> None:
    """Data given as a reply's bytes and spans whose span points past the bytes (or is negative, or the count of
    spans is not the count of descriptors) are refused with a clear error, and nothing of the part is written."""
    plain = _packer().pack(_wire(1))
    w = BackupWriter(tmp_path / "S" / "b")
    good = bulks_of([b"abc", None])
    assert w.add_selected(2, [plain, plain], good, lambda raw: True) == (1, 3, 1)
    size = w._size
    for spans in ([1, 3, 1, 9], [-1, 2, 0, -1], [2, -3, 0, -1], [2**62, 1, 0, -1]):
        with pytest.raises(ValueError, match="outside the reply"):
            w.add_selected(2, [plain, plain], Bulks(good.blob, struct.pack("=4q", *spans)), lambda raw: True)
    with pytest.raises(ValueError, match="2 descriptors and 1 data"):
        w.add_selected(2, [plain, plain], bulks_of([b"x"]), lambda raw: True)
    assert w._size == size
    w.abort()


# --- the entry files written with O_DIRECT ------------------------------------------------------------------
def _direct_write(directory: Path, batches: list[list[tuple[bytes, bytes]]]) -> tuple[dict[str, Any], list[bool]]:
    w = BackupWriter(directory, roll_bytes=3_000_000)
    direct = []
    for batch in batches:
        w.add_raw(2, batch)
        if w._file is not None:
            direct.append(w._file.direct)
    return w.finish({"id": directory.name, "structure": "S", "group": "G"}), direct


def test_entry_files_written_past_the_page_cache_hold_the_same_bytes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Written with O_DIRECT (whole blocks from an aligned buffer, the last bytes through the page cache), through
    the page cache, or with O_DIRECT refused at the first write (a file system that takes the flag at the open
    and not at a write): the same files, byte for byte, each of them read back whole."""
    if not files._DIRECT:
        pytest.skip("no O_DIRECT on this system: the page cache is the only path")
    batches = _batches()
    direct, seen = _direct_write(tmp_path / "S" / "direct", batches)
    assert any(seen), "the test's file system should take O_DIRECT (ext4, xfs; tmpfs from Linux 6.6)"
    monkeypatch.setattr(files, "_DIRECT", 0)
    cached, seen = _direct_write(tmp_path / "S" / "cached", batches)
    assert not any(seen)
    monkeypatch.undo()
    refusals = []
    real_write = os.write

    def refusing(fd: int, data: Any) -> int:
        if not refusals and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", refusing)
    refused, _ = _direct_write(tmp_path / "S" / "refused", batches)
    assert refusals
    monkeypatch.undo()
    assert len(direct["files"]) > 3
    for other in (cached, refused):
        assert [(f["name"], f["size"], f["blake3"]) for f in direct["files"]] == [
            (f["name"], f["size"], f["blake3"]) for f in other["files"]]
    for f in direct["files"]:
        data = (tmp_path / "S" / "direct" / f["name"]).read_bytes()
        assert len(data) == f["size"]
        assert data == (tmp_path / "S" / "cached" / f["name"]).read_bytes()
        assert data == (tmp_path / "S" / "refused" / f["name"]).read_bytes()
    assert list(read_backup(tmp_path / "S" / "direct").frames()) == list(read_backup(tmp_path / "S" / "cached").frames())


def _same_files(directory: Path, reference: Path, manifest: dict[str, Any]) -> None:
    """Every entry file the manifest lists holds what the reference backup's does, and its sha256 and size."""
    for f in manifest["files"]:
        data = (directory / f["name"]).read_bytes()
        assert len(data) == f["size"]
        assert blake3.blake3(data).hexdigest() == f["blake3"]
        assert data == (reference / f["name"]).read_bytes()


def _written_through_the_page_cache(directory: Path, batches: list[list[tuple[bytes, bytes]]],
                                    monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The manifest of ``batches`` written with O_DIRECT off: what a file system without it gets (the test is
    skipped where this system has no O_DIRECT: the page cache is then the only path)."""
    if not files._DIRECT:
        pytest.skip("no O_DIRECT on this system: the page cache is the only path")
    monkeypatch.setattr(files, "_DIRECT", 0)
    cached, _ = _direct_write(directory, batches)
    monkeypatch.undo()
    return cached


def test_a_file_system_that_refuses_o_direct_at_the_open_gets_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux creates the file of an open with O_CREAT and O_DIRECT before it finds that the file system has no
    O_DIRECT (EINVAL: tmpfs before 6.6, some FUSE and network file systems), and fcntl refuses the flag the same
    way: the entry files are then written through the page cache, the same bytes, and the backup is not refused
    for a file that exists already."""
    batches = _batches()
    cached = _written_through_the_page_cache(tmp_path / "S" / "cached", batches, monkeypatch)
    real_open, real_fcntl = os.open, fcntl.fcntl
    refused: list[str] = []

    def open_without_direct(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if flags & os.O_DIRECT:  # what the kernel does: the file is made, then the flag refused
            os.close(real_open(path, flags & ~os.O_DIRECT, mode, **kw))
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    def fcntl_without_direct(fd: int, cmd: int, arg: int = 0) -> Any:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refused.append(f"fd {fd}")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(os, "open", open_without_direct)
    monkeypatch.setattr(fcntl, "fcntl", fcntl_without_direct)
    manifest, seen = _direct_write(tmp_path / "S" / "nodirect", batches)
    monkeypatch.undo()
    assert refused and not any(seen)
    assert [(f["name"], f["size"], f["blake3"]) for f in manifest["files"]] == [
        (f["name"], f["size"], f["blake3"]) for f in cached["files"]]
    _same_files(tmp_path / "S" / "nodirect", tmp_path / "S" / "cached", manifest)


def test_an_o_direct_write_refused_after_a_short_write_goes_on_from_where_it_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write may write less than asked; when the write of the rest is then refused (EINVAL) and the page cache
    takes over, it writes the rest, not the whole again: the file holds each byte once, as its sha256 says."""
    batches = _batches()
    cached = _written_through_the_page_cache(tmp_path / "S" / "cached", batches, monkeypatch)
    real_write = os.write
    calls: list[str] = []

    def short_then_refused(fd: int, data: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and len(calls) < 2 and len(data) > 4096:
            calls.append("short" if not calls else "refused")
            if len(calls) == 1:
                return real_write(fd, memoryview(data)[:4096])
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", short_then_refused)
    manifest, seen = _direct_write(tmp_path / "S" / "short", batches)
    monkeypatch.undo()
    assert calls == ["short", "refused"] and seen[0]
    assert [(f["name"], f["size"], f["blake3"]) for f in manifest["files"]] == [
        (f["name"], f["size"], f["blake3"]) for f in cached["files"]]
    _same_files(tmp_path / "S" / "short", tmp_path / "S" / "cached", manifest)
    assert list(read_backup(tmp_path / "S" / "short").frames()) == list(read_backup(tmp_path / "S" / "cached").frames())
