"""docs/protocol.md is the wire protocol's specification: every operation of the table has its section, the
handshake's test vector is what the code computes, and a client written from the page alone (raw sockets, msgpack,
hmac; nothing of sqm.service) authenticates, puts and gets against a real `sqm run`."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.support.group import define_group

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TOKEN = "spec-application-t0ken"
OP_TOKEN = "spec-operator-t0ken"


def sections() -> set[str]:
    return set(re.findall(r"^### `([a-z_]+)`$", DOC.read_text(), re.MULTILINE))


def test_every_operation_of_the_table_has_its_section() -> None:
    from sqm.service.ops import OPS

    assert set(OPS) <= sections(), f"operations without a section in docs/protocol.md: {set(OPS) - sections()}"
    assert sections() <= set(OPS), f"sections for no operation: {sections() - set(OPS)}"


def test_the_limits_on_the_page_are_the_code_s() -> None:
    from sqm.service.protocol import MAX_FRAME, MIN_FRAME, PRE_HELLO_MAX_FRAME, PROTOCOL_VERSION

    text = DOC.read_text()
    for name, value in (("PRE_HELLO_MAX_FRAME", PRE_HELLO_MAX_FRAME), ("MIN_FRAME", MIN_FRAME),
                        ("MAX_FRAME", MAX_FRAME)):
        assert f"| `{name}` | {value:,} |" in text, name
    assert f"Version {PROTOCOL_VERSION}." in text


def test_the_handshake_test_vector_is_what_the_code_computes() -> None:
    from sqm.service.protocol import auth_proof, auth_transcript

    text = DOC.read_text()
    block = text.split('transcript("client") =', 1)[1].split("```", 1)[0]
    hexes = re.findall(r"[0-9a-f]{20,}", block)
    transcript_hex = "".join(hexes[:-2])
    client_proof, server_proof = hexes[-2:]
    details: dict[str, Any] = dict(role="application", server_nonce=bytes(range(32)), client_nonce=bytes(range(32, 64)),
                                   qmgr="QM1", session=7, client="docs", client_max_frame=104989184,
                                   server_max_frame=104989184)
    assert auth_transcript("client", **details).hex() == transcript_hex
    assert auth_proof("example-token", auth_transcript("client", **details)).hex() == client_proof
    assert auth_proof("example-token", auth_transcript("server", **details)).hex() == server_proof
    assert spec_transcript("client", **details).hex() == transcript_hex  # this page's own client, below


# --- a client from the page alone --------------------------------------------------------------------------------
def spec_transcript(side: str, *, role: str, server_nonce: bytes, client_nonce: bytes, qmgr: str, session: int,
                    client: str, client_max_frame: int, server_max_frame: int) -> bytes:
    return msgpack.packb(["sqm-auth-v3", side, role, server_nonce, client_nonce, qmgr, session, client,
                          client_max_frame, server_max_frame], use_bin_type=True)


class SpecClient:
    """Framing: a u32 big-endian length, then a msgpack map; one request in flight."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.next_id = 0

    def send(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        body = msgpack.packb({"id": self.next_id, "op": op, "args": args}, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)
        (length,) = struct.unpack(">I", self.exactly(4))
        reply = msgpack.unpackb(self.exactly(length), raw=False)
        assert reply["id"] == self.next_id, reply
        return dict(reply)

    def exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "the member closed the connection"
            buf += chunk
        return buf

    def authenticate(self, token: str, role: str = "application") -> dict[str, Any]:
        nonce, max_frame, name = os.urandom(32), 1 << 20, "spec-client"
        hello = self.send("hello", {"client": name, "max_frame": max_frame, "version": 3, "nonce": nonce})
        assert hello["ok"], hello
        h = hello["result"]
        assert h["auth"]["required"] and "hmac-sha256" in h["auth"]["methods"] and len(h["auth"]["nonce"]) == 32
        assert h["reply_frame"] == min(max_frame, h["max_frame"])

        def proof(side: str) -> bytes:
            transcript = spec_transcript(side, role=role, server_nonce=h["auth"]["nonce"], client_nonce=nonce,
                                         qmgr=h["qmgr"], session=h["session"], client=name,
                                         client_max_frame=max_frame, server_max_frame=h["max_frame"])
            return hmac.new(token.encode(), transcript, hashlib.sha256).digest()

        done = self.send("auth", {"role": role, "proof": proof("client")})
        assert done["ok"], done
        assert hmac.compare_digest(done["result"]["proof"], proof("server")), "the member did not prove the token"
        return dict(h)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def member(fresh_redis: Any, tmp_path: Path) -> Iterator[int]:
    """One `sqm run` on a CF of its own; its port."""
    define_group(str(fresh_redis.url), queues=("Q1",))
    ready, stderr = tmp_path / "QM1.ready", tmp_path / "QM1.stderr"
    with open(stderr, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sqm.cli", "run", "--name", "QM1", "--redis-url", str(fresh_redis.url),
             "--log-root", str(tmp_path / "logs"), "--port", "0", "--metrics-port", "0", "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "SQM_TOKEN": TOKEN, "SQM_OPERATOR_TOKEN": OP_TOKEN})
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.02)
        yield int(json.loads(ready.read_text())["port"])
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, stderr.read_text()


def test_a_client_written_from_the_page_alone_puts_and_gets(member: int) -> None:
    c = SpecClient(member)
    try:
        assert c.authenticate(TOKEN)["qmgr"] == "QM1"
        put = c.send("put", {"queue": "Q1", "body": b"from the spec", "priority": 4, "correlid": b"c-1",
                             "properties": {"lang": "any"}})
        assert put["ok"] and put["uow"] is True, put
        assert put["result"]["body"] == b"" and len(put["result"]["msgid"]) == 24
        assert c.send("commit", {}) == {"id": c.next_id, "ok": True, "result": None, "uow": False}
        got = c.send("get", {"queue": "Q1", "syncpoint": False, "wait_ms": 1000})
        assert got["ok"], got
        m = got["result"]
        assert (m["body"], m["priority"], m["correlid"], m["properties"], m["msgid"]) == (
            b"from the spec", 4, b"c-1", {"lang": "any"}, put["result"]["msgid"])
        assert set(m) == {"body", "queue", "msgid", "correlid", "priority", "persistent", "expiry", "put_time",
                          "backout_count", "properties", "entry_id"}
        empty = c.send("get", {"queue": "Q1", "syncpoint": False})
        assert not empty["ok"]
        assert empty["error"]["type"] == "NoMessageError" and empty["error"]["reason"] == 2033, empty
        assert empty["error"]["reason_name"] == "MQRC_NO_MSG_AVAILABLE"
        denied = c.send("status", {})  # an operator's: refused, and the connection goes on
        assert denied["error"]["reason"] == 2035 and c.send("ping", {})["ok"]
    finally:
        c.close()


def test_a_wrong_proof_is_refused_and_the_connection_closed(member: int) -> None:
    c = SpecClient(member)
    try:
        hello = c.send("hello", {"client": "x", "nonce": os.urandom(32)})
        assert hello["ok"]
        refused = c.send("auth", {"role": "application", "proof": bytes(32)})
        assert refused["error"]["type"] == "NotAuthorizedError" and refused["error"]["reason"] == 2035
        assert c.sock.recv(1) == b""
    finally:
        c.close()
