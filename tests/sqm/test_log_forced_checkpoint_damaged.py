"""Damage at the end of the last segment that looks like a torn write but covers a checkpoint record the manifest
lists (a bit flipped in its length, its CRC, its bytes zeroed): the checkpoint was forced before the manifest named
it, so this is corruption of forced records. The writer refuses to open the log and truncates nothing; before, it
truncated the checkpoint away as a torn tail, and the restart then failed with "no record at this position", the
damaged bytes gone. A torn tail after the checkpoint (records never forced) is still the end of the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogCorruptError, LogPosition, RecordLog
from sqm.log.format import segment_name


def _log_ending_with_a_checkpoint(d: Path) -> LogPosition:
    with RecordLog(d, "QM1") as log:
        for i in range(5):
            log.append_forced({"k": "PUT", "l": i, "d": b"x" * 50})
        return log.checkpoint({"k": "CHECKPOINT", "l": 9, "uows": {}, "n": 5, "why": "shutdown"})


def _damage(path: Path, at: LogPosition, shape: str) -> None:
    data = bytearray(path.read_bytes())
    if shape == "length":
        data[at.offset + 2] ^= 0x10  # runs past the end of the file
    elif shape == "crc":
        data[at.offset + 5] ^= 0x01
    else:
        data[at.offset + 20:] = bytes(len(data) - at.offset - 20)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("shape", ["length", "crc", "zeros"])
def test_a_damaged_forced_checkpoint_at_the_end_is_refused_not_truncated(tmp_path: Path, shape: str) -> None:
    d = tmp_path / "QM1"
    ckpt = _log_ending_with_a_checkpoint(d)
    path = d / segment_name(ckpt.segment)
    _damage(path, ckpt, shape)
    damaged = path.read_bytes()
    with pytest.raises(LogCorruptError) as caught:
        RecordLog(d, "QM1")
    assert caught.value.path == str(path) and caught.value.offset == ckpt.offset
    assert f"checkpoint record forced at byte offset {ckpt.offset}" in str(caught.value)
    assert path.read_bytes() == damaged  # nothing truncated


def test_a_torn_tail_after_the_checkpoint_is_still_the_end_of_the_log(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    ckpt = _log_ending_with_a_checkpoint(d)
    path = d / segment_name(ckpt.segment)
    with open(path, "ab") as f:
        f.write(b"\x50\x00\x00\x00\x01\x02")  # a frame never forced, cut in its header
    with RecordLog(d, "QM1") as log:
        assert log.stats.torn_bytes_truncated == 6
        found = log.last_checkpoint()
        assert found is not None and found[0] == ckpt
