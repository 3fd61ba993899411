"""The guard a load's batch sends after its EXEC (cfemu.bulk.Owner.send(watch_next=True): the next batch's WATCH, the
CF's identity and the header read in the same round trip, judged when that batch goes), against a real
redis-server: whatever happens to the structure or to the owner's connection between two batches (a takeover
between one batch's EXEC and the next one's WATCH, the connection killed, the CF flushed, demoted to a replica, a
batch refused by the CF), the next batch writes nothing unless the structure is still this owner's in the same
CF, and the owner's next transaction of another kind is neither refused nor aborted by the guard left in force."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from cfemu import bulk, keys, resp
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis

S = "APP1"


def batch(field: str, value: str = "x") -> resp.Packed:
    """A load's batch of one write: {S}:data's `field` set to `value`."""
    commands = resp.Packed()
    commands.add("HSET", keys.data(S), field, value)
    return commands


def load_batch(owner: bulk.Owner, field: str, value: str = "x") -> list[Any]:
    """One batch as a load sends it (more follow: the next batch's guard goes out after its EXEC)."""
    return owner.send(batch(field, value), watch_next=True)


def load_batch_by(owner: bulk.Owner, field: str, how: str) -> None:
    """One batch as a load sends it: a guarded transaction (load_batch), or a batch the CF checks itself
    (Owner.load: CF.LOAD of the server module)."""
    if how == "transaction":
        load_batch(owner, field)
        return
    assert owner.loads_natively()
    owner.load(batch(field))
    owner.loaded()


def defined(client: redis.Redis) -> redis.Redis:
    Admin(client).define_structure(S)
    Admin(client).set_state(S, "FAILED")
    return client


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return defined(redis.Redis.from_url(redis_url))


class SwitchingProxy:
    """A TCP proxy that keeps its clients' connections open when the server behind it changes (`target`, a port):
    a client's next bytes go to the new server, on a connection of the proxy's own, the way a proxy in front of a
    failing-over or restarted server carries on."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with self.listener:
            while True:
                try:
                    client, _ = self.listener.accept()
                except OSError:  # closed
                    return
                self.sockets.append(client)
                threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        port = 0
        try:
            while data := client.recv(65536):
                if port != self.target:  # the server behind changed: a new connection to it, the client's kept
                    if upstream is not None:
                        upstream.close()
                    port = self.target
                    upstream = socket.create_connection(("127.0.0.1", port))
                    self.sockets.append(upstream)
                    threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
                assert upstream is not None
                upstream.sendall(data)
        except OSError:
            pass

    @staticmethod
    def _back(upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


@pytest.fixture
def proxied(redis_factory: Callable[..., EmbeddedRedis]) -> Iterator[tuple[SwitchingProxy, EmbeddedRedis,
                                                                             EmbeddedRedis]]:
    """A proxy in front of the CF, and the server that replaces it behind the proxy."""
    cf, replacement = redis_factory(), redis_factory()
    proxy = SwitchingProxy(cf.port)
    yield proxy, cf, replacement
    proxy.close()


def test_an_owner_behind_a_proxy_judges_each_batch_just_before_it(
        proxied: tuple[SwitchingProxy, EmbeddedRedis, EmbeddedRedis]) -> None:
    """A CF replaced behind a proxy that keeps the owner's connection open between two batches, by a server
    restarted from the CF's own snapshot (this owner's token, RECOVERING): the guard sent after the first batch was
    read on the old CF and its WATCH is gone with the proxy's old connection. The owner, told at its claim that
    something stands between it and the CF, judges each batch's guard just before it (two round trips), and the
    next batch is refused by the new server's run id, having written nothing there."""
    proxy, cf, replacement = proxied
    client = defined(redis.Redis(port=proxy.port))
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        assert not owner.direct
        load_batch(owner, "first")
        snapshot = cf.client()
        for key in snapshot.keys("*"):  # the replacement starts from the CF's snapshot
            replacement.client().restore(key, 0, snapshot.dump(key), replace=True)
        proxy.target = replacement.port
        with pytest.raises(bulk.CFReplacedError, match="the CF is another server now"):
            load_batch(owner, "stale")
    assert replacement.client().hkeys(keys.data(S)) == [b"first"]


def test_an_owner_connected_to_the_cf_itself_is_told_so(client: redis.Redis) -> None:
    """Only an owner whose connection reaches the CF directly sends a load's next guard after a batch's EXEC
    (tests/cfemu/test_bulk.py: one round trip a batch)."""
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        assert owner.direct


