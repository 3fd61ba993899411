"""cfemu.resp: commands packed ahead of time are the bytes redis-py would send, and their replies come back in
place (errors included), against a real redis-server."""

from __future__ import annotations

import pickle

import pytest
import redis

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


def test_a_batch_and_its_copies_carry_each_message_once_to_another_process() -> None:
    """The load's worker sends each batch with the copies of its entries for the restore point: the same data
    objects, pickled once (a joined batch carried every message's data twice)."""
    data = [bytes([i]) * 1024 for i in range(100)]
    packed = resp.Packed()
    packed.add_items(("HSET", "{S}:data"), [x for i, d in enumerate(data) for x in (f"id{i}", d)], 200)
    copies = [(b"descriptor", d) for d in data]
    assert len(pickle.dumps((packed, copies))) < 1.2 * sum(map(len, data))


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
