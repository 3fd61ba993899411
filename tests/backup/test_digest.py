"""The entry files' digest (backup/digest.py): what each format carries, and a reader's frames hashed in pieces
large enough for BLAKE3 to run at its speed."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import blake3
import pytest

from backup import digest
from backup.files import BackupWriter, verify


def test_each_format_names_its_digest_and_a_record_holds_exactly_one() -> None:
    assert [digest.digest_of_format(f) for f in (1, 2, 3, 4, "3", None)] == [
        "sha256", "sha256", "blake3", None, None, None]
    assert digest.signed_format([{"blake3": "a" * 64}]) == 3 and digest.signed_format([{"sha256": "a" * 64}]) == 2
    assert digest.file_digest({"name": "x", "blake3": "0f" * 32}) == ("blake3", "0f" * 32)
    for bad in ({"name": "x"}, {"name": "x", "blake3": "0" * 64, "sha256": "0" * 64}, {"name": "x", "blake3": "0F" * 32},
                {"name": "x", "blake3": "0" * 63}, {"name": "x", "sha256": 7}):
        with pytest.raises(ValueError, match="not one well-formed digest"):
            digest.file_digest(bad)


@pytest.mark.parametrize("name,reference", [("blake3", blake3.blake3), ("sha256", hashlib.sha256)])
def test_gathered_pieces_give_the_digest_of_the_whole(name: str, reference: Any) -> None:
    rng = random.Random(7)
    data = rng.randbytes(1_300_000)
    g = digest.Gathered(name)
    at = 0
    while at < len(data):
        n = rng.choice((0, 1, 8, 1150, 70_000, 300_000))
        g.update(memoryview(data)[at:at + n])
        at += n
    assert g.hexdigest() == reference(data).hexdigest()


def test_a_reader_hashes_an_entry_file_in_large_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader of a backup (verify, the local and Spark engines) goes frame by frame: its hasher is handed
    pieces of at least GATHER_BYTES, all but the last, and the file's digest is still the manifest's."""
    w = BackupWriter(tmp_path / "APP1" / "b", roll_bytes=10**9)
    for i in range(2_000):
        w.add(3, {"id": f"e{i:06d}", "q": "Q1", "per": 1}, random.Random(i).randbytes(1_000))
    w.finish({"id": "b", "group": "QSG1", "structure": "APP1", "entries": 2_000, "start_lrsn": 1})
    sizes: list[int] = []

    class Recording:
        def __init__(self) -> None:
            self.h = blake3.blake3()

        def update(self, data: Any) -> None:
            sizes.append(len(data))
            self.h.update(data)

        def hexdigest(self) -> str:
            return str(self.h.hexdigest())

    monkeypatch.setitem(digest._NEW, "blake3", Recording)
    verify(tmp_path / "APP1" / "b")
    assert sum(sizes) > 2 * digest.Gathered.GATHER_BYTES
    assert min(sizes[:-1]) >= digest.Gathered.GATHER_BYTES, sizes[:10]
