"""The backup's fetch with reads in flight (cfemu.bulk: data_length read at sight, fetch_raw with FETCH_DEPTH
reads in flight): order, bounds, failures, early stops, and pacing.

Real redis-server processes throughout (descriptors as the Lua scripts and Entry.pack write them; reads slowed or
failed only by wrapping bulk's own read functions, in the fetch's worker threads)."""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Generator
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from backup.pacing import Pacer
from backup.run import run_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm

LENGTHS = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**32 + 5, 2**40, 2**53]


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("backup-fetch")]


def _put(qm: QueueManager, bodies: list[bytes], **kw: Any) -> None:
    conn = qm.connect()
    for b in bodies:
        conn.put("Q1", b, **kw)
    conn.commit()


def _ids(client: redis.Redis) -> list[str]:
    return sorted(keys.text(k) for k in client.hkeys(keys.entries("APP1")))


# --- data_length: descriptors as cmsgpack (the Lua scripts) and Entry.pack write them ----------------------------
_LUA_PACK = """
local pr = cjson.decode(ARGV[3])
return cmsgpack.pack({id = ARGV[1], q = 'Q1', mid = ARGV[4], st = 'CP', per = 1, len = tonumber(ARGV[2]), pr = pr})
"""
PROPS = {
    "none": "{}",
    "named len": '{"len": 5}',
    "valued len": '{"x": "len"}',
    "pound len": '{"x": "\\u00a3len"}',  # UTF-8 c2 a3 'len': the key's four bytes inside a value
    "both": '{"len": "len", "\\u00a3len": 7}',
}


@pytest.mark.parametrize("props", list(PROPS), ids=list(PROPS))
def test_data_length_of_descriptors_that_lua_cmsgpack_writes(redis_server: Any, redis_url: str, props: str) -> None:
    """Every width cmsgpack writes a length in (fixint .. uint 64, up to 2^53, the largest integer Lua keeps), a
    property named or valued "len", and a message id of "len" too: read at sight or decoded, always the map's own
    top-level len."""
    harness = redis_server.client()
    try:
        for n in LENGTHS:
            for mid in ("", "len"):
                raw = harness.eval(_LUA_PACK, 0, "m1", str(n), PROPS[props], mid)
                assert isinstance(raw, bytes)
                want = msgpack.unpackb(raw, raw=False)["len"]
                assert want == n and bulk.data_length(raw) == n, (n, props, mid, raw)
    finally:
        harness.close()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 65_535, 65_536])
def test_data_length_of_descriptors_put_lua_stored(qsg: tuple[redis.Redis, QueueManager], n: int) -> None:
    """The real put path (put.lua sets len = #data) with properties that put the key's bytes in the descriptor."""
    client, qm = qsg
    _put(qm, [os.urandom(n)], properties={"len": "len", "\u00a3len": 7, "x": "a\xa3len"})
    _put(qm, [os.urandom(n)])
    raws = client.hvals(keys.entries("APP1"))
    assert len(raws) == 2
    for raw in raws:
        assert isinstance(raw, bytes)
        assert bulk.data_length(raw) == n == msgpack.unpackb(raw, raw=False)["len"]


@pytest.mark.parametrize("n", LENGTHS)
def test_data_length_of_entry_pack(n: int) -> None:
    many: list[dict[str, str | int | float | bool]] = [{}, {"len": 3}, {"k": "len"}, {"\u00a3len": "\u00a3len"}]
    for props in many:
        e = Entry(id="len", queue="len", priority=0, persistent=True, msgid="len", correlid="", expiry=0,
                  put_time=0x6C656EA3, properties=props, uow="len", order=(0xA36C656E, 0xA36C656E), length=n)
        raw = e.pack()
        assert bulk.data_length(raw) == n == Entry.unpack(raw).length, (n, props)


def test_data_length_where_an_integer_field_holds_the_keys_bytes() -> None:
    """An order or time field whose big-endian bytes are a3 'l' 'e' 'n': the key's bytes appear twice, decoded."""
    for n in (0, 200, 70_000):
        raw = msgpack.packb({"id": "m", "o2": 0xA36C656E, "len": n}, use_bin_type=False)
        assert raw.count(b"\xa3len") == 2 and bulk.data_length(raw) == n


