"""backup._frames (backup/_frames.c) frames add_raw's whole batches in C; backup.files keeps the same framing in
Python, the reference and the fallback where the extension was not built. The two must write the same files,
byte for byte and frame by frame: whole batches, batches that cross a file's roll, batches of more than a write
chunk allows (framed one by one), every msgpack bin head."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from backup import files
from backup.files import BackupWriter, _packer, read_backup


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
    assert [(f["name"], f["size"], f["sha256"], f["frames"]) for f in c["files"]] == [
        (f["name"], f["size"], f["sha256"], f["frames"]) for f in py["files"]]
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
            seen.append([(f["size"], f["frames"], f["sha256"]) for f in m["files"]])
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
