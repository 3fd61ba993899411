"""Raw TCP connections to a door (HTTP, the exporters'), for what a well-behaved client never does: send bytes by
hand, hold a connection half-sent, and see whether the server closed it."""

from __future__ import annotations

import socket


def exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send ``data`` on a new connection to 127.0.0.1:``port`` and read until the server closes it (or ``wait``
    passes without a byte)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
