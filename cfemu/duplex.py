"""A duplexed CF, the client side: every operation a member acknowledges is on both servers of the pair.

A duplexed CF is two redis-servers: the primary, and a secondary that is its Redis replica (docs/architecture.md
"A duplexed CF"). Its URL names both, the primary first::

    redis://qsg-member:PW@127.0.0.1:7001/0?duplex=127.0.0.1:7002

cfemu.connection.connect() hands such a URL here (``pool_options``): the pool's connections are DuplexConnections.

* Which server: a connection, when it connects, asks every address of the pair (INFO replication and the pair's
  generation, ``{ADMIN}:duplex`` field ``gen``) and takes the primary (role master) with the highest generation,
  never one below the highest this process has seen and never one without a generation (a server just started,
  empty: the pair's controller gives the primary its generation before anyone may use it). The controller bumps
  the generation at every promotion, so an old primary that came back as a primary is never taken.
* Synchronous copy: every CF script runs as EVALSHA followed by ``WAIT 1 <ms>`` on the same connection, sent
  together (one round trip; Redis 6.2 has no WAITAOF). The reply is returned only when the replica acknowledged
  the write, or when the pair's mode (``{ADMIN}:duplex`` field ``mode``, read on the same connection after the
  write) is SIMPLEX: the controller degraded the pair because the secondary is lost, and a pair in SIMPLEX is never
  promoted (the controller that degrades is the one that promotes, cfemu.duplex_control). Neither within
  ``settle_s``: DuplexUnconfirmedError, a lost reply (the member treats the operation as maybe applied).
* A demoted primary (now a replica) refuses writes with READONLY: the connection is dropped and
  NotPrimaryError raised (nothing was applied); the next connection finds the new primary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.connection import Connection

from cfemu import keys
from cfemu.redis_internals import socket_of

QUERY_PARAM = "duplex"
MODE_FIELD, GEN_FIELD = b"mode", b"gen"
DUPLEX, SIMPLEX = "DUPLEX", "SIMPLEX"
WAIT_MS = 250  # one WAIT's bound; a slow replica is waited for again until settle_s
SETTLE_S = 10.0  # an operation waits this long for the replica's acknowledgement or the controller's degrade
PROBE_TIMEOUT_S = 1.0  # asking a server of the pair whether it is the primary


class DuplexUnconfirmedError(redis.exceptions.TimeoutError):
    """The primary applied the operation, but neither the secondary acknowledged it nor was the pair degraded in
    time: it is not acknowledged (a lost reply: it may or may not survive a promotion)."""


class NotPrimaryError(redis.exceptions.ConnectionError):
    """The server this connection reached is no longer the pair's primary (it refused a write: READONLY), or no
    server of the pair is a usable primary. Nothing was applied."""


@dataclass
class PairState:
    """What one pool knows of its pair: the addresses, the highest generation seen, the mode last seen."""

    addresses: list[tuple[str, int]]
    wait_ms: int = WAIT_MS
    settle_s: float = SETTLE_S
    gen: int = 0
    duplex: bool = True  # the mode last read; True makes the first operation WAIT
    primary: tuple[str, int] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def seen(self, address: tuple[str, int], gen: int) -> None:
        with self.lock:
            self.gen = max(self.gen, gen)
            self.primary = address


def split_url(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """(the URL without the duplex parameter, every address of the pair, the URL's own first) for a duplexed
    URL; None for a plain one."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    peers = [v for k, v in query if k == QUERY_PARAM]
    if not peers:
        return None
    addresses = [(parts.hostname or "127.0.0.1", parts.port or 6379)]
    for peer in ",".join(peers).split(","):
        host, sep, port = peer.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bad duplex address {peer!r} in the CF URL: use HOST:PORT")
        addresses.append((host, int(port)))
    rest = urlencode([(k, v) for k, v in query if k != QUERY_PARAM])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment)), addresses


def duplex_url(url: str, secondary: tuple[str, int]) -> str:
    """A plain CF URL with the pair's secondary added (what the launcher gives every process)."""
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query, keep_blank_values=True), (QUERY_PARAM, f"{secondary[0]}:{secondary[1]}")]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query, safe=":,"), parts.fragment))


def pool_options(url: str) -> tuple[str, dict[str, Any]] | None:
    """For connect(): the URL to give redis-py and the pool options of a duplexed URL (None: a plain one)."""
    split = split_url(url)
    if split is None:
        return None
    plain, addresses = split
    return plain, {"connection_class": DuplexConnection, "duplex": PairState(addresses)}


