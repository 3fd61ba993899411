"""cfemu.bulk's ownership of a structure (claim, Owner.transaction) against a real redis-server: a claim refuses a
structure that changed since the restore saw it; a later claim stops an earlier owner at its next transaction;
an owner never writes into a CF other than the one it claimed on, and its connection never reconnects."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import redis
from redis.client import Pipeline

from cfemu import bulk, keys, resp
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis

S = "APP1"


class Survivor(NamedTuple):
    id: str
    entry: dict[str, object]
    data: bytes


def header(client: redis.Redis) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.meta(S)).items()}


def marker(value: str) -> Callable[[Pipeline], object]:
    return lambda pipe: pipe.hset(keys.data(S), "marker", value)


HOW = ["staged", "packed", "load", "native"]


def write_marker(owner: bulk.Owner, value: str, how: str) -> None:
    """The marker written by a transaction staged on redis-py's pipeline, or by commands packed beforehand (a bulk
    load's batch: Owner.send), alone or as one of a load's batches (the next batch's WATCH and header read sent
    after its EXEC, and judged when the next batch goes), or as a batch the CF's server module checks itself
    (Owner.load, LOAD); all are held to the same ownership rules."""
    if how == "staged":
        owner.transaction(marker(value))
        return
    commands = resp.Packed()
    commands.add("HSET", keys.data(S), "marker", value)
    if how == "native":
        assert owner.loads_natively()
        owner.load(commands)
        owner.loaded()
        return
    owner.send(commands, watch_next=how == "load")


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url)
    Admin(c).define_structure(S)
    Admin(c).set_state(S, "FAILED")
    return c


def count_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now until monkeypatch.undo(): each round trip to the CF (resp.exchange) appends how many replies it
    waited for to the list returned."""
    exchanges: list[int] = []
    exchange = resp.exchange

    def counted(conn: object, data: object, replies: int) -> list[object]:
        exchanges.append(replies)
        return exchange(conn, data, replies)  # type: ignore[arg-type]

    monkeypatch.setattr(resp, "exchange", counted)
    return exchanges


def test_a_claim_takes_a_growing_token_and_makes_the_structure_recovering(client: redis.Redis) -> None:
    seen = bulk.observe(client, S)
    assert seen.state == "FAILED" and seen.token == 0 and seen.gen == 1 and len(seen.cf) == 40
    with bulk.claim(client, S, seen) as owner:
        assert owner.token >= time.time_ns() // 1_000_000 - 60_000
        assert header(client)["state"] == "RECOVERING" and int(header(client)[bulk.TOKEN]) == owner.token
        owner.transaction(marker("one"))
    assert client.hget(keys.data(S), "marker") == b"one"
    with bulk.claim(client, S, bulk.observe(client, S)) as second:
        assert second.token > owner.token


def test_a_claim_on_a_cf_without_the_structure_creates_a_recovering_header(redis_url: str) -> None:
    c = redis.Redis.from_url(redis_url)
    seen = bulk.observe(c, S)
    assert seen.state == "" and seen.gen == 0
    with bulk.claim(c, S, seen):
        assert header(c)["state"] == "RECOVERING"
    assert Admin(c).state(S) == "RECOVERING"


@pytest.mark.parametrize("meanwhile, why", [
    ("another claim", "another restore or a purge took the structure over since this one started"),
    ("restored", "another restore restored the structure since this one started (now ACTIVE, generation"),
    ("purged", "a purge emptied the structure since this one started (now ACTIVE, generation"),
])
def test_a_claim_refuses_a_structure_that_changed_since_it_was_observed(client: redis.Redis, meanwhile: str,
                                                                        why: str) -> None:
    seen = bulk.observe(client, S)
    if meanwhile == "purged":
        bulk.purge(client, Admin(client).structure_def(S), ["Q1"])
    else:
        with bulk.claim(client, S, bulk.observe(client, S)) as other:
            if meanwhile == "restored":
                bulk.activate(other, Admin(client).structure_def(S), gen=5, clock=6, floor=5, entries=0, nbytes=0,
                              restored_from="APP1-B1")
    before = header(client)
    assert bulk.changed_since(seen, bulk.observe(client, S)) is not None
    with pytest.raises(bulk.NotOwnerError, match=rf"^{why.replace('(', r'[(]')}") as refused:
        bulk.claim(client, S, seen)
    assert not isinstance(refused.value, bulk.CFReplacedError)
    assert header(client) == before  # nothing written


