"""Socket settings shared by every floor: the CF's connections (cfemu.connection) and the network service's
(sqm.service); whether an address is loopback (a listener bound to one is reachable from this host only); the
longest Unix-domain socket path."""

from __future__ import annotations

import ipaddress
import socket
import struct

# The longest path a Unix-domain socket address holds (sun_path: 108 bytes with its terminating NUL, on Linux).
UNIX_PATH_MAX = 107


def set_kernel_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Blocking mode, with the kernel timing out a receive or a send (SO_RCVTIMEO, SO_SNDTIMEO: the call fails
    with EAGAIN, an OSError) instead of Python polling before every call, as a socket with a Python timeout does
    (a syscall each, and one more release of the GIL). None or 0: no timeout."""
    sock.settimeout(None)
    timeval = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def set_receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """The kernel's receive timeout alone (SO_RCVTIMEO), on a socket set_kernel_timeout made blocking already."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _timeval(seconds: float | None) -> bytes:
    """A struct timeval for SO_RCVTIMEO/SO_SNDTIMEO; (0, 0), which the kernel reads as no timeout, only for None or
    0 and less: a positive timeout below a microsecond (what is left of a deadline) is one microsecond."""
    if not seconds or seconds <= 0:
        return struct.pack("ll", 0, 0)
    usec = max(1, round(seconds * 1e6))
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


def is_loopback_ip(address: str) -> bool:
    """Is this peer address on the loopback network (127.0.0.0/8, ::1, or an IPv4-mapped 127.x)?"""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_loopback_host(host: str) -> bool:
    """Does listening on HOST accept loopback connections only? (0.0.0.0, '' and :: listen everywhere.)"""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(is_loopback_ip(str(info[4][0])) for info in infos)