# --- fetch_raw: order, exactly once, memory ------------------------------------------------------------------------
def _jitter(monkeypatch: pytest.MonkeyPatch, seed: int, most_s: float = 0.004) -> None:
    """Reads that take a random while: replies come back out of the order they were sent in."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def slowed(read: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            with lock:
                pause = rng.uniform(0, most_s)
            time.sleep(pause)
            return read(*args)
        return run

    monkeypatch.setattr(bulk, "_descriptors", slowed(bulk._descriptors))
    monkeypatch.setattr(bulk, "_data", slowed(bulk._data))


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_parts_come_in_order_each_once_whatever_order_the_replies_arrive_in(
        qsg: tuple[redis.Redis, QueueManager], monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    client, qm = qsg
    rng = random.Random(depth)
    sizes = [rng.choice([0, 1, 100, 3 << 10, 9 << 10, 21 << 10]) for _ in range(90)]
    _put(qm, [os.urandom(n) for n in sizes])
    ids = [*_ids(client), "gone1"]
    ids.insert(17, "gone2")
    monkeypatch.setattr(bulk, "FETCH_BYTES", 20 << 10)
    want = bulk.read(client, "APP1", ids)
    _jitter(monkeypatch, depth)
    for batch in (1, 4, 7, len(ids)):
        befores: list[int] = []
        got = list(bulk.fetch_raw(client, "APP1", ids, batch=batch, depth=depth, before_read=partial(befores.append, 1)))
        assert ([d for p, _ in got for d in p], [d for _, p in got for d in p]) == want
        assert len(befores) == -(-len(ids) // batch)  # once a batch, never for a later part
        assert _fetch_threads() == []


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_first_read_goes_alone_and_before_read_never_sees_depth_in_flight(
        qsg: tuple[redis.Redis, QueueManager], monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    """The pacer's first verdict (at the second before_read) comes with nothing of the backup's in flight; every
    later before_read with fewer than `depth` reads in flight (the one it is called for is the depth-th)."""
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(30)])
    ids = _ids(client)
    lock = threading.Lock()
    running = [0]

    def counted(read: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            with lock:
                running[0] += 1
            try:
                time.sleep(0.005)
                return read(*args)
            finally:
                with lock:
                    running[0] -= 1
        return run

    monkeypatch.setattr(bulk, "_descriptors", counted(bulk._descriptors))
    monkeypatch.setattr(bulk, "_data", counted(bulk._data))
    seen: list[int] = []
    for _ in bulk.fetch_raw(client, "APP1", ids, batch=3, depth=depth, before_read=lambda: seen.append(running[0])):
        time.sleep(0.002)
    assert len(seen) == 10 and seen[:2] == [0, 0] and max(seen) <= depth - 1, seen


def test_a_fetch_of_one_part_reads_in_the_callers_thread_and_one_of_more_reads_ahead_in_the_pool(
        qsg: tuple[redis.Redis, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-part fetch (a small structure's backup) starts no thread: it costs more than the read; a fetch of
    several parts reads its first in the caller's thread too, the others on the pool's threads."""
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(6)])
    ids = _ids(client)
    threads: list[str] = []
    real = bulk._data

    def noted(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(bulk, "_data", noted)
    assert len(list(bulk.fetch_raw(client, "APP1", ids, batch=len(ids)))) == 1
    assert threads == [threading.current_thread().name]
    threads.clear()
    assert len(list(bulk.fetch_raw(client, "APP1", ids, batch=2, depth=2))) == 3
    assert threads[0] == threading.current_thread().name
    assert len(threads) == 3 and all(t.startswith("backup-fetch") for t in threads[1:]), threads
    assert _fetch_threads() == []


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_batch_size_asked_before_each_read_sizes_that_read(qsg: tuple[redis.Redis, QueueManager],
                                                              monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    """batch as a function (a paced backup's: larger on an idle CF): asked after before_read for each batch, the
    read asks for that many ids (the rest, at the end), and every id is handed over once, in order."""
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(40)])
    ids = _ids(client)
    real = bulk._descriptors
    asked: list[int] = []
    read: list[int] = []
    events: list[str] = []
    sizes = iter([3, 7, 1, 0, 5] + [9] * 10)  # 0: one id at least

    def size() -> int:
        events.append("size")
        asked.append(next(sizes))
        return asked[-1]

    def recorded(client_: Any, structure: str, chunk: Any) -> Any:
        read.append(len(chunk))
        return real(client_, structure, chunk)

    monkeypatch.setattr(bulk, "_descriptors", recorded)
    got = list(bulk.fetch_raw(client, "APP1", ids, batch=size, depth=depth, before_read=lambda: events.append("read")))
    assert read == [max(1, n) for n in asked[:-1]] + [40 - sum(max(1, n) for n in asked[:-1])]
    assert events == ["read", "size"] * len(read)
    assert [d for _, p in got for d in p] == bulk.read(client, "APP1", ids)[1]