def test_a_takeover_between_a_batchs_exec_and_the_next_watch_stops_the_next_batch(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another client's claim that the CF runs after this batch's EXEC and before the WATCH sent behind it (the two
    are separate commands: the CF serves other clients between them) is in the header the guard reads after its
    WATCH: the next batch is refused having written nothing, though no WATCH saw the change."""
    exec_then = bulk._exec_then
    taken: list[bulk.Owner] = []

    def exec_then_claimed_between(conn: Any, commands: resp.Packed, then: list[bytes],
                                  replies: int) -> tuple[list[Any] | None, list[Any]]:
        result, _ = exec_then(conn, commands, [], 0)  # this batch's MULTI, commands and EXEC
        if not taken:
            taken.append(bulk.claim(client, S, bulk.observe(client, S)))  # a later restore claims, in between
        return result, resp.exchange(conn, then, replies)  # then the guard: its WATCH, INFO and HMGET

    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        monkeypatch.setattr(bulk, "_exec_then", exec_then_claimed_between)
        assert load_batch(owner, "first") == [1]
        monkeypatch.undo()
        with pytest.raises(bulk.NotOwnerError, match="a later restore or a purge took the structure over"):
            load_batch(owner, "stale")
    assert client.hkeys(keys.data(S)) == [b"first"]  # the second batch wrote nothing
    taken[0].transaction(lambda pipe: pipe.hset(keys.data(S), "later", "y"))  # the later owner's work goes on
    taken[0].close()


def test_an_owners_connection_killed_between_two_batches_is_not_made_again(fresh_redis: EmbeddedRedis) -> None:
    """The CF drops the owner's connection between two batches (CLIENT KILL: the same CF, which a takeover may use
    next): the WATCH of the guard sent after the first batch died with it, so the next batch stops as for a lost CF
    instead of going out on a new connection under a guard read on the old one."""
    client = defined(fresh_redis.client())
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        load_batch(owner, "first")
        owner_id = owner.client.client_id()  # on the owner's one connection: a read leaves its WATCH in force
        assert client.client_kill_filter(_id=owner_id) == 1
        with bulk.claim(client, S, bulk.observe(client, S)) as later:  # the structure taken over meanwhile
            with pytest.raises(bulk.CFReplacedError, match="the connection to the CF broke"):
                load_batch(owner, "stale")
            later.transaction(lambda pipe: pipe.hset(keys.data(S), "later", "y"))
    assert sorted(client.hkeys(keys.data(S))) == [b"first", b"later"]
    with pytest.raises(redis.exceptions.ConnectionError):  # nor does anything else of the owner reconnect
        owner.client.ping()


@pytest.mark.parametrize("how", ["transaction", "native"])
def test_a_cf_flushed_between_two_batches_stops_the_load(fresh_redis: EmbeddedRedis, how: str) -> None:
    """A FLUSHALL between two batches (the CF emptied under the load, by the same server process, so the same run
    id): the guard's WATCH makes the next EXEC apply nothing, and the guard sent after it finds no header; CF.LOAD
    finds no header. Either way a lost CF (the restore says to run it again), not a takeover."""
    client = defined(fresh_redis.client())
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        load_batch_by(owner, "first", how)
        client.flushall()
        with pytest.raises(bulk.CFReplacedError, match="the structure's header is gone"):
            load_batch_by(owner, "stale", how)
    assert client.keys("*") == []


@pytest.mark.parametrize("how", ["transaction", "native"])
def test_a_cf_demoted_between_two_batches_stops_the_load(fresh_redis: EmbeddedRedis, how: str) -> None:
    """A CF that became a replica between two batches (a duplex failover, an operator's REPLICAOF) keeps its run
    id and its data, so the guard read before the demotion still passes: the queued writes' READONLY stops the
    load, having written nothing more."""
    c = defined(fresh_redis.client())
    with bulk.claim(c, S, bulk.observe(c, S)) as owner:
        load_batch_by(owner, "first", how)
        c.execute_command("REPLICAOF", "127.0.0.1", "1")  # nothing listens there: it keeps its data, read only
        try:
            with pytest.raises(bulk.CFReplacedError, match="READONLY"):
                load_batch_by(owner, "stale", how)
        finally:
            c.execute_command("REPLICAOF", "NO", "ONE")
    assert c.hkeys(keys.data(S)) == [b"first"]


def test_a_batch_the_cf_refuses_leaves_the_next_batches_in_step(client: redis.Redis) -> None:
    """A load's batch refused when queued (EXEC aborts: nothing of it applies) still had the next batch's guard
    sent behind it: the refusal is raised, and the owner's next batch and next transaction read their own
    replies (not the guard's of the refused batch) and apply once each."""
    refused = batch("never")
    refused.add("NOSUCHCOMMAND", "x")
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        assert load_batch(owner, "first") == [1]
        with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
            owner.send(refused, watch_next=True)
        assert load_batch(owner, "second", "2") == [1]
        assert owner.transaction(lambda pipe: pipe.hget(keys.data(S), "second")) == [b"2"]
    assert sorted(client.hkeys(keys.data(S))) == [b"first", b"second"]


def test_a_connection_lost_while_the_next_guard_is_read_stops_the_load_with_nothing_read_out_of_turn(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection fails after a batch's EXEC was answered, while the replies of the guard sent behind it are
    read: whether the batch applied is unknown to the owner (here it did), so the load stops as for a lost CF, and
    the connection is dropped with the rest of its replies: no later call of the owner reads them as its own."""
    read_reply = resp.read_reply
    replies = [0]

    def fails_in_the_guard(sock: Any, reader: Any, buf: Any) -> Any:
        replies[0] += 1
        if replies[0] == 4:  # MULTI, HSET and EXEC read: the guard's WATCH is next
            raise ConnectionResetError(104, "Connection reset by peer")
        return read_reply(sock, reader, buf)

    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        load_batch(owner, "first")  # the first batch's own guard, then the batch and the next guard
        monkeypatch.setattr(resp, "read_reply", fails_in_the_guard)
        with pytest.raises(bulk.CFReplacedError, match="the connection to the CF broke"):
            load_batch(owner, "second")
        monkeypatch.undo()
        with pytest.raises(bulk.CFReplacedError, match="the connection to the CF broke"):
            load_batch(owner, "third")
        with pytest.raises(redis.exceptions.ConnectionError):
            owner.client.ping()
    assert sorted(client.hkeys(keys.data(S))) == [b"first", b"second"]
