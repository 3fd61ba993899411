"""Socket settings shared by every floor: the CF's connections (cfemu.connection) and the network service's
(sqm.service)."""

from __future__ import annotations

import socket
import struct


def set_kernel_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Blocking mode, with the kernel timing out a receive or a send (SO_RCVTIMEO, SO_SNDTIMEO: the call fails
    with EAGAIN, an OSError) instead of Python polling before every call, as a socket with a Python timeout does
    (a syscall each, and one more release of the GIL). None or 0: no timeout."""
    sock.settimeout(None)
    sec = 0.0 if not seconds or seconds <= 0 else seconds
    timeval = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
