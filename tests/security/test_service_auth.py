"""The service lets nobody in by default: authentication is on, roles are checked, credentials never travel in clear
off loopback, and replays and guesses fail (docs/security.md, "The service"). Probed as an attacker would, from
outside the process: raw sockets speaking the protocol by hand, a relay in the middle that captures a real handshake
and replays it, guessed tokens, an application's token trying an operator's requests, a token sent in clear to a
non-loopback address (inside a network namespace of the test's own).

The server under attack is started the way a user starts one: the group's secrets made by `cfemu secrets init`,
found by `sqm run` through $CFEMU_SECRETS_DIR with no token on its command line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.service import protocol
from sqm.service.client import Client
from sqm.service.protocol import HEADER, NotAuthorizedError
from tests.support.fake_member import FakeMember
from tests.support.group import define_group
from tests.support.harness import lose_cf
from tests.support.service_proc import Raw, ServerProc, http_get, start_server

BIN = Path(sys.executable).parent
NO_TOKENS = {"SQM_TOKEN": "", "SQM_OPERATOR_TOKEN": ""}  # start_server's test tokens off: the secrets decide


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "CFEMU_", "SQM_"))}
    return {**env, **extra}


def secrets_init(directory: Path) -> dict[str, str]:
    """`cfemu secrets init`, as a user makes a group's secrets; the two service tokens it made."""
    r = subprocess.run([str(BIN / "cfemu"), "secrets", "init", "--dir", str(directory)], env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {"application": (directory / "service.token").read_text().strip(),
            "operator": (directory / "operator.token").read_text().strip()}


@pytest.fixture(scope="module")
def group(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, dict[str, str]]]:
    """A server that found its tokens in the group's secrets directory, and those tokens."""
    tmp = tmp_path_factory.mktemp("auth")
    tokens = secrets_init(tmp / "secrets")
    lose_cf(redis_server.client())  # a group of its own: the CF may still name another module's group
    define_group(redis_server.url, queues=("Q1", "Q2"))
    srv = start_server(redis_server.url, tmp, "QMA", env={**NO_TOKENS, "CFEMU_SECRETS_DIR": str(tmp / "secrets")})
    yield srv, tokens
    assert srv.stop() == 0, srv.log_text()


def metric(srv: ServerProc, name: str, **labels: str) -> float:
    """The value of one sample on the server's /metrics (0 when absent)."""
    status, text = http_get(srv.metrics_port, "/metrics")
    assert status == 200
    for line in text.splitlines():
        m = re.fullmatch(rf'{name}\{{(.*)\}} (\S+)', line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def login(raw: Raw, token: str, role: str = "application", client: str = "attacker") -> dict[str, Any]:
    return raw.login(token, role, client)


# --- sqm run starts secured ------------------------------------------------------------------------------------
def test_sqm_run_without_a_token_refuses_to_start(redis_url: str, tmp_path: Path) -> None:
    """No token anywhere (no flag, no variable, no secrets directory): one line that says how to get one."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([str(BIN / "sqm"), "run", "--name", "QMX", "--redis-url", redis_url, "--log-root",
                             str(tmp_path / "logs"), "--ready-file", str(ready)], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None:
            assert not ready.exists(), "sqm run started serving without any authentication"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "no service token found" in err and "cfemu secrets init" in err and "cfemu cluster up" in err, err


def test_no_auth_is_refused_on_a_non_loopback_address(redis_url: str, tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::"):
        r = subprocess.run([str(BIN / "sqm"), "run", "--name", "QMX", "--redis-url", redis_url, "--log-root",
                            str(tmp_path / "logs"), "--host", host, "--no-auth"], env=clean_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--no-auth is refused" in r.stderr and "loopback" in r.stderr, r.stderr
    # On loopback it is allowed, explicitly: every local connection is then an operator.
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QMN", "--no-auth", env=NO_TOKENS)
    try:
        raw = Raw(srv.port)
        assert raw.request("ping")["ok"]
        assert "authentication OFF" in srv.log_text()
    finally:
        assert srv.stop() == 0, srv.log_text()


# --- nothing gets in without proving a token -----------------------------------------------------------------
@pytest.mark.slow
def test_nothing_gets_in_without_proving_a_token(group: tuple[ServerProc, dict[str, str]]) -> None:
    srv, tokens = group
    before = metric(srv, "sqm_auth_failures_total", reason="not_authenticated")
    r = Raw(srv.port)  # a request without any handshake
    reply = r.request("put", {"queue": "Q1", "body": b"sneaky"})
    assert reply["error"]["reason"] == 2035 and r.closed_by_server()
    r = Raw(srv.port)  # hello (which tells nothing secret), then a request without auth
    hello = r.request("hello", {"client": "x", "nonce": os.urandom(32)})
    assert hello["ok"] and hello["result"]["auth"]["required"] and len(hello["result"]["auth"]["nonce"]) == 32
    assert "epoch" not in hello["result"]
    assert r.request("browse", {"queue": "Q1"})["error"]["reason"] == 2035 and r.closed_by_server()
    assert metric(srv, "sqm_auth_failures_total", reason="not_authenticated") == before + 2
    r = Raw(srv.port)  # a proof that is not the HMAC of the challenge
    r.request("hello", {"client": "x", "nonce": os.urandom(32)})
    assert r.request("auth", {"role": "operator", "proof": os.urandom(32)})["error"]["reason"] == 2035
    assert r.closed_by_server()
    with pytest.raises(NotAuthorizedError, match="no token"):
        Client(srv.endpoint, reconnect_timeout=1)
    with Client(srv.endpoint, token=tokens["application"]) as c:
        assert c.browse("Q1") == []  # nothing got in


class Sniffer:
    """A relay between a client and the server that records what the client sends (an eavesdropper)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        threading.Thread(target=self._one, daemon=True).start()

    def _one(self) -> None:
        conn, _ = self.listener.accept()
        up = socket.create_connection(("127.0.0.1", self.target))

        def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
            try:
                while data := src.recv(65536):
                    if record:
                        self.sent += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=pump, args=(up, conn, False), daemon=True)
        t.start()
        pump(conn, up, True)
        t.join(5)


