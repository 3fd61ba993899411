"""Is a CF still loading its data? Asked on a raw socket: redis-py's own client would retry or raise."""

from __future__ import annotations

import socket


def answers_loading(port: int, timeout: float = 10) -> bool:
    """Does the server on 127.0.0.1:port answer -LOADING (reloading its dataset)?"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET x\r\n")
            return s.recv(100).startswith(b"-LOADING")
    except OSError:
        return False
