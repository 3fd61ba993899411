"""The backup's fetch of large messages (cfemu.bulk.read): a batch's data is read in parts of at most
bulk.FETCH_BYTES, each entry's size from its descriptor's `len` read at sight, so that a batch of two thousand
messages of 4 MiB is no longer one reply of 8 GiB. Real redis-server, descriptors as the Lua scripts write them."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from backup.files import read_backup
from backup.run import run_backup
from cfemu import bulk, keys
from sqm.core.manager import QueueManager


def _hmget_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))


def test_the_data_length_is_read_at_sight_or_decoded() -> None:
    plain = bulk.descriptor({"id": "m1", "q": "Q1", "st": "CP"}, b"x" * 70_000)
    assert bulk.data_length(plain) == 70_000
    # a property named "len" puts the key's bytes in the descriptor twice: decoded, the descriptor's own field
    named = bulk.descriptor({"id": "m2", "q": "Q1", "st": "CP", "pr": {"len": 5}}, b"y" * 300)
    assert named.count(b"\xa3len") == 2 and bulk.data_length(named) == 300
    assert bulk.data_length(bulk.descriptor({"id": "m3", "q": "Q1"}, b"")) == 0


@pytest.mark.parametrize("n", [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**40])
def test_the_data_length_read_at_sight_is_msgpacks_own_in_every_width(n: int) -> None:
    """Each unsigned form msgpack writes a length in (fixint, uint 8, 16, 32, 64), read without decoding."""
    raw = msgpack.packb({"id": "m1", "len": n, "q": "Q1"})
    assert bulk.data_length(raw) == n == msgpack.unpackb(raw)["len"]


@pytest.mark.parametrize("form", [b"\xd0\x05", b"\xd1\x00\x05", b"\xcb" + struct.pack(">d", 5.0)],
                         ids=["int 8", "int 16", "float 64"])
def test_a_length_in_another_form_is_decoded(form: bytes) -> None:
    """A writer that encodes the length as a signed integer or a float (Lua's cmsgpack may, for a number it
    holds as a double) is not read at sight: the map is decoded."""
    raw = b"\x82\xa2id\xa2m1\xa3len" + form
    assert bulk.data_length(raw) == 5


def test_a_batch_of_large_messages_is_read_in_parts(qsg: tuple[redis.Redis, QueueManager]) -> None:
    client, qm = qsg
    conn = qm.connect()
    bodies = [os.urandom(100 << 10) for _ in range(10)] + [b"small", b""]
    for b in bodies:
        conn.put("Q1", b)
    conn.commit()
    ids = sorted(k.decode() for k in client.hkeys(keys.entries("APP1")))
    assert len(ids) == 12
    whole = bulk.read(client, "APP1", ids, max_bytes=1 << 30)
    before = _hmget_calls(client)
    parts = bulk.read(client, "APP1", [*ids, "gone"], max_bytes=250 << 10)
    # the descriptors, then the data two or three messages of 100 KiB a part: six reads in all
    assert _hmget_calls(client) - before == 1 + 5
    assert parts == ([*whole[0], None], [*whole[1], None])
    assert sorted(d for d in parts[1] if d is not None) == sorted(bodies)
    assert [bulk.data_length(d) for d in parts[0] if d is not None] == [len(d or b"") for d in whole[1]]
    before = _hmget_calls(client)
    bulk.read(client, "APP1", ids)  # small enough for one part: READ_COMMANDS commands, as before
    assert _hmget_calls(client) - before == bulk.READ_COMMANDS


def test_a_backup_of_large_messages_reads_in_parts_and_copies_every_one(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client, qm = qsg
    monkeypatch.setattr(bulk, "FETCH_BYTES", 1 << 20)
    conn = qm.connect()
    bodies = [os.urandom(300 << 10) for _ in range(20)]
    for b in bodies:
        conn.put("Q1", b)
    conn.commit()
    before = _hmget_calls(client)
    manifest = run_backup(client, "APP1", tmp_path / "bk")
    frames = list(read_backup(tmp_path / "bk" / "APP1" / manifest["id"]).frames())
    assert sorted(d for _, _, d in frames) == sorted(bodies) and manifest["entries"] == 20
    assert _hmget_calls(client) - before >= 1 + 20 // 3  # the data of 20 messages of 300 KiB, 3 a part


def test_the_backups_fetch_hands_over_parts_not_whole_batches(qsg: tuple[redis.Redis, QueueManager],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The part bound holds in the backup's process too, not only in the CF's reply: fetch_raw hands its caller
    (and prefetches) one part at a time, at most FETCH_BYTES of data (or one message above it), in order. Reading
    the parts and joining them into the batch again still held a whole batch of 2,000 messages of 4 MiB, 8 GiB,
    and the next one prefetched beside it."""
    client, qm = qsg
    monkeypatch.setattr(bulk, "FETCH_BYTES", 1 << 20)
    conn = qm.connect()
    bodies = [os.urandom(300 << 10) for _ in range(20)] + [os.urandom(3 << 20), b"small"]
    for b in bodies:
        conn.put("Q1", b)
    conn.commit()
    ids = sorted(k.decode() for k in client.hkeys(keys.entries("APP1")))
    reads: list[int] = []
    got = list(bulk.fetch_raw(client, "APP1", [*ids, "gone"], batch=8, before_read=lambda: reads.append(1)))
    assert len(reads) == 3  # before each batch's read, as before: the pacing hook
    for descs, datas in got:
        assert len(descs) == len(datas)
        held = sum(len(d or b"") for d in datas)
        assert held <= 1 << 20 or len(datas) == 1, f"one hand-over held {held >> 10} KiB"
    descs = [d for part, _ in got for d in part]
    datas = [d for _, part in got for d in part]
    assert (descs, datas) == bulk.read(client, "APP1", [*ids, "gone"])
    assert sorted(d for d in datas if d is not None) == sorted(bodies)


