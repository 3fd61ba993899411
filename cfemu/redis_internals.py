"""Every use of redis-py's private internals, in one place: the fast paths of cfemu read and write a redis-py
connection's socket and hiredis reader directly, and hook its socket's creation.

redis-py is pinned to the major version these are written for (pyproject.toml). Each fast path has a fallback to
redis-py's own public path when an accessor here finds nothing (a connection not connected yet, another parser):
a release that moves an internal would then slow the CF calls and the bulk load silently, not break them.
tests/cfemu/test_redis_internals.py is the contract that stops that: it fails when, with the installed redis-py,
this module reports a fast path unavailable or a call through it does not take it.

What redis-py keeps private and cfemu uses:

- ``Connection._sock``: the connected socket (None while not connected), written and read directly;
- ``Connection._parser._reader`` and ``._buffer``: the hiredis reader and its receive buffer
  (``redis._parsers.hiredis._HiredisParser``), fed from the socket directly; ``NOT_ENOUGH_DATA``, the sentinel
  the reader answers while a reply is incomplete; ``_socket_can_read``, its non-blocking readiness check of a
  socket (a connection taken from the pool is checked for unread data with it);
- ``Connection._parser.parse_error``: an error reply's text made the exception redis-py raises for it (a reply
  read past the parser, by cfemu._bulk.read_bulks);
- ``Connection._command_packer``: whether redis-py packs with hiredis (``HiredisRespSerializer``);
- ``Connection._connect()`` (the hook that makes the socket) and ``Connection._host_error()`` (the address in its
  error texts);
- ``ConnectionPool._checkpid()`` and ``.pid`` (the process that made or reset the pool), and
  ``BlockingConnectionPool._in_maintenance``;
- ``Retry._retries`` and ``Retry._supported_errors``: a policy of one attempt is run without its wrapper.
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any, cast

import hiredis
import redis
from redis._parsers import hiredis as _redis_hiredis
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.retry import Retry

# What the hiredis reader answers while a reply is incomplete: redis-py builds its readers with this sentinel; one
# without it leaves hiredis's own False (a nil reply is None in RESP2, never False).
NOT_ENOUGH: Any = getattr(_redis_hiredis, "NOT_ENOUGH_DATA", False)
_POLLER = "_cfemu_poller"  # (socket, its poll object), kept on a connection for idle_and_clean


def socket_of(conn: Any) -> Any:
    """The connection's socket, None while it is not connected."""
    return conn._sock


def hiredis_io(conn: Any) -> tuple[Any, Any, Any] | None:
    """(socket, hiredis reader, receive buffer) of a connected connection whose parser is redis-py's hiredis one:
    what cfemu.resp.read_reply drives. None when there is none of them to drive (not connected, another parser):
    the caller then takes redis-py's own send_packed_command and read_response."""
    sock = conn._sock
    parser = conn._parser
    reader = getattr(parser, "_reader", None)
    buf = getattr(parser, "_buffer", None)
    if sock is None or reader is None or buf is None:
        return None
    return sock, reader, buf


def plain_socket(conn: Any) -> socket.socket | None:
    """The connection's socket where the CF's bytes come through it as they are (not TLS) and its hiredis reader
    holds nothing unread: a reply may then be read from the socket past the reader (cfemu._bulk.read_bulks).
    None otherwise."""
    io = hiredis_io(conn)
    if io is None or type(io[0]) is not socket.socket or io[1].has_data():
        return None
    return io[0]


def reply_error(conn: Any, text: str) -> Exception:
    """An error reply's text (without its "-") as the exception redis-py's parser makes of it: a ResponseError, or
    a ConnectionError for the codes it reads as one (LOADING, NOAUTH)."""
    return cast(Exception, conn._parser.parse_error(text))


def packs_with_hiredis(conn: Any) -> bool:
    """Whether redis-py packs this connection's commands with hiredis: pack() may then make the same bytes."""
    return isinstance(conn._command_packer, HiredisRespSerializer)


def pack(conn: Any, cmd: tuple[Any, ...]) -> list[bytes]:
    """`cmd` packed as the connection's own packer packs it: by hiredis directly, without the packer's
    per-argument checks, when that is the packer and it takes the arguments; else by the packer itself (a
    bytearray or a memoryview, which it converts, or an argument hiredis refuses)."""
    packer = conn._command_packer
    try:
        if not isinstance(packer, HiredisRespSerializer):
            raise TypeError
        return [hiredis.pack_command(cmd)]
    except TypeError:
        return packer.pack(*cmd)


def host_error(conn: Any) -> str:
    """The connection's address as redis-py's error texts name it ("localhost:6379")."""
    return str(conn._host_error())


