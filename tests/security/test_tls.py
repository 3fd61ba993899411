"""TLS for real (docs/security.md, "TLS to the CF" and "TLS to the service"): the service's TLS and mutual TLS
through `sqm run`, and the CF client's `rediss://` path with certificate verification against a real TLS endpoint.
The bundled redis-server has no TLS, so a TLS-terminating proxy written here (asyncio + ssl) stands in front of the
session's CF. Certificates are made by the test (tests/support/certs.py). Each refusal is probed from outside, as a
peer would: a server whose certificate another CA signed, a client certificate from another CA, none at all, plain
text on a TLS port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.service.client import Client, client_tls_context
from sqm.service.protocol import QueueManagerUnavailableError, encode_frame
from tests.support.certs import CA, issue, make_ca
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, Raw, ServerProc, start_server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two CAs: the group's (a server and a client certificate) and a stranger's (a client certificate)."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "group-ca"), make_ca(d, "other-ca")
    return {"dir": d, "ca": ca, "other": other, "server": issue(ca, d, "server"),
            "client": issue(ca, d, "client"), "stranger": issue(other, d, "stranger")}


@pytest.fixture
def mtls_server(redis_url: str, tmp_path: Path, pki: dict[str, Any]) -> Iterator[ServerProc]:
    define_group(redis_url)
    cert, key = pki["server"]
    srv = start_server(redis_url, tmp_path, "QMT", "--tls-cert", str(cert), "--tls-key", str(key),
                       "--tls-ca", str(pki["ca"].cert))
    yield srv
    assert srv.stop() == 0, srv.log_text()


def test_the_service_over_mutual_tls(mtls_server: ServerProc, pki: dict[str, Any]) -> None:
    ca: CA = pki["ca"]
    good = client_tls_context(str(ca.cert), *map(str, pki["client"]))
    with Client(mtls_server.endpoint, token=TOKEN, tls=good, client_name="tls-app") as c:
        c.put("Q1", b"over mutual TLS", syncpoint=False)
        assert c.get("Q1", syncpoint=False).body == b"over mutual TLS"
        assert c.ping()["qmgr"] == "QMT"


def test_a_client_certificate_from_another_ca_is_refused(mtls_server: ServerProc, pki: dict[str, Any]) -> None:
    ca: CA = pki["ca"]
    stranger = client_tls_context(str(ca.cert), *map(str, pki["stranger"]))
    with pytest.raises(QueueManagerUnavailableError, match="SSL|certificate|closed|reset|EOF"):
        Client(mtls_server.endpoint, token=TOKEN, tls=stranger, reconnect_timeout=0.5)
    # At the TLS layer, without the client library: the server's verdict is an alert, then the end.
    raw = socket.create_connection(("127.0.0.1", mtls_server.port), timeout=10)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        tls = stranger.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(encode_frame({"id": 1, "op": "ping", "args": {}}))
        if tls.recv(1) == b"":  # TLS 1.3: the alert arrives after the client's handshake completed
            raise ConnectionError("closed by the server")
    raw.close()
    with pytest.raises(QueueManagerUnavailableError):  # no client certificate at all
        Client(mtls_server.endpoint, token=TOKEN, tls=client_tls_context(str(ca.cert)), reconnect_timeout=0.5)
    plain = Raw(mtls_server.port)  # plain text on the TLS port
    plain.send_bytes(encode_frame({"id": 1, "op": "ping", "args": {}}))
    assert plain.closed_by_server()
    good = client_tls_context(str(ca.cert), *map(str, pki["client"]))
    with Client(mtls_server.endpoint, token=TOKEN, tls=good) as c:  # and the server goes on
        assert c.ping()["qmgr"] == "QMT"


def test_a_server_certificate_from_another_ca_is_refused_by_the_client(redis_url: str, tmp_path: Path,
                                                                       pki: dict[str, Any]) -> None:
    define_group(redis_url)
    cert, key = pki["server"]
    srv = start_server(redis_url, tmp_path, "QMS", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        with Client(srv.endpoint, token=TOKEN, tls=client_tls_context(str(pki["ca"].cert))) as c:
            assert c.ping()["qmgr"] == "QMS"  # TLS without client certificates
        with pytest.raises(QueueManagerUnavailableError, match="certificate verify failed"):
            Client(srv.endpoint, token=TOKEN, tls=client_tls_context(str(pki["other"].cert)), reconnect_timeout=0.5)
    finally:
        assert srv.stop() == 0, srv.log_text()


# --- the CF client's rediss:// path ---------------------------------------------------------------------------
class TLSTerminator:
    """A TLS-terminating proxy in front of a plain TCP server (the CF): what a TLS-enabled Redis looks like."""

    def __init__(self, target: tuple[str, int], cert: Path, key: Path) -> None:
        self.target = target
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.handshakes_failed = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> TLSTerminator:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        self.loop.set_exception_handler(self._on_error)
        return await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.ctx)

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ssl.SSLError | ConnectionError):
            self.handshakes_failed += 1

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def stop(self) -> None:
        if self._server is not None:
            self.loop.call_soon_threadsafe(self._server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def tls_cf(redis_server: Any, redis_url: str, pki: dict[str, Any]) -> Iterator[tuple[str, TLSTerminator]]:
    """The session's CF behind a TLS endpoint; the member's rediss:// URL for it."""
    host, port = redis_server.host, redis_server.port
    cert, key = pki["server"]
    proxy = TLSTerminator((host, port), cert, key).start()
    url = redis_url.replace("redis://", "rediss://", 1).replace(f":{port}/", f":{proxy.port}/")
    try:
        yield url, proxy
    finally:
        proxy.stop()