def frames(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 4 <= len(data):
        (n,) = HEADER.unpack(data[i:i + 4])
        out.append(data[i:i + 4 + n])
        i += 4 + n
    return out


@pytest.mark.slow
def test_a_captured_handshake_is_useless(group: tuple[ServerProc, dict[str, str]]) -> None:
    """An eavesdropper records a real client's handshake and first request: the token is not in it, and replaying
    it on a new connection is refused (the server's challenge is new each time)."""
    srv, tokens = group
    spy = Sniffer(srv.port)
    with Client(f"127.0.0.1:{spy.port}", token=tokens["application"], client_name="victim") as c:
        c.put("Q2", b"the victim's", syncpoint=False)
    deadline = time.monotonic() + 5
    while len(frames(bytes(spy.sent))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    for t in tokens.values():
        assert t.encode() not in spy.sent, "a token crossed the wire"
    captured = frames(bytes(spy.sent))
    assert len(captured) >= 3  # hello, auth, put
    r = Raw(srv.port)
    r.send_bytes(captured[0])  # the victim's hello, byte for byte
    assert r.reply()["ok"]
    r.send_bytes(captured[1])  # its auth: a proof of the victim's challenge, not of this one
    replayed = r.reply()
    assert not replayed["ok"] and replayed["error"]["reason"] == 2035
    assert r.closed_by_server()
    r = Raw(srv.port)  # the replayed request alone does nothing either
    r.send_bytes(captured[2])
    assert r.reply()["error"]["reason"] == 2035
    with Client(srv.endpoint, token=tokens["application"]) as c:
        assert [m.body for m in c.browse("Q2")] == [b"the victim's"]
        c.get("Q2", syncpoint=False)


def test_a_server_that_does_not_hold_the_token_is_refused_by_the_client(tmp_path: Path) -> None:
    """The handshake is mutual: an impostor that answers every auth with ok (it cannot know the token, so its own
    proof is made up) is refused by the client before any request is sent to it."""
    def proves_nothing(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "auth":
            return {"role": "application", "proof": os.urandom(32), "epoch": 1}
        return {"qmgr": "QM1", "version": 3, "max_frame": 2**20, "session": 1,
                "auth": {"required": True, "methods": ["hmac-sha256"], "nonce": os.urandom(32)}}

    impostor = FakeMember(proves_nothing)
    try:
        with pytest.raises(NotAuthorizedError, match="did not prove it holds"):
            Client(impostor.endpoint, token="the-real-token", reconnect_timeout=0.5)
        assert impostor.ops() == ["hello", "auth"]  # no request was sent to it
    finally:
        impostor.close()


@pytest.mark.slow
def test_guessing_tokens_is_slowed_down_and_counted(group: tuple[ServerProc, dict[str, str]]) -> None:
    srv, tokens = group
    before = metric(srv, "sqm_auth_failures_total", reason="bad_proof")
    waits = []
    for i in range(6):
        r = Raw(srv.port)
        t0 = time.monotonic()
        reply = login(r, f"guess-{i}-" + "A" * 30, role="operator")
        waits.append(time.monotonic() - t0)
        assert reply["error"]["reason"] == 2035 and reply["error"]["message"].startswith("authentication failed")
        assert r.closed_by_server()
    assert waits[-1] >= 1.0 and waits[-1] > 4 * waits[0], waits  # grows with each failure from the address
    assert max(waits) < 10, waits  # and is bounded
    assert metric(srv, "sqm_auth_failures_total", reason="bad_proof") == before + 6
    t0 = time.monotonic()  # the token holder on the same address is not slowed down
    assert login(Raw(srv.port), tokens["operator"], role="operator")["ok"]
    assert time.monotonic() - t0 < 1.0
    # An unknown role gets the same answer as a wrong proof. Asked from another address (127.0.0.2), whose failures
    # are counted apart: from this one each would wait the full 3 s now.
    for role in ("application", "root", ""):
        t0 = time.monotonic()
        reply = login(Raw(srv.port, source="127.0.0.2"), tokens["operator"], role=role)
        assert reply["error"]["message"] == "authentication failed"
        assert time.monotonic() - t0 < 2.0  # not slowed down by the other address's failures


@pytest.mark.slow
def test_an_application_token_cannot_run_an_operators_requests(group: tuple[ServerProc, dict[str, str]],
                                                                redis_server: Any) -> None:
    srv, tokens = group
    admin = Admin(connect(redis_server.url))
    before = admin.queue_def("Q1")
    with Client(srv.endpoint, token=tokens["application"], client_name="app") as app:
        with pytest.raises(NotAuthorizedError) as e:
            app.define_queue("Q1", "APP1", max_msg_length=16, replace=True)
        assert e.value.reason == 2035
        with pytest.raises(NotAuthorizedError):
            app.define_structure("EVIL", max_entries=1)
        with pytest.raises(NotAuthorizedError):
            app.status()
        assert app.ping()["qmgr"] == "QMA"  # the connection goes on
        # Two-phase commit: an application resolves and lists only its own in-doubt UOWs (it names their xid).
        app.put("Q1", b"prepared by app")
        uow = app.prepare("APP-XID-1")
        with pytest.raises(NotAuthorizedError):
            app.indoubt()
        assert [u["uow"] for u in app.indoubt(xids=["APP-XID-1"])] == [uow]
        assert app.indoubt(xids=["SOMEONE-ELSES"]) == []
        with pytest.raises(NotAuthorizedError):
            app.resolve(uow, commit=False)
        with pytest.raises(NotAuthorizedError):
            app.resolve(uow, commit=False, xid="SOMEONE-ELSES")
        app.resolve(uow, commit=False, xid="APP-XID-1")
    assert admin.queue_def("Q1") == before
    assert "EVIL" not in [s.name for s in admin.structures()]
    assert metric(srv, "sqm_requests_total", op="define", result="MQRC_NOT_AUTHORIZED") >= 2
    with Client(srv.endpoint, token=tokens["operator"], role="operator") as op:
        assert op.status()["auth"] is True
        op.define_queue("Q1", "APP1", max_msg_length=before.max_msg_length, replace=True)
        op.put("Q1", b"prepared by the operator")
        uow = op.prepare("OP-XID")
        assert [u["uow"] for u in op.indoubt()] == [uow]
        op.resolve(uow, commit=False)  # an operator resolves any, without its xid
    with pytest.raises(NotAuthorizedError):  # the application token does not make an operator
        Client(srv.endpoint, token=tokens["application"], role="operator", reconnect_timeout=0.5)


@pytest.mark.slow
def test_the_tokens_are_the_groups_own_files(group: tuple[ServerProc, dict[str, str]]) -> None:
    srv, tokens = group
    assert tokens["application"] != tokens["operator"]
    assert not any(t in srv.log_text() for t in tokens.values())


# --- a bearer token in clear, off loopback ---------------------------------------------------------------------
NETNS_ADDRESS = "192.0.2.10"  # TEST-NET-1, on the loopback device of a network namespace of the test's own

NETNS_SCRIPT = r'''
import json, os, socket, subprocess, sys, time
from pathlib import Path
from cfemu import credentials
from cfemu.embedded import EmbeddedRedis
from sqm.service.client import Client
from sqm.service.protocol import encode_frame, recv_frame

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", ADDRESS + "/32", "dev", "lo"], check=True)
tmp = Path(sys.argv[1])
passwords = credentials.create(tmp / "secrets")
cf = EmbeddedRedis(data_dir=tmp / "cf", acl_users=credentials.acl_lines(passwords)).start()
out = {}
try:
    url = credentials.with_user(cf.url, "member", passwords["member"])
    env = {**os.environ, "CFEMU_SECRETS_DIR": str(tmp / "secrets"), "SQM_TOKEN": "", "SQM_OPERATOR_TOKEN": ""}
    ready = tmp / "ready"
    srv = subprocess.Popen([sys.executable, "-m", "sqm.cli", "run", "--name", "QMNS", "--host", "0.0.0.0",
                            "--redis-url", url, "--log-root", str(tmp / "logs"), "--ready-file", str(ready)],
                           env=env, stderr=open(tmp / "server.log", "w"))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert srv.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()
        time.sleep(0.05)
    port = json.loads(ready.read_text())["port"]
    token = credentials.service_token(tmp / "secrets", create=False)

    def bearer(host):
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(encode_frame({"id": 1, "op": "hello", "args": {"client": "old", "token": token}}))
        reply = recv_frame(s, 2**20)
        s.sendall(encode_frame({"id": 2, "op": "ping", "args": {}}))
        try:
            after = recv_frame(s, 2**20)
        except (ConnectionError, OSError):
            after = None
        return {"ok": reply.get("ok"), "error": reply.get("error"), "after": after and after.get("ok")}

    out["bearer_off_loopback"] = bearer(ADDRESS)
    out["bearer_on_loopback"] = bearer("127.0.0.1")
    with Client(f"{ADDRESS}:{port}", token=token) as c:
        out["challenge_off_loopback"] = c.ping()["qmgr"]
    srv.terminate()
    srv.wait(30)
    out["log"] = (tmp / "server.log").read_text()
finally:
    cf.stop()
print(json.dumps(out))
'''.replace("ADDRESS", repr(NETNS_ADDRESS))


def _netns_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    r = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _netns_available(), reason="needs unshare --net (root) and ip to make a network namespace")
def test_a_bearer_token_in_clear_is_refused_off_loopback(tmp_path: Path) -> None:
    """Version 2's hello carried the token itself. Sent to a non-loopback address without TLS it is refused (and
    the server says to rotate it when it was valid); on loopback it still works; the challenge-response works
    everywhere. The whole group runs inside a network namespace of this test, whose only device is loopback:
    nothing leaves it."""
    r = subprocess.run(["unshare", "--net", sys.executable, "-c", NETNS_SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, timeout=240, env={**clean_env(), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    off = out["bearer_off_loopback"]
    assert off["ok"] is False and off["error"]["reason"] == 2035, off
    assert "sent in clear is refused" in off["error"]["message"] and off["after"] is None, off
    assert "IT WAS VALID" in out["log"] and "rotate it" in out["log"], out["log"][-2000:]
    assert out["bearer_on_loopback"]["ok"] is True and out["bearer_on_loopback"]["after"] is True
    assert out["challenge_off_loopback"] == "QMNS"


def test_every_client_in_the_repo_speaks_the_challenge_response() -> None:
    """No client of the repo sends a token in its hello any more (the server accepts that only on loopback or
    TLS, for clients of protocol version 2)."""
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [*root.glob("sqm/**/*.py"), *root.glob("qsg/**/*.py"), *root.glob("bench/*.py")]:
        text = path.read_text()
        # A hello frame (up to the end of its args) that carries a token; a logon's user token (a user id and token
        # that identify an application's units of work, docs/uow.md) is not the group's token and is not a hello.
        for hello in re.finditer(r'"op":\s*"hello"[^}]*\}', text):
            if re.search(r'\["token"\]|"token"', hello.group(0)):
                offenders.append(str(path.relative_to(root)))
    assert offenders == [], offenders
    assert protocol.PROTOCOL_VERSION >= 3
