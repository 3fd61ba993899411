"""A `sqm run` server as the service tests run it: a child process started on the test's CF with the tests'
tokens, its ports and log; a raw protocol connection for what a well-behaved client never sends; the group and
the clients those tests share."""

from __future__ import annotations

import contextlib
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

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.service import protocol
from sqm.service.client import Client
from sqm.service.protocol import encode_frame, recv_frame
from tests.support.group import define_group
from tests.support.harness import lose_cf
from tests.support.started_procs import started

TOKEN = "t0ken-for-tests"  # the application role's
OP_TOKEN = "operator-t0ken-for-tests"
TOKENS_ENV = {"SQM_TOKEN": TOKEN, "SQM_OPERATOR_TOKEN": OP_TOKEN}
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
           str(tmp / "logs"), "--port", "0", "--metrics-port", "0", "--ready-file", str(ready),
           "--metrics-cache", "0", *args]  # a test reads /metrics right after what it counts: no cached page
    with open(stderr, "ab") as err:  # the tests' tokens unless env or a flag gives others
        proc = started(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                        env={**os.environ, **TOKENS_ENV, **(env or {})}))
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


def fresh_group(redis_server: Any) -> Admin:
    """The shared CF emptied and a group defined on it again (structure APP1 with Q1): its Admin, to define
    more."""
    client = redis_server.client()
    lose_cf(client)
    client.close()
    define_group(redis_server.url, queues=("Q1",))
    return Admin(connect(redis_server.url))


@contextlib.contextmanager
def serving_pair(redis_url: str, group: Path) -> Iterator[tuple[ServerProc, ServerProc]]:
    """QM1 and QM2 serving the group with the application TOKEN, their logs under group; each must stop cleanly
    (exit status 0) at the end."""
    qm1 = start_server(redis_url, group, "QM1", "--token", TOKEN)
    qm2 = start_server(redis_url, group, "QM2", "--token", TOKEN)
    yield qm1, qm2
    assert qm1.stop() == 0, qm1.log_text()
    assert qm2.stop() == 0, qm2.log_text()


def logged_on(srv: ServerProc, user: str, token: str = "", **kw: Any) -> Client:
    """A client of srv with the application TOKEN, logged on as user."""
    c = Client(srv.endpoint, token=TOKEN, **kw)
    c.logon(user, token)
    return c


class Raw:
    """A raw protocol connection, for sending what a well-behaved client never would."""

    def __init__(self, port: int, source: str | None = None) -> None:
        """source: the local address to connect from (any of 127.0.0.0/8 reaches a server on 127.0.0.1): a
        peer address of its own, as the server counts some things per address."""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                             source_address=None if source is None else (source, 0))
        self.ids = 100

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def login(self, token: str = TOKEN, role: str = "application", client: str = "raw") -> dict[str, Any]:
        """The challenge-response handshake by hand (sqm.service.protocol): hello, then auth with the HMAC."""
        nonce = os.urandom(32)
        hello = self.request("hello", {"client": client, "nonce": nonce})
        assert hello["ok"], hello
        h = hello["result"]
        transcript = protocol.auth_transcript(
            "client", role=role, server_nonce=h["auth"]["nonce"], client_nonce=nonce, qmgr=h["qmgr"],
            session=h["session"], client=client, client_max_frame=0, server_max_frame=h["max_frame"])
        return self.request("auth", {"role": role, "proof": protocol.auth_proof(token, transcript)})

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


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