def test_the_cf_client_verifies_the_cf_certificate(tls_cf: tuple[str, TLSTerminator], pki: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, proxy = tls_cf
    monkeypatch.setenv("CFEMU_TLS_CA", str(pki["ca"].cert))
    client = connect(url)
    try:
        assert client.ping()
        define_group(url, queues=("Q1",))  # the group's CF operations, over TLS, as a member
        assert [s.name for s in Admin(client).structures()] == ["APP1"]
    finally:
        client.close()

    monkeypatch.setenv("CFEMU_TLS_CA", str(pki["other"].cert))  # a CF whose certificate another CA signed
    wrong = connect(url)
    with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
        wrong.ping()
    wrong.close()
    monkeypatch.delenv("CFEMU_TLS_CA")  # the system's CAs do not know the group's CA either
    with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
        connect(url).ping()


def test_a_member_runs_over_rediss(tls_cf: tuple[str, TLSTerminator], redis_url: str, pki: dict[str, Any],
                                   tmp_path: Path) -> None:
    """`sqm run` with a rediss:// CF URL and the group's CA: the whole member path over TLS."""
    url, _ = tls_cf
    define_group(redis_url)
    srv = start_server(url, tmp_path, "QMR", env={"CFEMU_TLS_CA": str(pki["ca"].cert)})
    try:
        with Client(srv.endpoint, token=TOKEN) as c:
            c.put("Q1", b"through a TLS CF", syncpoint=False)
            assert c.get("Q1", syncpoint=False).body == b"through a TLS CF"
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_a_client_tls_file_that_cannot_be_used_is_named_in_one_line(tmp_path: Path) -> None:
    """kombu's ssl={"ca": "/nonexistent"} said only "[Errno 2] No such file or directory", naming no file."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    for args, said in (((str(tmp_path / "missing.pem"),), f"the CA file {tmp_path / 'missing.pem'}: No such file"),
                       ((str(junk),), f"the CA file {junk}: not PEM"),
                       ((None, str(junk), str(junk)), f"the certificate {junk} or its key {junk}: not PEM")):
        with pytest.raises(ValueError) as refused:
            client_tls_context(*args)
        assert said in str(refused.value) and "\n" not in str(refused.value)