@pytest.mark.parametrize("how", HOW)
def test_a_later_claim_stops_the_earlier_owner_at_its_next_transaction(client: redis.Redis, how: str) -> None:
    first = bulk.claim(client, S, bulk.observe(client, S))
    write_marker(first, "first", how)
    second = bulk.claim(client, S, bulk.observe(client, S))
    with pytest.raises(bulk.NotOwnerError, match="a later restore or a purge took the structure over"):
        write_marker(first, "stale", how)
    assert client.hget(keys.data(S), "marker") == b"first"  # the stale transaction applied nothing
    second.transaction(marker("second"))
    assert client.hget(keys.data(S), "marker") == b"second"
    first.close()
    second.close()


def test_an_owner_stops_when_someone_else_changes_the_state(client: redis.Redis) -> None:
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        Admin(client).set_state(S, "FAILED")  # cfrestore mark-failed meanwhile
        with pytest.raises(bulk.NotOwnerError, match="the structure is FAILED now"):
            owner.transaction(marker("x"))


def test_a_header_changed_under_a_transaction_but_still_the_owners_is_tried_again(client: redis.Redis) -> None:
    other = redis.Redis(connection_pool=client.connection_pool)
    attempts: list[int] = []

    def stage(pipe: Pipeline) -> None:
        attempts.append(1)
        if len(attempts) == 1:  # between the check and EXEC, someone re-sizes the structure: EXEC applies nothing
            other.hset(keys.meta(S), "max_entries", 10)
        pipe.hincrby(keys.data(S), "counter", 1)

    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        owner.transaction(stage)
    assert len(attempts) == 2 and client.hget(keys.data(S), "counter") == b"1"  # applied once