def pair_of(client: redis.Redis) -> PairState | None:
    """The pair a client's pool talks to, None for a plain CF (and for a Redis Cluster's client, which has a pool per
    node and no pair: cfemu.rcluster)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    state = pool.connection_kwargs.get("duplex")
    return state if isinstance(state, PairState) else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


class DuplexConnection(Connection):
    """A connection to whichever server of the pair is the current primary."""

    def __init__(self, *, duplex: PairState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.duplex = duplex

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if socket_of(self):
            return
        state = self.duplex
        found: list[tuple[int, tuple[str, int]]] = []
        notes: list[str] = []
        # The primary last found first: while it answers as a primary of the highest generation seen, it is the
        # primary (a promotion happens only once it can no longer act: cfemu.duplex_control), and the other server
        # is not asked (a hung one would hold every new connection for its probe's timeout).
        order = sorted(state.addresses, key=lambda a: a != state.primary)
        for address in order:
            self.host, self.port = address
            try:
                role, gen = self._connect_and_probe(check_health)
            except redis.exceptions.RedisError as e:
                notes.append(f"{address[0]}:{address[1]} {type(e).__name__}")
                self.disconnect()
                continue
            notes.append(f"{address[0]}:{address[1]} {role} gen {gen}")
            if role == "master" and gen >= max(1, state.gen):
                if address == state.primary and gen >= state.gen:
                    state.seen(address, gen)
                    return  # connected: the probe's connection is the one used
                found.append((gen, address))
            self.disconnect()
        if not found:
            raise NotPrimaryError(f"no primary of the duplexed CF answers ({'; '.join(notes)}; generation at "
                                  f"least {max(1, state.gen)} wanted)")
        gen, address = max(found)
        self.host, self.port = address
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)
        state.seen(address, gen)

    def _connect_and_probe(self, check_health: bool) -> tuple[str, int]:
        """Connect to self.host:self.port and ask its role and generation, with a short timeout for the probe (a
        hung server must not hold a connect for the CF's socket timeout); the timeouts as configured after."""
        saved = self.socket_timeout, self.socket_connect_timeout
        self.socket_timeout = min(saved[0] or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S)
        self.socket_connect_timeout = min(saved[1] or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S)
        try:
            super().connect_check_health(check_health=check_health, retry_socket_connect=False)
            return self._probe()
        finally:
            self.socket_timeout, self.socket_connect_timeout = saved
            sock = socket_of(self)
            if sock is not None:
                sock.settimeout(self.socket_timeout)

    def _probe(self) -> tuple[str, int]:
        self.send_command("INFO", "replication")
        info = _text(self.read_response())
        role = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("role:")), "")
        self.send_command("HGET", keys.duplex(), GEN_FIELD)
        return role, int(_text(self.read_response()) or 0)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.ResponseError as e:
            # redis-py makes a plain command's READONLY reply a ReadOnlyError and drops the word from its text; a
            # script's error keeps it in its text
            if not isinstance(e, redis.exceptions.ReadOnlyError) and "READONLY" not in str(e):
                raise
            where = f"{self.host}:{self.port}"
            self.disconnect()
            raise NotPrimaryError(f"the CF at {where} is no longer the duplexed pair's primary (it refused a "
                                  "write); nothing was applied") from None


def settle(conn: Connection, state: PairState, acked: int) -> None:
    """After a write and its WAIT on conn: return when the operation may be acknowledged, raise when not."""
    if acked >= 1:
        state.duplex = True
        return
    deadline = time.monotonic() + state.settle_s
    while True:
        conn.send_command("HGET", keys.duplex(), MODE_FIELD)
        if _text(conn.read_response()) != DUPLEX:
            state.duplex = False  # degraded: the controller will not promote the secondary
            return
        state.duplex = True
        if time.monotonic() >= deadline:
            raise DuplexUnconfirmedError(
                f"the duplexed CF's secondary did not acknowledge an operation within {state.settle_s:g}s and the "
                "pair was not degraded to simplex: the operation is not acknowledged (it may have been applied)")
        conn.send_command("WAIT", 1, state.wait_ms)
        if int(conn.read_response()) >= 1:
            return


def confirm_after(state: PairState) -> tuple[bool, list[Any]]:
    """The command to send right after a write, in the same round trip, and whether it is a WAIT: a WAIT while
    the pair was last seen duplexed, else a read of its mode (which says whether it became duplexed since). The
    choice is returned, not read again from state later: another thread of the pool may change state meanwhile."""
    if state.duplex:
        return True, [("WAIT", 1, state.wait_ms)]
    return False, [("HGET", keys.duplex(), MODE_FIELD)]


def finish(conn: Connection, state: PairState, waited: bool, reply: Any) -> None:
    """Act on the reply of confirm_after's command."""
    if waited:
        settle(conn, state, int(reply))
    elif _text(reply) == DUPLEX:  # the pair became duplexed before our read: this write must be on both
        state.duplex = True
        conn.send_command("WAIT", 1, state.wait_ms)
        settle(conn, state, int(conn.read_response()))


def exchange(conn: Connection, state: PairState, packed: list[bytes]) -> Any:
    """Send a packed CF script call and its confirmation in one round trip; the script's reply once confirmed.
    A script that failed (a CF refusal: nothing to confirm) raises its error after the tail is read."""
    waited, tail = confirm_after(state)
    conn.send_packed_command([*packed, *conn.pack_commands(tail)])
    try:
        reply = conn.read_response()
    except redis.exceptions.ResponseError:
        conn.read_response()  # the tail's reply, so that the connection stays usable
        raise
    finish(conn, state, waited, conn.read_response())
    return reply


def run_confirmed(client: redis.Redis, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Run commands on one connection of client's pool, then confirm them as a CF script's write is confirmed
    (the admin structure's writes: fencing epochs, leases, locks). A plain CF: just the commands."""
    state = pair_of(client)
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        waited, tail = confirm_after(state) if state is not None else (False, [])
        conn.send_packed_command(conn.pack_commands([*commands, *tail]))
        replies: list[Any] = []
        error: BaseException | None = None
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as e:
                error = error or e
                replies.append(e)
        if state is not None:
            finish(conn, state, waited, conn.read_response())
        if error is not None:
            raise error
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


__all__ = ["DUPLEX", "SIMPLEX", "DuplexConnection", "DuplexUnconfirmedError", "NotPrimaryError", "PairState",
           "confirm_after", "duplex_url", "exchange", "finish", "pair_of", "pool_options", "run_confirmed", "split_url"]