def idle_and_clean(conn: Any) -> bool:
    """A connected connection with nothing unread, neither in its hiredis reader nor on its socket (what redis-py's
    ``can_read()`` answers False for), told without its wrappers; False also when it cannot be told this way (another
    parser): the caller then asks redis-py's own checks."""
    reader = getattr(conn._parser, "_reader", None)
    sock = conn._sock
    if reader is None or sock is None or reader.has_data():
        return False
    if type(sock) is not socket.socket:  # a TLS socket's layer may hold decrypted bytes: redis-py's own check
        return not _redis_hiredis._socket_can_read(sock, 0)
    # The same non-blocking poll as _socket_can_read (readable, closed or failed: not clean), by a poll object kept
    # with the connection for its socket rather than made and registered at every CF call.
    kept = conn.__dict__.get(_POLLER)
    if kept is None or kept[0] is not sock:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        kept = conn.__dict__[_POLLER] = (sock, poller)
    return not kept[1].poll(0)


def one_attempt(retry: Any) -> bool:
    """Whether a connection's retry policy (redis.retry.Retry) makes one attempt only: then its call_with_retry is
    the call, the failure callback and the raise, which cfemu's fast path does itself."""
    return getattr(retry, "_retries", None) == 0


def retry_errors(retry: Any) -> tuple[type[BaseException], ...]:
    """The errors a retry policy retries on (and calls its failure callback for)."""
    return tuple(retry._supported_errors)


_pid = os.getpid()  # this process's id, kept up to date across a fork: os.getpid() is a system call


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def check_pid(pool: Any) -> None:
    """redis-py's fork check of a pool: in a child process, the parent's connections are dropped first. The pool's
    own check (``_checkpid``) asks os.getpid() every time; it runs here only when the pool was made in another
    process than this one (its ``pid``), as it would find nothing to do otherwise."""
    if getattr(pool, "pid", None) != _pid:
        pool._checkpid()


def in_maintenance(pool: Any) -> bool:
    """Whether the pool is in redis-py's maintenance mode (a server's maintenance notifications)."""
    return bool(getattr(pool, "_in_maintenance", False))


class _SocketHook:
    """Passes every new socket of a redis-py connection to socket_made() before use."""

    def _connect(self) -> Any:
        sock = super()._connect()  # type: ignore[misc]
        self.socket_made(sock)
        return sock

    def socket_made(self, sock: socket.socket) -> None:
        """Called with each socket the connection makes, before it sends anything on it."""


class SocketHookConnection(_SocketHook, redis.Connection):
    """A plain TCP redis-py connection whose every new socket is passed to socket_made() before use."""


class UnixSocketHookConnection(_SocketHook, redis.UnixDomainSocketConnection):
    """A redis-py connection over a Unix-domain socket whose every new socket is passed to socket_made() before
    use."""


def fast_path() -> dict[str, bool]:
    """What the fast paths need from the installed redis-py, each True when there: redis-py's default parser is
    its hiredis one, the sentinel of an incomplete reply is redis-py's own, its connections carry the attributes
    read here and the hooks called here. tests/cfemu/test_redis_internals.py asserts every one."""
    conn_class = redis.connection.AbstractConnection
    pool_class = redis.BlockingConnectionPool
    return {
        "hiredis parser": redis.connection.DefaultParser is getattr(_redis_hiredis, "_HiredisParser", None),
        "incomplete-reply sentinel": NOT_ENOUGH is not False,
        "hiredis packer": isinstance(redis.Connection()._command_packer, HiredisRespSerializer),
        "socket hook": callable(getattr(conn_class, "_connect", None)),
        "host in errors": callable(getattr(conn_class, "_host_error", None)),
        "pool fork check": callable(getattr(pool_class, "_checkpid", None))
        and redis.ConnectionPool().pid == os.getpid(),
        "socket readiness check": callable(getattr(_redis_hiredis, "_socket_can_read", None)),
        "reply errors": callable(getattr(getattr(_redis_hiredis, "_HiredisParser", None), "parse_error", None)),
        "retry policy": isinstance(getattr(Retry(NoBackoff(), 0), "_retries", None), int)
        and isinstance(getattr(Retry(NoBackoff(), 0), "_supported_errors", None), tuple),
    }


__all__ = ["NOT_ENOUGH", "SocketHookConnection", "UnixSocketHookConnection", "check_pid", "fast_path", "hiredis_io", "host_error",
           "idle_and_clean", "in_maintenance", "one_attempt", "pack", "packs_with_hiredis", "plain_socket",
           "reply_error", "retry_errors",
           "socket_of"]
