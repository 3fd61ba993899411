"""The client's end of one connection to a server: a request's frame sent and its reply read in as few calls as the
protocol allows (sqm.service.protocol: a server sends nothing but the one reply to each request).

What a request costs the client process, since its CPU counts beside the server's (BENCHMARKS.md, "peers"):

* one ``send`` of the whole frame (its header and body in one buffer);
* usually one ``recv_into`` a buffer kept for the connection, the reply unpacked where it lies (not copied out);
* before the send, one ``getsockopt(TCP_INFO)`` that tells whether the server closed the connection since its last
  reply (its state is no longer ESTABLISHED: a FIN or a reset came). Unlike ``poll``, it does not release the GIL,
  so the client's other threads are not woken for nothing each request. A TLS connection is polled instead: TLS
  records that carry no data (a TLS 1.3 session ticket) may arrive between replies;
* no ``setsockopt``: a plain socket keeps the kernel's receive timeout at the request timeout. A get that waits
  for a message may take its wait on top: when the kernel's timeout expires within that, the receive goes on for
  what is left (one ``setsockopt`` then, and one to set it back at the next request).

A reply that is not the answer to the request sent (another id) means the stream is out of step: the connection
is not used again (ProtocolError, as for a frame that is not msgpack).
"""

from __future__ import annotations

import select
import socket
import ssl
import sys
import time
from typing import Any

import msgpack

from cfemu.sockets import set_kernel_timeout, set_receive_timeout
from cfemu.thread_packer import KEEP_BELOW
from sqm.service.protocol import HEADER, ProtocolError, check_length, decode_body

RECEIVE_BUFFER = 65536  # a reply that fits is read and unpacked in place; a longer one gets a buffer of its own
TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (linux/tcp.h): the connection as it is while neither side closed it
# Linux's tcp_info (its tcpi_state numbering is Linux's own: the BSDs that name TCP_INFO number the states
# otherwise); elsewhere a plain socket is polled too.
TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
_NOT_WHOLE = object()  # no whole reply in one read: read on


