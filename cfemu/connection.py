"""Connecting to the coupling facility (a Redis server).

``connect()`` takes a URL (argument, else ``$REDIS_URL``):

* ``redis://[[user]:password@]host:port/db`` -- ACL users (``user:pass@``) or the default user
  (``:pass@``); user names and passwords must be percent-encoded.
* ``rediss://...`` -- TLS. CA/cert/key come from keyword arguments ``tls_ca``/``tls_cert``/
  ``tls_key`` or the environment (``CFEMU_TLS_CA``/``CFEMU_TLS_CERT``/``CFEMU_TLS_KEY``).
* ``unix://[[user]:password@]/path/to/cf.sock[?db=0]`` -- a CF on this host, over its Unix-domain socket (an
  embedded CF listens on one beside its TCP port: cfemu.embedded). The same users and passwords as over TCP; a
  round trip costs less CPU than over loopback TCP (BENCHMARKS.md). The path must be absolute and name a socket
  that exists when connect() is called.

Clients are binary-safe (``decode_responses=False``).
"""

from __future__ import annotations

import os
import stat
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cfemu import duplex, rcluster
from cfemu.credentials import redact
from cfemu.pools import PoolExhaustedError, WaitingPool
from cfemu.redis_internals import SocketHookConnection, UnixSocketHookConnection, host_error
from cfemu.sockets import UNIX_PATH_MAX, set_kernel_timeout

__all__ = ["ConnectionConfigError", "PoolExhaustedError", "connect", "unix_socket_path"]

ENV_URL = "REDIS_URL"
ENV_TLS = {"tls_ca": "CFEMU_TLS_CA", "tls_cert": "CFEMU_TLS_CERT", "tls_key": "CFEMU_TLS_KEY"}


class ConnectionConfigError(ValueError):
    """No or unusable CF address."""


class _KernelTimeout(redis.connection.AbstractConnection):
    """A connection to the CF whose socket blocks, with the kernel timing out a send or a receive
    (cfemu.sockets.set_kernel_timeout), instead of a socket with a Python timeout, which polls before every send and
    every receive: two syscalls per CF call, each one more release of the GIL that a busy member's threads then
    contend for (BENCHMARKS.md, "peers"). A timeout surfaces as EAGAIN: cfemu.cf reads it as a timeout, and
    redis-py's own paths as a failure while reading or writing, which the member reads the same way
    (sqm.core.cfcall.reply_lost)."""

    def socket_made(self, sock: Any) -> None:
        set_kernel_timeout(sock, self.socket_timeout)

    # redis-py reads EAGAIN from a blocking socket as a failed connection: said here as the timeout it is, as with
    # a Python timeout (callers tell a CF that does not answer in time from one that is gone).
    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            super().send_packed_command(command, check_health)
        except redis.exceptions.ConnectionError as e:
            if isinstance(e.__context__, BlockingIOError):
                raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.ConnectionError as e:
            if isinstance(e.__context__, BlockingIOError):
                raise redis.exceptions.TimeoutError(f"Timeout reading from {host_error(self)}") from None
            raise


class _KernelTimeoutConnection(_KernelTimeout, SocketHookConnection):
    """Over TCP."""


class _KernelTimeoutUnixConnection(_KernelTimeout, UnixSocketHookConnection):
    """Over a Unix-domain socket."""


