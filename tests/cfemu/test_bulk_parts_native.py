"""cfemu._bulk (cfemu/_bulk.c) tells the parts in which a fetched batch's data is read, and packs the fetch's HMGETs,
in C; cfemu.bulk keeps the same rule in Python (parts_in_python) and packs with hiredis where the extension was
not built. Both must answer the same parts for every batch: lengths read at sight in every msgpack width, descriptors that must be
decoded (a "len" property, a signed or float length), gone entries, every limit around the sizes."""

from __future__ import annotations

import random
import struct
from typing import Any

import hiredis
import msgpack
import pytest
import redis

from cfemu import bulk


def _descriptor(rng: random.Random, i: int) -> bytes | None:
    kind = rng.randrange(8)
    if kind == 0:
        return None  # gone
    n = rng.choice([0, 1, 127, 128, 255, 256, 1024, 65_535, 65_536, 300_000, 2**32, 2**40])
    w: dict[str, Any] = {"id": f"{i:024x}", "q": "Q1", "per": 1, "len": n, "pr": {}}
    if kind == 1:
        w["pr"] = {"len": rng.randrange(10)}  # the key's bytes twice: decoded
    elif kind == 2:
        w["mid"] = "\udca3len"  # the key's bytes in a string (surrogateescape: a raw byte 0xa3)
    if kind == 3:  # a signed or float length: not read at sight
        head = msgpack.packb({"id": f"{i:024x}"})
        form = rng.choice([b"\xd0\x05", b"\xd1\x00\x05", b"\xcb" + struct.pack(">d", 5.0)])
        return bytes([head[0] + 1]) + head[1:] + b"\xa3len" + form
    if kind == 4:
        del w["len"]
    return msgpack.packb(w, use_bin_type=False, unicode_errors="surrogateescape")


def test_the_extension_is_built_with_the_package() -> None:
    assert bulk._bulk is not None, "cfemu._bulk was not built: make venv (pip install -e .) builds it"


@pytest.mark.parametrize("seed", range(4))
def test_c_and_python_tell_the_same_parts(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        descs = [_descriptor(rng, i) for i in range(rng.randrange(0, 60))]
        for limit in (0, 1, 255, 1024, 70_000, 1 << 20, bulk.FETCH_BYTES, 2**41, 2**61 - 1):
            assert bulk.parts(descs, limit) == bulk.parts_in_python(descs, limit), (descs, limit)


def test_a_length_only_decoding_tells_is_asked_of_data_length() -> None:
    """A descriptor whose length cannot be read at sight goes to the decoding reader: what it raises comes out."""
    bad = b"\x81\xa3len\xa1x"  # a length that is not a number
    with pytest.raises(ValueError):
        bulk.parts_in_python([bad], 10)
    with pytest.raises(ValueError):
        bulk.parts([bad], 10)


@pytest.mark.parametrize("fields", [[], ["a"], [b"x" * 24, "\u00e9t\u00e9", b"", "", b"\r\n$3"], [f"{i:024x}" for i in range(2000)],
                                    [bytes([i]) * i for i in range(256)]])
def test_a_fetchs_hmget_is_packed_as_hiredis_packs_it(fields: list[bytes | str]) -> None:
    """cfemu._bulk.pack_args gives the bytes hiredis.pack_command gives the same HMGET (str as UTF-8, bytes as
    they are), and refuses what it refuses."""
    conn = redis.Redis().connection_pool.make_connection()
    assert bulk._pack_hmget(conn, "cf:APP1:e", fields) == [hiredis.pack_command(("HMGET", "cf:APP1:e", *fields))]
    with pytest.raises(TypeError, match="argument 1 is int"):
        bulk._bulk.pack_args(["a", 5])
