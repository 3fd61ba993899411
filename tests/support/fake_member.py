"""A fake member: a socket server on 127.0.0.1 that speaks the service's framing (sqm.service.protocol) and answers
each request with what the test's ``answer`` makes of it, keeping every request it was sent. For what a real member
never does: say it needs no authentication, or answer a proof it cannot have made (an impostor on a member's port).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from sqm.service.protocol import encode_frame, ok_reply, recv_frame

Answer = Callable[[dict[str, Any]], dict[str, Any]]  # a request -> the result of its ok reply

MAX_FRAME = 1 << 20


class FakeMember:
    """Serves each connection on a thread of its own until the peer closes it (or ``close``)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    req = recv_frame(conn, MAX_FRAME)
                    self.received.append(req)
                    conn.sendall(encode_frame(ok_reply(req["id"], self.answer(req), uow=False)))
            except (ConnectionError, OSError):
                return

    def ops(self) -> list[str]:
        return [r["op"] for r in self.received]

    def close(self) -> None:
        self.sock.close()
        for t in self.threads:
            t.join(timeout=5)
