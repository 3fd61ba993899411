"""cfemu.resp: commands packed ahead of time are the bytes redis-py would send, and their replies come back in
place (errors included), against a real redis-server."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from cfemu import resp
from cfemu.embedded import EmbeddedRedis


def test_packed_commands_are_the_bytes_redis_py_sends(redis_url: str) -> None:
    commands: list[tuple[bytes | str | int, ...]] = [
        ("HSET", "{S}:entries", "id1", b"\x00\xff\r\n", "idé", ""),
        ("SADD", "k", "a"),
        ("ZADD", "{S}:expiry", 1700000000000, "id1", -5, "id2"),
        ("RPUSH", "l", *[f"m{i}" for i in range(300)]),
    ]
    packed = resp.Packed()
    for c in commands:
        packed.add(*c)
    conn = redis.Redis.from_url(redis_url).connection_pool.get_connection()
    assert packed.data() == b"".join(conn.pack_commands([c for c in commands]))
    assert packed.count == len(commands)
    copy = pickle.loads(pickle.dumps(packed))
    assert copy.data() == packed.data() and copy.count == packed.count


def test_pairs_and_short_commands_are_the_bytes_redis_py_sends(redis_url: str) -> None:
    """The load's own encodings (add_pairs: HSET's fields and values, two parts a pair; add_commands: SADD and
    RPUSH through hiredis, one part) send what redis-py's hset(mapping=...), sadd and rpush would."""
    ids = ["id1", "idé", "", "x" * 300]
    values = [b"\x00\xff\r\n", b"", bytearray(b"ba"), b"v" * 20_000]
    packed = resp.Packed()
    packed.add_pairs(("HSET", "{S}:data"), ids, values)  # type: ignore[arg-type]
    packed.add_commands([("SADD", "{S}:m:" + i, i) for i in ids] + [(b"RPUSH", "l", *ids)])
    conn = redis.Redis.from_url(redis_url).connection_pool.get_connection()
    expected = [("HSET", "{S}:data", *(x for i, v in zip(ids, values) for x in (i, bytes(v)))),
                *[("SADD", "{S}:m:" + i, i) for i in ids], ("RPUSH", "l", *ids)]
    assert packed.data() == b"".join(conn.pack_commands(expected))
    assert packed.count == len(expected)
    client = redis.Redis.from_url(redis_url)
    client.delete("{S}:data", "l", *("{S}:m:" + i for i in ids))
    replies = resp.exchange(conn, packed.chunks(), packed.count)
    assert replies[0] == len(ids) and client.hget("{S}:data", "idé") == b""
    assert client.hget("{S}:data", "x" * 300) == b"v" * 20_000
    assert client.lrange("l", 0, -1) == [i.encode() for i in ids]
    empty = resp.Packed()
    empty.add_pairs((b"HSET", "h"), [], [])
    assert empty.data() == b"".join(conn.pack_commands([("HSET", "h")]))
    with pytest.raises(ValueError, match="2 fields and 1 values"):
        resp.Packed().add_pairs(("HSET", "h"), ["a", "b"], [b"1"])
    with pytest.raises(TypeError):
        resp.Packed().add_commands([("SADD", "k", True)])  # type: ignore[list-item]


def test_a_batch_and_its_copies_carry_each_message_once_to_another_process() -> None:
    """The load's worker sends each batch with the copies of its entries for the restore point: the same data
    objects, pickled once (a joined batch carried every message's data twice)."""
    data = [bytes([i]) * 1024 for i in range(100)]
    packed = resp.Packed()
    packed.add_items(("HSET", "{S}:data"), [x for i, d in enumerate(data) for x in (f"id{i}", d)], 200)
    copies = [(b"descriptor", d) for d in data]
    assert len(pickle.dumps((packed, copies))) < 1.2 * sum(map(len, data))
    pairs = resp.Packed()
    pairs.add_pairs(("HSET", "{S}:data"), [f"id{i}" for i in range(100)], data)
    assert len(pickle.dumps((pairs, copies))) < 1.2 * sum(map(len, data))


def test_a_command_is_refused_when_its_arguments_are_miscounted_or_of_another_type() -> None:
    with pytest.raises(ValueError, match="said 3 arguments and had 2"):
        resp.Packed().add_items(("SADD", "k"), ["a", "b"], 3)
    with pytest.raises(TypeError, match="bytes, str or int, not float"):
        resp.Packed().add("SET", "k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not bool"):
        resp.Packed().add("SET", "k", True)


def test_exchange_returns_every_reply_in_place_errors_included(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.delete("resp:s", "resp:str")
    client.set("resp:str", "x")
    packed = resp.Packed()
    packed.add("SADD", "resp:s", "a", "b")
    packed.add("SADD", "resp:str", "a")  # WRONGTYPE
    packed.add("SMEMBERS", "resp:s")
    conn = client.connection_pool.get_connection()
    conn.connect()
    try:
        replies = resp.exchange(conn, packed.data(), packed.count)
        assert replies[0] == 2 and sorted(replies[2]) == [b"a", b"b"]
        assert isinstance(replies[1], redis.exceptions.ResponseError) and "WRONGTYPE" in str(replies[1])
        assert conn.send_command("PING") is None and conn.read_response() in (b"PONG", "PONG")  # still in step
    finally:
        client.connection_pool.release(conn)


def test_exchange_on_a_dead_server_raises_redis_pys_connection_error(fresh_redis: EmbeddedRedis) -> None:
    conn = fresh_redis.client().connection_pool.get_connection()
    conn.connect()
    fresh_redis.kill()
    packed = resp.Packed()
    packed.add("PING", "x")
    with pytest.raises(redis.exceptions.ConnectionError):
        resp.exchange(conn, packed.data(), 1)
    assert conn._sock is None  # disconnected: whether the commands ran is unknown


_args = st.one_of(st.text(max_size=6), st.binary(max_size=6), st.sampled_from(["é" * 40, "x" * 300, "bad\udcff"]))


@settings(max_examples=200, deadline=None, database=None)
@given(fields=st.lists(st.one_of(_args, st.integers(-5, 5)), max_size=6), values=st.lists(
    st.one_of(st.binary(max_size=20), st.just(bytearray(b"ba"))), max_size=6),
    groups=st.dictionaries(_args, st.lists(st.one_of(_args, st.integers(0, 3)), max_size=4), max_size=4))
def test_pairs_and_groups_packed_in_c_are_packed_as_in_python(fields: list[Any], values: list[Any],
                                                              groups: dict[Any, list[Any]]) -> None:
    """add_pairs and add_groups give the same parts whether cfemu/_bulk.c packs them (str and bytes) or Python does
    (any argument), and raise the same error where Python raises one."""
    values = values[:len(fields)] + [b"v"] * (len(fields) - len(values))

    def packed() -> list[Any]:
        p = resp.Packed()
        out: list[Any] = []
        for add in (lambda: p.add_pairs((b"HSET", "h"), fields, values), lambda: p.add_groups(b"SADD", groups)):
            try:
                add()
                out.append(None)
            except Exception as e:  # noqa: BLE001 - compared with the other path's
                out.append(type(e))
        return [p.parts, p.count, out]

    in_c = packed()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resp, "_bulk", None)
        assert packed() == in_c