class Wire:
    """One connected, authenticated socket of a Client, used under the client's lock (one request at a time)."""

    def __init__(self, sock: socket.socket, *, request_timeout: float, max_frame: int) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.request_timeout = request_timeout
        self.max_frame = max_frame  # the longest reply accepted
        self._buf = bytearray(RECEIVE_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # what the buffer holds past the last reply: [start, end)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._poll: select.poll | None = None
        if self.tls:
            sock.settimeout(request_timeout)
        else:  # blocking, the kernel timing a receive and a send out (no poll before each, as a Python timeout does)
            set_kernel_timeout(sock, request_timeout)
        self._timeout = request_timeout  # the receive timeout set on the socket now

    # --- a request ---------------------------------------------------------------------------------------------
    def frame(self, request: dict[str, Any]) -> bytes:
        """The request's frame: its length, then its body packed by this connection's Packer (kept unless the
        frame was large: a Packer keeps a buffer as long as the longest thing it packed)."""
        body = self._packer.pack(request)
        if len(body) > KEEP_BELOW:
            self._packer = msgpack.Packer(use_bin_type=True)
        return HEADER.pack(len(body)) + body

    def exchange(self, frame: bytes, rid: int, request_timeout: float, wait_s: float = 0.0) -> Any:
        """Send a request's frame and return its reply, decoded; the reply may take request_timeout + wait_s (the
        client's request timeout now: an application may change it between requests). OSError, ProtocolError or
        FrameTooLargeError: the connection cannot be used again."""
        sock = self.sock
        deadline = 0.0
        self.request_timeout = request_timeout
        if self.tls:
            if self._timeout != request_timeout + wait_s:
                self._timeout = request_timeout + wait_s
                sock.settimeout(self._timeout)
        else:
            if self._timeout != request_timeout:  # a get's wait lengthened it, or the application changed it
                set_receive_timeout(sock, request_timeout)
                self._timeout = request_timeout
            if wait_s > 0:
                deadline = time.monotonic() + request_timeout + wait_s
        sock.sendall(frame)
        reply = self._whole_reply(deadline) if self._start == self._end else _NOT_WHOLE
        if reply is _NOT_WHOLE:
            reply = self._reply(deadline)
        if isinstance(reply, dict):
            got = reply.get("id")
            if got is not None and got != rid:
                raise ProtocolError(f"a reply to request {got!r} came for request {rid}: the stream is out of step")
        return reply

    def _whole_reply(self, deadline: float) -> Any:
        """The usual case, in one call: with nothing left over, one read brings the whole reply and no more.
        _NOT_WHOLE when it did not (what it read is kept for _reply, which reads on), or the read timed out within
        a get's wait (_reply reads again, for what is left of it)."""
        try:
            end = self.sock.recv_into(self._view)
        except BlockingIOError:
            self._timed_out(deadline)
            return _NOT_WHOLE
        if not end:
            raise ConnectionError("connection closed by the server")
        if end >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if end == HEADER.size + length and length <= self.max_frame:
                return decode_body(self._view[HEADER.size:end])
        self._start, self._end = 0, end
        return _NOT_WHOLE

    def _reply(self, deadline: float) -> Any:
        """The next frame, decoded (``deadline``: on the monotonic clock, when a get's wait lengthens the reply's
        time beyond the kernel's receive timeout; 0: none)."""
        start, end = self._start, self._end
        while end - start < HEADER.size:
            start, end = self._read(start, end, deadline, HEADER.size)
        (length,) = HEADER.unpack_from(self._buf, start)
        check_length(length, self.max_frame)
        stop = start + HEADER.size + length
        if stop > len(self._buf):  # longer than the buffer: read into one of its own
            whole = bytearray(HEADER.size + length)
            have = end - start
            whole[:have] = self._view[start:end]
            view = memoryview(whole)
            while have < len(whole):
                have += self._receive(view[have:], deadline)
            self._start = self._end = 0
            return decode_body(view[HEADER.size:])
        while end < stop:
            start, end = self._read(start, end, deadline, stop - start)
            stop = start + HEADER.size + length
        if stop == end:
            self._start = self._end = 0
        else:  # more than this reply came (not from a server that keeps the protocol; kept in step all the same)
            self._start, self._end = stop, end
        return decode_body(self._view[start + HEADER.size:stop])

    def _read(self, start: int, end: int, deadline: float, need: int) -> tuple[int, int]:
        """Read more into the buffer, first moving what it holds to its front when ``need`` bytes from start would
        not fit past it. Returns the new (start, end)."""
        if start + need > len(self._buf):
            self._buf[:end - start] = self._view[start:end]
            start, end = 0, end - start
        end += self._receive(self._view[end:], deadline)
        self._start, self._end = start, end
        return start, end

    def _receive(self, into: memoryview, deadline: float) -> int:
        sock = self.sock
        while True:
            try:
                got = sock.recv_into(into)
            except BlockingIOError:
                self._timed_out(deadline)
                continue
            if not got:
                raise ConnectionError("connection closed by the server")
            return got

    def _timed_out(self, deadline: float) -> None:
        """The kernel's receive timeout expired (a plain socket): raise TimeoutError, unless a get's wait leaves
        time before ``deadline``, which becomes the receive timeout."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no reply within {self._timeout:g} s")
        self._timeout = min(left, self.request_timeout)
        set_receive_timeout(self.sock, self._timeout)

    # --- between requests ----------------------------------------------------------------------------------------
    def closed_while_idle(self) -> bool:
        """Whether the server closed (or broke) the connection since its last reply."""
        if self._start != self._end:
            return True  # the server sent something unasked: the stream cannot be trusted
        if TCP_INFO is not None and not self.tls:
            try:
                return self.sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, 1)[0] != TCP_ESTABLISHED
            except (OSError, IndexError):
                return True
        try:
            if self._poll is None:
                self._poll = select.poll()
                self._poll.register(self.sock, select.POLLIN)
            if not self._poll.poll(0):  # POLLIN, or the POLLHUP, POLLERR or POLLNVAL that poll always reports
                return False
        except (OSError, ValueError):
            return True
        if self.tls:
            # TLS records that carry no application data (a TLS 1.3 session ticket) also make the socket readable:
            # read without waiting, then put the socket's timeout back (non-blocking, the next reply would fail).
            try:
                self.sock.setblocking(False)
                self.sock.recv(1)
            except ssl.SSLWantReadError:
                return False
            except OSError:
                return True
            finally:
                try:
                    self.sock.settimeout(self._timeout)
                except OSError:
                    pass
        return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


__all__ = ["RECEIVE_BUFFER", "Wire"]