class InFlight:
    """Wraps the CF reads of fetch_raw: each one slowed enough that reads sent together overlap; counts how many
    run at once (most), and, once `watching`, how many were running as each read started (started)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.watching = False
        self.started: list[int] = []

    def slowed(self, read: Any) -> Any:
        def timed(*args: Any) -> Any:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
                if self.watching:
                    self.started.append(self.running)
            try:
                time.sleep(0.02)
                return read(*args)
            finally:
                with self.lock:
                    self.running -= 1
        return timed


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_up_to_depth_reads_are_in_flight_and_the_parts_come_in_order(qsg: tuple[redis.Redis, QueueManager],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     depth: int) -> None:
    """The CF serves one read while this process parses another's reply: up to `depth` reads at once, each on its
    own connection, and what the caller gets is still every batch's parts in order."""
    client, qm = qsg
    monkeypatch.setattr(bulk, "FETCH_BYTES", 20 << 10)  # some batches in two parts or more
    conn = qm.connect()
    bodies = [os.urandom(n) for n in (12 << 10, 100, 15 << 10, 9 << 10, 1, 30 << 10) * 6]
    for b in bodies:
        conn.put("Q1", b)
    conn.commit()
    ids = sorted(k.decode() for k in client.hkeys(keys.entries("APP1")))
    reads = InFlight()
    monkeypatch.setattr(bulk, "_descriptors", reads.slowed(bulk._descriptors))
    monkeypatch.setattr(bulk, "_data", reads.slowed(bulk._data))
    got = list(bulk.fetch_raw(client, "APP1", ids, batch=5, depth=depth))
    assert reads.most == depth
    assert any(len(descs) < 5 for descs, _ in got[:-1])  # parts, not only whole batches
    assert ([d for part, _ in got for d in part], [d for _, part in got for d in part]) == bulk.read(client, "APP1", ids)


def test_a_depth_asked_before_each_read_is_followed(qsg: tuple[redis.Redis, QueueManager],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A paced backup's depth is the pacer's say, asked before reads are sent: two reads in flight, then, once it
    says one, every read sent after that runs alone."""
    client, qm = qsg
    conn = qm.connect()
    for k in range(40):
        conn.put("Q1", b"m%d" % k)
    conn.commit()
    ids = sorted(k.decode() for k in client.hkeys(keys.entries("APP1")))
    reads, say = InFlight(), [2]
    monkeypatch.setattr(bulk, "_descriptors", reads.slowed(bulk._descriptors))
    got = []
    for k, part in enumerate(bulk.fetch_raw(client, "APP1", ids, batch=4, depth=lambda: say[0])):
        got.append(part)
        if k == 2:
            assert reads.most == 2
            with reads.lock:
                say[0] = 1
                reads.watching = True
    # Up to two reads sent before the switch (the depth then) may start after it; every later one runs alone.
    assert len(reads.started) >= 5 and max(reads.started[2:]) == 1, reads.started
    assert ([d for p, _ in got for d in p], [d for _, p in got for d in p]) == bulk.read(client, "APP1", ids)


def test_a_depth_that_shrinks_inside_a_batch_of_parts_still_hands_every_part_over(
        qsg: tuple[redis.Redis, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """The next batches' reads already fill the shrunk depth when a batch of several parts is being handed over:
    its next part still goes out (else there is no read of it to wait for)."""
    client, qm = qsg
    monkeypatch.setattr(bulk, "FETCH_BYTES", 20 << 10)
    conn = qm.connect()
    for _ in range(24):
        conn.put("Q1", os.urandom(15 << 10))  # batches of 4 in 4 parts of one message each
    conn.commit()
    ids = sorted(k.decode() for k in client.hkeys(keys.entries("APP1")))
    say = [2]
    got = []
    for k, part in enumerate(bulk.fetch_raw(client, "APP1", ids, batch=4, depth=lambda: say[0])):
        got.append(part)
        if k == 4:  # the second batch's first part: its second part and the third batch's first read are in flight
            say[0] = 1
    assert len(got) > len(ids) // 4
    assert ([d for p, _ in got for d in p], [d for _, p in got for d in p]) == bulk.read(client, "APP1", ids)