class _Part(list[Any]):
    """A part's data list that can be watched (weakref) while it is alive."""


def test_at_most_depth_plus_one_parts_are_held(qsg: tuple[redis.Redis, QueueManager],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The docstring's bound, by counting the part lists alive whenever a reply arrives: the caller's current part
    and `depth` reads in flight (done or not), never more, with parts of two and three entries and batches of
    one part and several."""
    client, qm = qsg
    monkeypatch.setattr(bulk, "FETCH_BYTES", 10 << 10)
    _put(qm, [os.urandom(n) for n in [4 << 10, 5 << 10, 100, 11 << 10, 3 << 10] * 8])
    ids = _ids(client)
    alive: set[int] = set()
    most = [0]
    lock = threading.Lock()
    real = bulk._data

    def watched(client_: Any, structure: str, chunk: Any, size_hint: int | None = None) -> Any:
        time.sleep(0.002)
        part = _Part(real(client_, structure, chunk, size_hint))
        with lock:
            alive.add(id(part))
            most[0] = max(most[0], len(alive))
        weakref.finalize(part, alive.discard, id(part))
        return part

    monkeypatch.setattr(bulk, "_data", watched)
    for depth in (1, 2, 3):
        most[0] = 0
        gen = bulk.fetch_raw(client, "APP1", ids, batch=6, depth=depth)
        n = 0
        while True:
            try:
                descs, datas = next(gen)
            except StopIteration:
                break
            n += len(datas)
            time.sleep(0.003)  # the caller's work: the reads in flight finish meanwhile
            del descs, datas  # the caller lets its part go before it asks for the next
        assert n == len(ids)
        assert most[0] <= depth + 1, (depth, most[0])


# --- failures: a read in flight that fails, a caller that stops early, a CF that dies -----------------------------
def test_a_read_in_flight_that_fails_fails_the_fetch_at_its_turn(qsg: tuple[redis.Redis, QueueManager],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The third batch's read fails while the first is handed over: the parts before it come, in order, and then
    the error; no worker thread is left."""
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(20)])
    ids = _ids(client)
    real = bulk._descriptors
    calls = itertools.count()

    def failing(client_: Any, structure: str, chunk: Any) -> Any:
        if next(calls) == 2:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        time.sleep(0.01)
        return real(client_, structure, chunk)

    monkeypatch.setattr(bulk, "_descriptors", failing)
    got: list[Any] = []
    with pytest.raises(redis.exceptions.ConnectionError):
        for part in bulk.fetch_raw(client, "APP1", ids, batch=5):
            got.append(part)
    assert [d for _, p in got for d in p] == bulk.read(client, "APP1", ids[:10])[1]
    assert _fetch_threads() == []


def test_a_caller_that_stops_early_sends_no_more_and_leaves_no_thread(qsg: tuple[redis.Redis, QueueManager],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(40)])
    ids = _ids(client)
    real = bulk._descriptors
    sent: list[float] = []

    def slow(client_: Any, structure: str, chunk: Any) -> Any:
        sent.append(time.monotonic())
        time.sleep(0.2)
        return real(client_, structure, chunk)

    monkeypatch.setattr(bulk, "_descriptors", slow)
    gen = bulk.fetch_raw(client, "APP1", ids, batch=4)
    assert isinstance(gen, Generator)
    try:
        next(gen)
        # The first alone, then depth more in flight: submitted when next() returns, though a loaded machine may
        # start a worker's read a moment later (CI saw 2 of 3 begun at once).
        deadline = time.monotonic() + 5
        while len(sent) < 1 + bulk.FETCH_DEPTH and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(sent) == 1 + bulk.FETCH_DEPTH
        t0 = time.monotonic()
        gen.close()  # GeneratorExit at the yield: the reads in flight are waited for, none sent after
        assert time.monotonic() - t0 < 1.0
        assert len(sent) == 1 + bulk.FETCH_DEPTH and _fetch_threads() == []
    finally:
        gen.close()  # a failed check leaves no fetch thread behind for the next test to count