def unix_socket_path(url: str) -> str:
    """The socket a ``unix://`` URL names, checked: an absolute path, short enough for a socket address, that
    exists and is a socket. ConnectionConfigError (one line naming the problem) otherwise."""
    path = urlsplit(url).path
    if not path.startswith("/"):
        raise ConnectionConfigError(f"a unix:// URL names the CF's socket by its absolute path "
                                    f"(unix:///path/to/cf.sock), not {redact(url)!r}")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConnectionConfigError(f"the socket path {path} is {len(os.fsencode(path))} bytes: a Unix-domain "
                                    f"socket's path holds at most {UNIX_PATH_MAX}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConnectionConfigError(f"no CF socket at {path}: the file does not exist (is the CF running on this "
                                    "host, and listening on that socket?)") from None
    except OSError as e:
        raise ConnectionConfigError(f"cannot reach the CF socket {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
        raise ConnectionConfigError(f"{path} is {kind}, not a Unix-domain socket: a unix:// URL names the CF's "
                                    "socket file")
    return path


# The schemes whose connections block with the kernel timing them out (_KernelTimeout); TLS keeps redis-py's own.
_PLAIN: dict[str, Any] = {
    "redis": _KernelTimeoutConnection, "unix": _KernelTimeoutUnixConnection}


def check_url(url: str) -> str:
    """The CF URL as given, or ConnectionConfigError in one line saying why connect() could make no connection
    with it (its scheme, its host, its port, a duplexed or cluster URL's other addresses), found without
    connecting. The URL is shown with its password hidden, and not at all where it cannot be read."""
    shown = ""
    try:
        parts = urlsplit(url)
        shown = f" ({redact(url)!r})"
        _ = parts.port
        if parts.scheme not in ("redis", "rediss", "unix", *rcluster.SCHEMES):
            raise ValueError(f"unsupported URL scheme {parts.scheme!r} (use redis://, rediss://, unix:// or "
                             "redis+cluster://)")
        if parts.scheme in rcluster.SCHEMES:
            rcluster.seeds(url)
        else:
            paired = duplex.pool_options(url)
            redis.connection.parse_url(paired[0] if paired is not None else url)
    except ValueError as e:
        raise ConnectionConfigError(f"the CF URL is not one a connection can be made with: {e}{shown}") from None
    return url


def connect(
    url: str | None = None,
    *,
    socket_timeout: float | None = 30.0,
    socket_connect_timeout: float | None = 5.0,
    health_check_interval: int = 30,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_verify: bool = True,
    max_connections: int | None = None,
    pool_timeout: float = 30.0,
    **kw: Any,
) -> redis.Redis:
    """Return a ``redis.Redis`` for ``url`` (or ``$REDIS_URL``). Extra ``kw`` go to redis-py.

    ``max_connections``: a bounded pool of that many connections, where a caller waits up to ``pool_timeout``
    seconds for a free one and then gets PoolExhaustedError (redis-py's default pool fails at once at 100).

    The connection is lazy: errors such as a wrong password surface on the first command as
    ``redis.AuthenticationError`` (``WRONGPASS``) / ``redis.ConnectionError``.
    """
    url = url or os.environ.get(ENV_URL)
    if not url:
        raise ConnectionConfigError(
            f"no Redis/CF URL given: pass one (e.g. redis://127.0.0.1:6379/0) or set ${ENV_URL}"
        )
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix", *rcluster.SCHEMES):
        raise ConnectionConfigError(f"unsupported URL scheme {scheme!r} in {redact(url)!r} (use redis://, "
                                    "rediss://, unix:// or redis+cluster://)")
    if scheme == "unix":
        unix_socket_path(url)
    opts: dict[str, Any] = {
        # Never send a command again by itself: a CF script whose reply was lost may have run, and a get run twice
        # takes two messages for one delivery. The caller decides what a lost reply means (sqm.core.manager.reply_lost).
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_connect_timeout,
        "health_check_interval": health_check_interval,
    }
    if scheme in ("rediss", "rediss+cluster"):
        files = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        for name, env in ENV_TLS.items():
            files[name] = files[name] or os.environ.get(env) or None
        for name, path in files.items():
            if path is not None and not os.path.isfile(path):
                raise ConnectionConfigError(f"TLS file for {name} not found: {path}")
        opts.update(
            ssl_ca_certs=files["tls_ca"],
            ssl_certfile=files["tls_cert"],
            ssl_keyfile=files["tls_key"],
            ssl_cert_reqs="required" if tls_verify else "none",
            ssl_check_hostname=tls_verify,
        )
    opts.update(kw)
    if scheme in rcluster.SCHEMES:  # a Redis Cluster: the structures spread over its masters (cfemu.rcluster)
        try:
            return rcluster.connect_cluster(url, opts=opts, max_connections=max_connections,
                                            pool_timeout=pool_timeout)
        except ValueError as e:
            raise ConnectionConfigError(f"{e} in {redact(url)!r}") from None
    try:  # a duplexed CF's URL names both servers of the pair (cfemu.duplex)
        paired = duplex.pool_options(url)
    except ValueError as e:
        raise ConnectionConfigError(f"{e} ({redact(url)!r})") from None
    if paired is not None and scheme != "redis":
        raise ConnectionConfigError(f"a duplexed CF is reached over redis:// only, not {scheme}:// ({redact(url)!r})")
    if paired is not None:
        url = paired[0]
        opts.update(paired[1])
    elif scheme in _PLAIN and "connection_class" not in opts:
        opts["connection_class"] = _PLAIN[scheme]
    if max_connections is not None:
        if max_connections < 1:
            raise ConnectionConfigError(f"the CF connection pool needs at least 1 connection, not {max_connections}")
        pool = WaitingPool.from_url(url, max_connections=max_connections, timeout=pool_timeout, **opts)
        return redis.Redis(connection_pool=pool)
    return redis.Redis.from_url(url, **opts)