def test_packed_commands_under_a_header_changed_meanwhile_are_tried_again(client: redis.Redis,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    other = redis.Redis(connection_pool=client.connection_pool)
    checks: list[int] = []
    commands = resp.Packed()
    commands.add("HINCRBY", keys.data(S), "counter", 1)
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        judge = owner.judge  # a packed batch judges the header it read with its WATCH

        def judge_then_change(now: bulk.Seen) -> None:
            judge(now)
            checks.append(1)
            if len(checks) == 1:  # between the check and EXEC: EXEC applies nothing, and the batch goes again
                other.hset(keys.meta(S), "max_entries", 10)

        monkeypatch.setattr(owner, "judge", judge_then_change)
        assert owner.send(commands) == [1]
    assert len(checks) == 2 and client.hget(keys.data(S), "counter") == b"1"  # applied once


def test_a_loads_batch_after_a_header_change_between_batches_is_tried_again_and_applied_once(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard sent after a load's batch read the header before someone re-sized the structure (still this
    owner's): the next batch's EXEC applies nothing under that guard's WATCH, and the batch goes again, judged by
    the guard sent after the aborted EXEC; it is applied once."""
    commands = resp.Packed()
    commands.add("HINCRBY", keys.data(S), "counter", 1)
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        exchanges = count_exchanges(monkeypatch)
        assert owner.send(commands, watch_next=True) == [1]
        client.hset(keys.meta(S), "max_entries", 10)  # between two batches
        assert owner.send(commands, watch_next=True) == [2]
        monkeypatch.undo()
    # the first guard; the first batch; the second, aborted by the WATCH; the second again
    assert exchanges == [3, 6, 6, 6]
    assert client.hget(keys.data(S), "counter") == b"2"  # each batch applied once


def test_a_packed_batch_waits_for_the_cf_twice(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """WATCH, the CF's identity and the header go in one round trip, MULTI, the batch and EXEC in a second: a
    watching redis-py pipeline made a round trip of each of the first three (four waits a batch, each a
    scheduling delay for a restore on a busy machine)."""
    commands = resp.Packed()
    commands.add("HSET", keys.data(S), "marker", "x")
    def calls() -> dict[str, int]:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}

    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        before = calls()
        exchanges = count_exchanges(monkeypatch)
        owner.send(commands)
        monkeypatch.undo()
        after = calls()
    assert exchanges == [3, 3]  # WATCH, INFO, HMGET; then MULTI, HSET, EXEC
    sent = ("watch", "hmget", "multi", "hset", "exec")  # and INFO, which the count's own reads use too
    assert {k: after.get(k, 0) - before.get(k, 0) for k in sent} == dict.fromkeys(sent, 1)
    assert client.hget(keys.data(S), "marker") == b"x"


def test_a_loads_batches_wait_for_the_cf_once_each(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's batch (Loader.send) sends the next batch's WATCH, CF identity and header read right after its EXEC:
    after the first, each batch is one round trip (two had been a scheduling delay each on a busy machine). The
    owner's next transaction of another kind (the load's finish) judges the header anew: a header change that the
    WATCH left in force saw makes its first EXEC apply nothing, and it goes again, applied once."""
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        monkeypatch.setattr(owner, "loads_natively", lambda: False)  # a CF without the module
        loader = bulk.Loader(owner, gen=1)
        exchanges = count_exchanges(monkeypatch)
        batches = [bulk.prepare(S, [Survivor(f"e{b}", {"id": f"e{b}", "q": "Q1", "st": "CP", "l": b}, b"x")])
                   for b in range(3)]
        for batch in batches:
            loader.send(batch)
        monkeypatch.undo()
        client.hset(keys.meta(S), "max_entries", 10)  # a header change the left WATCH sees
        execs = client.info("commandstats")["cmdstat_exec"]["calls"]
        assert loader.finish(["Q1"], owner=lambda u: "QM1", tomb={}) == 0
        assert client.info("commandstats")["cmdstat_exec"]["calls"] - execs == 2  # aborted once, then applied
    # WATCH, INFO, HMGET; then each batch: MULTI, its commands, EXEC, and the next batch's WATCH, INFO, HMGET
    assert exchanges == [3, *(2 + batch.commands.count + 3 for batch in batches)]
    assert client.hlen(keys.data(S)) == 3 and client.sismember(keys.queues(S), "Q1")


def test_a_packed_batch_refused_leaves_the_owners_connection_unwatched(client: redis.Redis) -> None:
    """A packed batch whose owner lost the structure writes nothing, and its connection (the owner's only one)
    is not left watching the header: the owner's next transaction is not aborted by the WATCH of the refused
    one."""
    commands = resp.Packed()
    commands.add("HSET", keys.data(S), "marker", "x")
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        token = owner.token
        owner.token = token - 1  # as if a later restore had claimed the structure
        with pytest.raises(bulk.NotOwnerError, match="took the structure over"):
            owner.send(commands)
        owner.token = token
        client.hset(keys.meta(S), "max_entries", 10)  # would abort an EXEC still watching
        owner.client.execute_command("MULTI")  # on the owner's one connection, without a WATCH of its own
        owner.client.execute_command("HSET", keys.data(S), "queued", "y")
        assert owner.client.execute_command("EXEC") == [1]  # None had the refused batch's WATCH survived
    assert client.hget(keys.data(S), "marker") is None


def test_packed_commands_with_an_error_apply_nothing_and_raise_it(client: redis.Redis) -> None:
    client.set("{APP1}:not-a-set", "x")
    commands = resp.Packed()
    commands.add("HSET", keys.data(S), "marker", "half")
    commands.add("SADD", "{APP1}:not-a-set", "a")  # WRONGTYPE at EXEC: the HSET before it applies (Redis has no
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:  # rollback); the load stops at once
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            owner.send(commands)
        aborted = resp.Packed()
        aborted.add("HSET", keys.data(S), "marker", "never")
        aborted.add("NOSUCHCOMMAND", "x")  # refused when queued: EXEC aborts, nothing of it applies
        with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
            owner.send(aborted)
        assert client.hget(keys.data(S), "marker") == b"half"
        write_marker(owner, "after", "packed")  # the connection is still in step
    assert client.hget(keys.data(S), "marker") == b"after"


@pytest.mark.parametrize("how", HOW)
def test_an_owner_never_writes_into_a_cf_restarted_under_it(fresh_redis: EmbeddedRedis, how: str) -> None:
    c = fresh_redis.client()
    Admin(c).define_structure(S)
    owner = bulk.claim(c, S, bulk.observe(c, S))
    write_marker(owner, "before", how)
    fresh_redis.kill()
    fresh_redis.start()  # an empty CF on the same port
    with pytest.raises(bulk.CFReplacedError, match="the connection to the CF broke"):
        write_marker(owner, "after", how)
    with pytest.raises(redis.exceptions.ConnectionError):  # and its connection does not come back
        owner.client.ping()
    assert fresh_redis.client().keys("*") == []
    owner.close()


@pytest.mark.parametrize("how", HOW)
def test_an_owner_checks_the_cf_identity_at_each_transaction(client: redis.Redis, how: str) -> None:
    """Behind a proxy that keeps the client's connection open, a CF restarted from its own snapshot would still
    carry the token: the run id tells the servers apart."""
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        owner.cf = "0" * 40  # as if the claim had been made on another server
        with pytest.raises(bulk.CFReplacedError, match="the CF is another server now"):
            write_marker(owner, "x", how)
    assert client.hget(keys.data(S), "marker") is None


def test_a_claim_refuses_when_the_cf_was_replaced_since_it_was_observed(client: redis.Redis) -> None:
    seen = bulk.observe(client, S)._replace(cf="f" * 40)
    with pytest.raises(bulk.CFReplacedError, match="the CF is another server now"):
        bulk.claim(client, S, seen)
    assert header(client)["state"] == "FAILED"


def test_activate_keeps_the_token_and_a_purge_fences_a_loading_restore(client: redis.Redis) -> None:
    sdef = Admin(client).structure_def(S)
    loading = bulk.claim(client, S, bulk.observe(client, S))
    bulk.reset(loading, sdef)
    purged = bulk.purge(client, sdef, ["Q1"])
    assert header(client)["state"] == "ACTIVE" and int(header(client)["gen"]) == purged.gen
    assert int(header(client)[bulk.TOKEN]) > loading.token  # the purge's token stays in the header
    with pytest.raises(bulk.NotOwnerError, match="took the structure over"):
        bulk.Loader(loading, gen=1).finish(["Q9"], owner=lambda u: "QM1", tomb={})
    assert not client.sismember(keys.queues(S), "Q9")
    loading.close()


@pytest.mark.parametrize("how", HOW)
def test_an_owner_stops_when_the_cf_became_a_replica(fresh_redis: EmbeddedRedis, how: str) -> None:
    """A CF demoted under the load (a duplex failover, an operator's REPLICAOF) refuses writes with READONLY: the
    load stops as for a lost CF, to be run again on the new one (it raised a bare ReadOnlyError)."""
    c = fresh_redis.client()
    Admin(c).define_structure(S)
    with bulk.claim(c, S, bulk.observe(c, S)) as owner:
        c.execute_command("REPLICAOF", "127.0.0.1", "1")  # nothing listens there: it keeps its data, read only
        try:
            with pytest.raises(bulk.CFReplacedError, match="READONLY"):
                write_marker(owner, "x", how)
        finally:
            c.execute_command("REPLICAOF", "NO", "ONE")
    assert c.hget(keys.data(S), "marker") is None


def test_the_backups_hmget_reads_what_redis_py_reads_and_a_failed_read_again(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bulk.hmget (the backup's reads, on the pool's connection directly) answers as client.hmget: binary values,
    empty ones, missing fields as None, an error reply raised; a read whose connection broke under it is made
    again by client.hmget itself, with redis-py's retries and reconnection (a read may be made twice)."""
    c = redis.Redis.from_url(redis_url)
    key = keys.data(S)
    c.hset(key, mapping={"a": b"\x00\r\n$3\r\n", "b": b""})
    fields = ["a", "missing", "b"]
    assert bulk.hmget(c, key, fields) == c.hmget(key, fields) == [b"\x00\r\n$3\r\n", None, b""]
    c.set("{APP1}:string", "x")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        bulk.hmget(c, "{APP1}:string", fields)

    exchange = resp.exchange
    broken: list[object] = []

    def breaks_once(conn: object, data: object, replies: int) -> list[object]:
        if not broken:
            broken.append(conn)
            conn.disconnect()  # type: ignore[attr-defined]
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return exchange(conn, data, replies)  # type: ignore[arg-type]

    monkeypatch.setattr(resp, "exchange", breaks_once)
    assert bulk.hmget(c, key, fields) == [b"\x00\r\n$3\r\n", None, b""]
    assert broken, "the failed read was not the one made"


def test_an_owner_interrupted_while_a_batch_is_in_flight_gives_its_connection_up(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt while the owner reads a batch's reply (Owner.loaded) drops the connection: the owner is
    then a lost CF to everything after (its connection never reconnects), not a pool with its one connection
    still out."""
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        assert owner.loads_natively()
        commands = resp.Packed()
        commands.add("HSET", keys.data(S), "marker", "x")
        owner.load(commands)

        def interrupted(*args: object) -> list[object]:
            raise KeyboardInterrupt

        monkeypatch.setattr(resp, "receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            owner.loaded()
        monkeypatch.undo()
        assert owner.in_flight == 0
        with pytest.raises(redis.exceptions.ConnectionError, match="does not reconnect"):
            owner.client.ping()
