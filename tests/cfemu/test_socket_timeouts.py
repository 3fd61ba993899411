"""cfemu.sockets' kernel timeouts: what is left of a deadline, however small, is a timeout, never none."""

from __future__ import annotations

import socket
import struct
import time

from cfemu.sockets import set_kernel_timeout, set_receive_timeout


def _timeout_of(sock: socket.socket) -> tuple[int, int]:
    sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll")))
    return sec, usec


def test_a_timeout_below_a_microsecond_is_not_no_timeout() -> None:
    a, b = socket.socketpair()
    try:
        set_kernel_timeout(a, 5.0)
        set_receive_timeout(a, 5e-7)  # a deadline all but passed
        assert _timeout_of(a) != (0, 0)  # (0, 0) would wait for ever on a peer that never answers
        started = time.monotonic()
        try:
            a.recv(1)
        except (BlockingIOError, TimeoutError):
            pass
        assert time.monotonic() - started < 1.0
        set_receive_timeout(a, 1.25)
        sec, usec = _timeout_of(a)
        assert sec == 1 and abs(usec - 250_000) < 20_000  # the kernel keeps it in ticks (4 ms at HZ=250)
        set_receive_timeout(a, None)
        assert _timeout_of(a) == (0, 0)  # None: no timeout, as asked
    finally:
        a.close()
        b.close()
