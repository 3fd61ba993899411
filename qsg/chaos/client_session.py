"""One client thread's connection for a kind of chaos action (conversations, publish/subscribe): a Client of its
own, made on first use and made again after a failure closed it. An action whose client cannot be made is
skipped (no server answered): the chaos goes on."""

from __future__ import annotations

from collections.abc import Sequence

from cfemu.errors import MQError
from qsg.chaos.history import History
from sqm.service.client import Client

CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
RECONNECT_TIMEOUT_S = 5.0


class ClientSession:
    """``name``: the thread's name in the history; ``client_name``: what its Client tells the servers."""

    def __init__(self, history: History, endpoints: Sequence[tuple[str, int]], name: str, *, token: str | None,
                 client_name: str) -> None:
        self.h = history
        self.endpoints = list(endpoints)
        self.name = name
        self.token = token
        self._client_name = client_name
        self._c: Client | None = None

    def client(self) -> Client | None:
        """The client, made if there is none; None when no server answered."""
        if self._c is None:
            try:
                self._c = Client(self.endpoints, token=self.token, client_name=self._client_name,
                                 connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S,
                                 reconnect_timeout=RECONNECT_TIMEOUT_S)
            except MQError:
                return None
        return self._c

    def close(self) -> None:
        if self._c is not None:
            self._c.close()
            self._c = None