def test_a_cf_that_dies_mid_backup_fails_it_cleanly(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CF is killed (SIGKILL) from a read in flight, while the backup's first batch is handed over: the backup
    raises a ConnectionError, leaves no directory and no fetch thread, and a CF that comes back has no backup in
    its catalog and no running mark."""
    import backup.run

    fresh_redis = redis_factory(appendonly=True, appendfsync="always")  # what it holds survives the kill
    define_group(fresh_redis.url, queues=("Q1",))
    qm = start_qm(fresh_redis.url, tmp_path / "logs", "QM1", background=False)
    try:
        _put(qm, [b"m%d" % i for i in range(60)])
    finally:
        qm.stop()
    real = bulk._data
    calls = itertools.count()

    def killing(client_: Any, structure: str, chunk: Any, size_hint: int | None = None) -> Any:
        if next(calls) == 3:
            fresh_redis.kill()
        return real(client_, structure, chunk, size_hint)

    monkeypatch.setattr(bulk, "_data", killing)
    monkeypatch.setattr(backup.run, "END_FAILED_RETRY_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        run_backup(connect(fresh_redis.url), "APP1", tmp_path / "bk", batch=5, share=0.1)
    assert time.monotonic() - t0 < 10
    assert _fetch_threads() == []
    assert not (tmp_path / "bk" / "APP1").exists() or list((tmp_path / "bk" / "APP1").iterdir()) == []
    monkeypatch.setattr(bulk, "_data", real)
    fresh_redis.start()
    back = connect(fresh_redis.url)
    assert Admin(back).backups("APP1") == []
    assert back.hlen(keys.entries("APP1")) == 60


# --- the pacing: a busy group's CF, reads in flight during the pause ----------------------------------------------
def _timed_reads(monkeypatch: pytest.MonkeyPatch, latency_s: float) -> list[tuple[float, float]]:
    """Wrap bulk's reads: each one's (start, end); latency_s: the wait a busy CF's reply has before it is served."""
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timed(read: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.monotonic()
            try:
                time.sleep(latency_s)
                return read(*args)
            finally:
                with lock:
                    spans.append((t0, time.monotonic()))
        return run

    monkeypatch.setattr(bulk, "_descriptors", timed(bulk._descriptors))
    monkeypatch.setattr(bulk, "_data", timed(bulk._data))
    return spans


def _covered(spans: list[tuple[float, float]]) -> float:
    """The time during which at least one read was in flight."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


SHARE = 0.25


@pytest.mark.parametrize("depth", [1, 2])
def test_a_busy_groups_cf_still_paces_the_backup_to_its_share(qsg: tuple[redis.Redis, QueueManager],
                                                               monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    """backup.pacing while the group keeps the CF busy (the command count grows by 100,000 between probes), and a
    busy CF answers a read late (here 15 ms): the reads in flight cover about `share` of the time, and the paced
    fetch takes about 1/share as long as the same fetch unpaced, with reads in flight one at a time or two. (Two in
    flight read two batches in the time of one and the pacer pauses after the pair: a time share still, of a
    faster fetch.)"""
    client, qm = qsg
    _put(qm, [b"m%d" % i for i in range(160)])
    ids = _ids(client)
    spans = _timed_reads(monkeypatch, 0.015)

    def run(share: float) -> tuple[float, Pacer]:
        counts = itertools.count(0, 100_000)
        pacer = Pacer(lambda: next(counts), share)
        t0 = time.monotonic()
        for _ in bulk.fetch_raw(client, "APP1", ids, batch=8, before_read=pacer.before_read, depth=depth):
            pass
        return time.monotonic() - t0, pacer

    unpaced, _ = run(1.0)
    spans.clear()
    paced, pacer = run(SHARE)
    busy = _covered(spans) / paced
    assert pacer.stats.paused >= 10 and pacer.stats.loaded_probes >= 1
    assert busy <= SHARE * 1.6, f"reads in flight {busy:.0%} of the time, share {SHARE:.0%}"
    assert paced >= 0.6 * unpaced / SHARE, (paced, unpaced)


def _idle_backups(client_for: Callable[[], redis.Redis], tmp_path: Path, runs: int, batch: int,
                  monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Backups of an idle CF, each with a client of its own (its connections new: their handshakes are commands
    the CF counts and the backup does not call its own); the pacing of each, with the probes' verdicts."""
    import backup.run

    pacers: list[Pacer] = []

    def kept(*args: Any, **kw: Any) -> Pacer:
        pacers.append(Pacer(*args, **kw))
        return pacers[-1]

    monkeypatch.setattr(backup.run, "Pacer", kept)
    _timed_reads(monkeypatch, 0.002)  # a backup long enough for a probe every PROBE_EVERY_S, a dozen or more
    out = []
    for k in range(runs):
        c = client_for()
        try:
            m = run_backup(c, "APP1", tmp_path / f"bk{k}", batch=batch, share=0.05)
            out.append({"pauses": m["pacing"]["pauses"], "probes": pacers[-1].stats.probes,
                        "loaded": pacers[-1].stats.loaded_probes})
        finally:
            c.close()
    return out


@pytest.mark.soak  # 8-10 s: out of the default suite (`pytest -m soak tests/backup/test_fetch_depth.py`)
def test_an_idle_cf_never_pauses_the_backup_with_reads_in_flight(redis_url: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's CF (ACL users: every new connection sends AUTH and CLIENT SETINFO): a second connection for the
    second read in flight and a third for the probe meanwhile, every backup new: never taken for the group's work."""
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        _put(qm, [b"m%d" % i for i in range(6000)])
    finally:
        qm.stop()
    pacing = _idle_backups(lambda: connect(redis_url), tmp_path, 5, 10, monkeypatch)
    assert [p["pauses"] for p in pacing] == [0] * 5 and sum(p["probes"] for p in pacing) >= 20, pacing


def _idle_and_in_order(member_url: str, backup_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       seed: int, depth: int) -> None:
    """On a CF of another kind: 2,000 messages put by a member; 4 idle backups never paused; then the parts of a
    fetch with replies out of order come in order, every one once, and no fetch thread is left."""
    qm = start_qm(member_url, tmp_path / "logs", "QM1", background=False)
    try:
        _put(qm, [os.urandom(n) for n in [10, 3000, 0, 700] * 500])
    finally:
        qm.stop()
    pacing = _idle_backups(lambda: connect(backup_url), tmp_path, 4, 5, monkeypatch)
    assert [x["pauses"] for x in pacing] == [0] * 4 and sum(x["probes"] for x in pacing) >= 16, pacing
    client = connect(member_url)
    ids = _ids(client)
    monkeypatch.setattr(bulk, "FETCH_BYTES", 5000)
    want = bulk.read(client, "APP1", ids)
    _jitter(monkeypatch, seed)
    got = list(bulk.fetch_raw(client, "APP1", ids, batch=9, depth=depth))
    assert ([d for x, _ in got for d in x], [d for _, x in got for d in x]) == want
    assert _fetch_threads() == []


@pytest.mark.soak  # 8-10 s: out of the default suite (`pytest -m soak tests/backup/test_fetch_depth.py`)
def test_a_duplexed_cf_as_the_backups_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cfemu.duplex: each new connection probes the pair (INFO replication, HGET of the generation) on the primary,
    commands the pacer does not call its own; the reads in flight each on a connection of its own. Idle: never
    paused; the parts in order and every one once, whatever order the replies come in."""
    from tests.support.pair import Pair

    with Pair(tmp_path / "pair") as p:
        define_group(p.url("operator"), queues=("Q1",))
        _idle_and_in_order(p.url("member"), p.url("member"), tmp_path, monkeypatch, seed=7, depth=bulk.FETCH_DEPTH)


@pytest.mark.soak  # 8-10 s: out of the default suite (`pytest -m soak tests/backup/test_fetch_depth.py`)
def test_a_redis_cluster_cf_as_the_backups_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cfemu.rcluster: RedisCluster's per-node pools from the fetch's threads; the pacer probes the structure's
    master (node_client) while two reads are in flight there. Idle: never paused; parts in order, each once."""
    from cfemu.embedded_rcluster import EmbeddedCluster

    cl = EmbeddedCluster(tmp_path / "rcluster").start()
    try:
        Admin(connect(cl.url("operator"))).ensure_structure("APP1", ("Q1",))
        _idle_and_in_order(cl.url("member"), cl.url("backup"), tmp_path, monkeypatch, seed=11, depth=3)
    finally:
        cl.stop()
