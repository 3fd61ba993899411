"""A slowloris on a door, for the doors' eviction tests: connections from several loopback source addresses
(127.0.0.2, 127.0.0.3, ...: each under the per-address cap, all together at the total cap), each sending a partial
request head and reopened at once whenever the server closes it. Runs in a thread of the test until stopped."""

from __future__ import annotations

import selectors
import socket
import threading

PARTIAL_HEAD = b"GET /ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message HTTP/1.1\r\nHost: x\r\n"


class Slowloris:
    """``per_source`` connections from each of ``sources`` to 127.0.0.1:``port``, held until stop()."""

    def __init__(self, port: int, sources: list[str], per_source: int, partial: bytes = PARTIAL_HEAD) -> None:
        self.port, self.sources, self.per_source, self.partial = port, sources, per_source, partial
        self.opened = 0
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def _open(self, source: str) -> None:
        s = socket.socket()
        s.bind((source, 0))
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        try:
            s.send(self.partial)
        except OSError:
            pass
        self._sel.register(s, selectors.EVENT_READ, source)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self._sel.unregister(s)
                    s.close()
                    self._open(key.data)

    def __enter__(self) -> Slowloris:
        for source in self.sources:
            for _ in range(self.per_source):
                self._open(source)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._sel.get_map().values()):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            s.close()
        self._sel.close()
