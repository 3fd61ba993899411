"""The SQM network service through real `sqm run` processes: bad frames, authentication, limits, disconnects,
health and metrics, TLS, graceful shutdown and fencing. Every abuse is followed by a request that must work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.errors import BadRequestError, MessageTooBigError, NoMessageError, UnknownObjectError
from sqm.log import LogReader
from sqm.service.client import Client, client_tls_context
from sqm.service.protocol import (
    HEADER,
    FrameTooLargeError,
    NotAuthorizedError,
    QueueManagerUnavailableError,
    encode_frame,
    recv_frame,
)
from sqm.service.server import EXIT_FENCED
from tests.support.group import define_group

TOKEN = "t0ken-for-tests"
MAX_FRAME = 64 * 1024


@dataclass
class ServerProc:
    """One `sqm run` child process."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_root: Path
    stderr: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.stderr.read_text(errors="replace")


def start_server(redis_url: str, tmp: Path, name: str, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 30.0) -> ServerProc:
    ready = tmp / f"{name}.ready"
    stderr = tmp / f"{name}.stderr"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sqm.cli", "run", "--name", name, "--redis-url", redis_url, "--log-root",
           str(tmp / "logs"), "--port", "0", "--metrics-port", "0", "--ready-file", str(ready), *args]
    with open(stderr, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{stderr.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{name} did not start:\n{stderr.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return ServerProc(name, proc, info["port"], info["metrics_port"], tmp / "logs", stderr)


class Raw:
    """A raw protocol connection, for sending what a well-behaved client never would."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.ids = 100

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, op: str, args: Any = None, **fields: Any) -> dict[str, Any]:
        self.ids += 1
        self.sock.sendall(encode_frame({"id": self.ids, "op": op, "args": args or {}, **fields}))
        return self.reply()

    def reply(self) -> dict[str, Any]:
        reply = recv_frame(self.sock, 2**24)
        assert isinstance(reply, dict)
        return reply

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def redis_url(fresh_redis: Any) -> str:
    """A CF of the test's own. The module's server is a member of another group (its log root elsewhere) and
    re-joins whatever CF it is connected to, claiming it for its group's log root: a shared CF flushed under it
    would refuse a member started here with another log root (one log root per group: cfemu.repository)."""
    return str(fresh_redis.url)


@pytest.fixture(scope="module")
def server(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One token-protected server for the module (the CF is flushed once, here)."""
    client = redis_server.client()
    client.flushall()
    client.close()
    define_group(redis_server.url, queues=("Q1", "Q2"))
    admin = Admin(connect(redis_server.url))
    admin.define_queue("SMALL", "APP1", max_msg_length=1024)
    srv = start_server(redis_server.url, tmp_path_factory.mktemp("srv"), "QM1", "--token", TOKEN, "--max-frame",
                       str(MAX_FRAME))
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def raw(server: ServerProc) -> Iterator[Raw]:
    r = Raw(server.port)
    assert r.request("hello", {"token": TOKEN})["ok"]
    yield r
    r.close()


def client(server: ServerProc) -> Client:
    return Client(server.endpoint, token=TOKEN)


def test_put_get_browse_round_trip_with_every_field(server: ServerProc) -> None:
    with client(server) as a, client(server) as b:
        with a.unit_of_work():
            sent = a.put("Q1", b"\x00body\xff", priority=7, correlid=b"corr", properties={"k": "v", "n": 3})
        assert [m.body for m in b.browse("Q1")] == [b"\x00body\xff"]
        got = b.get("Q1", correlid=b"corr")
        b.commit()
        assert (got.body, got.priority, got.correlid, got.msgid, got.properties) == (
            b"\x00body\xff", 7, b"corr", sent.msgid, {"k": "v", "n": 3})
        with pytest.raises(NoMessageError) as e:
            b.get("Q1", wait_ms=50)
        assert e.value.reason == 2033


def test_garbage_and_invalid_msgpack_get_error_replies_and_the_connection_goes_on(raw: Raw) -> None:
    raw.send_bytes(HEADER.pack(5) + b"hello")  # a fixint followed by extra bytes
    r = raw.reply()
    assert not r["ok"] and r["id"] is None and r["error"]["reason"] == 2046
    assert "msgpack" in r["error"]["message"]
    raw.send_bytes(HEADER.pack(1) + b"\xc1")  # a byte msgpack never uses
    assert raw.reply()["error"]["reason_name"] == "MQRC_OPTIONS_ERROR"
    raw.send_bytes(encode_frame([1, 2, 3]))  # valid msgpack, not a request
    assert "must be a map" in raw.reply()["error"]["message"]
    r = raw.request("put", "not-a-map")
    assert not r["ok"] and r["id"] == raw.ids and "'args' must be a map" in r["error"]["message"]
    assert raw.request("ping")["ok"]


def test_wrong_typed_argument_and_unknown_op_are_bad_requests(raw: Raw) -> None:
    r = raw.request("put", {"queue": "Q1", "body": b"x", "priority": "high"})
    assert r["error"]["type"] == "BadRequestError" and "'priority' must be int, not str" in r["error"]["message"]
    r = raw.request("put", {"queue": "Q1", "body": "text, not bytes"})
    assert "'body' must be bytes" in r["error"]["message"]
    r = raw.request("get", {})
    assert "missing argument 'queue'" in r["error"]["message"]
    r = raw.request("explode", {})
    assert "unknown operation 'explode'" in r["error"]["message"]
    assert raw.request("ping")["ok"]


def test_a_frame_over_the_limit_is_refused_and_that_connection_closed(server: ServerProc, raw: Raw) -> None:
    raw.send_bytes(HEADER.pack(MAX_FRAME + 1) + b"x" * 100)
    r = raw.reply()
    assert r["error"]["type"] == "FrameTooLargeError" and r["error"]["reason"] == 2010
    assert raw.closed_by_server()
    with client(server) as c:  # the client library refuses it before sending anything
        with pytest.raises(FrameTooLargeError):
            c.put("Q1", b"x" * (MAX_FRAME + 10))
        assert c.ping()["qmgr"] == "QM1"


def test_unauthenticated_clients_are_refused(server: ServerProc) -> None:
    r = Raw(server.port)
    reply = r.request("put", {"queue": "Q1", "body": b"sneaky"})
    assert reply["error"]["reason"] == 2035 and "authenticate first" in reply["error"]["message"]
    assert r.closed_by_server()
    r = Raw(server.port)
    assert r.request("hello", {"token": "wrong"})["error"]["type"] == "NotAuthorizedError"
    assert r.closed_by_server()
    with pytest.raises(NotAuthorizedError):
        Client(server.endpoint, token="wrong", reconnect_timeout=1)
    with pytest.raises(NotAuthorizedError):
        Client(server.endpoint, reconnect_timeout=1)
    with client(server) as c:
        assert c.browse("Q2") == []  # nothing got in


def test_oversized_message_and_unknown_queue_keep_the_uow_intact(server: ServerProc) -> None:
    with client(server) as a:
        a.put("Q2", b"keep me")
        with pytest.raises(MessageTooBigError) as e:
            a.put("SMALL", b"x" * 2000)
        assert e.value.reason == 2030
        with pytest.raises(UnknownObjectError) as u:
            a.put("NO.SUCH.Q", b"x")
        assert u.value.reason == 2085 and "NO.SUCH.Q" in str(u.value)
        with pytest.raises(BadRequestError):
            a.put("Q2", b"x", priority=42)
        assert a.uow_open
        a.commit()
        assert a.get("Q2").body == b"keep me"
        a.commit()


def test_nothing_is_lost_across_abuse_from_other_connections(server: ServerProc) -> None:
    with client(server) as a:
        with a.unit_of_work():
            for i in range(20):
                a.put("Q1", f"m{i}".encode())
        for junk in (b"\xff\xff\xff\xff", HEADER.pack(3) + b"\xc1\xc1\xc1", b"GET / HTTP/1.0\r\n\r\n"):
            r = Raw(server.port)
            r.send_bytes(junk)
            r.close()
        got = set()
        while True:
            try:
                got.add(a.get("Q1").body)
            except NoMessageError:
                break
        a.commit()
        assert got == {f"m{i}".encode() for i in range(20)}


def test_a_closed_connection_backs_out_its_open_uow(server: ServerProc) -> None:
    with client(server) as a:
        a.put("Q1", b"redeliver me", syncpoint=False)
        b = client(server)
        assert b.get("Q1").body == b"redeliver me"
        b.close()  # no commit: the server backs the get out
        m = a.get("Q1", wait_ms=5000)
        assert (m.body, m.backout_count) == (b"redeliver me", 1)
        a.commit()


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_readiness_and_metrics(server: ServerProc) -> None:
    with client(server) as a:
        a.put("Q2", b"counted")
        a.put("Q2", b"in flight")
        a.commit()
        a.get("Q2")  # one UG, left open while scraping
        assert http_get(server.metrics_port, "/healthz") == (200, "ok\n")
        assert http_get(server.metrics_port, "/readyz") == (200, "ready\n")
        status, text = http_get(server.metrics_port, "/metrics")
        a.backout()
    assert status == 200
    assert 'sqm_queue_depth{queue="Q2",state="UG",structure="APP1"} 1.0' in text
    assert 'sqm_queue_depth{queue="Q2",state="CP",structure="APP1"} 1.0' in text
    assert 'sqm_uows{qmgr="QM1",state="INFLIGHT"} 1.0' in text
    for name in ("sqm_commits_total", "sqm_fsyncs_total", "sqm_log_bytes_total", "sqm_peer_recoveries_total",
                 "sqm_requests_total", "sqm_connections"):
        assert name in text
    assert http_get(server.metrics_port, "/nope")[0] == 404
    with client(server) as a:  # the module's server and queues are shared: leave Q2 as it was found
        a.get("Q2")
        a.get("Q2")
        a.commit()


def test_backup_age_metric_follows_the_catalog(redis_url: str, tmp_path: Path) -> None:
    from sqm.service.metrics import last_backup_age

    client_ = connect(redis_url)
    define_group(redis_url)
    admin = Admin(client_)
    assert last_backup_age(admin, "APP1") is None
    admin.record_backup("APP1", {"id": "B1", "start_lrsn": 1, "ended_at": "2020-01-01T00:00:00+00:00"})
    admin.record_backup("APP1", {"id": "B2", "start_lrsn": 2, "ended_at": "2020-01-01T00:01:40+00:00"})
    client_.hset(keys.meta("APP1"), "last_backup", "B2")
    t = 1577836900.0 + 50  # 2020-01-01T00:01:40Z + 50 s
    assert last_backup_age(admin, "APP1", now=t) == pytest.approx(50)


def test_sigterm_shuts_down_gracefully_with_a_checkpoint(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QM7")
    with Client(srv.endpoint) as c:
        c.put("Q1", b"durable")
        c.commit()
        c.put("Q1", b"in flight at shutdown")
        assert srv.stop(signal.SIGTERM) == 0
    records = [r for _, r in LogReader(tmp_path / "logs" / "QM7").records()]
    assert records[-1]["k"] == "CHECKPOINT" and records[-1]["why"] == "shutdown"
    assert "shutdown checkpoint taken" in srv.log_text()
    assert not (tmp_path / "QM7.ready").exists()
    cf = connect(redis_url)
    assert "QM7" not in Admin(cf).members()  # it left the group: no peer recovery needed
    assert CF(cf).structure("APP1").depths()["Q1"] == {"UP": 0, "CP": 1, "UG": 0, "EX": 0}


def test_a_fenced_server_exits_with_its_own_code(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QM8", "--lease-ms", "900")
    admin = Admin(connect(redis_url))
    srv.proc.send_signal(signal.SIGSTOP)  # paused past its lease
    try:
        deadline = time.monotonic() + 10
        while "QM8" not in admin.lapsed_members():
            assert time.monotonic() < deadline, "the lease never lapsed"
            time.sleep(0.1)
        assert admin.fence("QM8")  # what peer recovery does to a member it takes over
    finally:
        srv.proc.send_signal(signal.SIGCONT)
    assert srv.proc.wait(timeout=20) == EXIT_FENCED
    assert "was fenced by peer recovery" in srv.log_text()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def test_mutual_tls(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(d / f"{who}.key"),
                 "-out", str(d / f"{who}.csr"))
        (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", str(d / f"{who}.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
                 str(d / "ca.key"), "-CAcreateserial", "-days", "1", "-extfile", str(d / "ext"),
                 "-out", str(d / f"{who}.pem"))
    srv = start_server(redis_url, tmp_path, "QM9", "--tls-cert", str(d / "server.pem"), "--tls-key",
                       str(d / "server.key"), "--tls-ca", str(d / "ca.pem"))
    try:
        good = client_tls_context(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"))
        with Client(srv.endpoint, tls=good) as c:
            c.put("Q1", b"over TLS", syncpoint=False)
            assert c.get("Q1", syncpoint=False).body == b"over TLS"
        with pytest.raises(QueueManagerUnavailableError, match="closed by the server|SSL|certificate"):
            Client(srv.endpoint, tls=client_tls_context(str(d / "ca.pem")), reconnect_timeout=0.5)
        plain = Raw(srv.port)  # a plain-text client on the TLS port: the handshake fails, the server closes
        plain.send_bytes(encode_frame({"id": 1, "op": "ping", "args": {}}))
        assert plain.closed_by_server()
        with Client(srv.endpoint, tls=good) as c:
            assert c.ping()["qmgr"] == "QM9"
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_msgpack_of_the_reply_is_plain(raw: Raw) -> None:
    """The protocol is documented msgpack: any msgpack library can talk to it."""
    raw.sock.sendall(HEADER.pack(len(b := msgpack.packb({"id": 7, "op": "ping"}))) + b)
    r = raw.reply()
    assert r["id"] == 7 and r["ok"] and r["result"]["qmgr"] == "QM1"


@pytest.mark.parametrize("syncpoint", [False, True])
def test_a_waiting_get_ends_with_its_connection_and_takes_nothing(server: ServerProc, syncpoint: bool) -> None:
    """Issue 10, hole 9: a get with a 20 s wait whose client left after 0.5 s went on waiting, then consumed a
    message put 1 s later (GET and COMMIT logged) and delivered it to nobody."""
    queue = "Q2"
    r = Raw(server.port)
    assert r.request("hello", {"token": TOKEN})["ok"]
    r.send_bytes(encode_frame({"id": 1, "op": "get", "args": {"queue": queue, "wait_ms": 20_000, "syncpoint": syncpoint}}))
    time.sleep(0.5)
    r.close()  # the client leaves mid-wait
    time.sleep(0.5)
    body = b"for a client that is gone %d" % syncpoint
    with client(server) as c:
        c.put(queue, body, syncpoint=False)
        time.sleep(1.0)  # the old wait would have polled the queue many times by now
        got = c.get(queue, syncpoint=False, wait_ms=1000)
    assert got.body == body and got.backout_count == 0, "the message was taken by a get whose client had left"
