"""Process helpers every floor that starts or watches a process shares: a free port, liveness without reaping,
a log's tail, and children tied to this process's life (PR_SET_PDEATHSIG from one spawner thread)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live (non-zombie) process. Never reaps a dead child: its Popen object must be the
    one to collect the exit status (a reaped child's Popen.wait() returns 0, which once hid a fenced exit)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


# What a CF server's command line holds: redis-server's, or valkey-server's (cfemu.embedded runs either).
CF_SERVER_MARKERS = (b"redis", b"valkey")


def cmdline_holds(pid: int, markers: bytes | tuple[bytes, ...]) -> bool:
    """Does process ``pid``'s command line hold the marker (one of the markers)? True if unknowable."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True
    return any(m in cmdline for m in ((markers,) if isinstance(markers, bytes) else markers))


def pid_is_redis(pid: int) -> bool:
    """Guard against pid reuse: does ``pid`` look like a CF server (redis-server or valkey-server)?"""
    return cmdline_holds(pid, CF_SERVER_MARKERS)


def wait_gone(pid: int, timeout: float, proc: subprocess.Popen[Any] | None = None, poll_s: float = 0.02) -> bool:
    """True once process `pid` has exited (reaped through `proc`, our own child, when given), False after `timeout`
    seconds. A process that is not our child is polled (pid_alive) until it is gone."""
    if proc is not None and proc.pid == pid:
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    out = text.splitlines()[-lines:]
    return "\n".join(out) if out else "(log is empty)"


def set_pdeathsig() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to SIGTERM the child if the thread that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen_tied(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """Start a child process that is terminated when this process dies.

    Linux ties PR_SET_PDEATHSIG to the thread that forked the child, not to the process: a child started from a
    short-lived thread (a fault injector restarting a queue manager, say) got SIGTERM as soon as that thread
    ended. So every such child is started from one spawner thread that lives as long as the process."""
    global _spawner
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(cmd, **kw)
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfemu-spawner")

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, preexec_fn=set_pdeathsig, **kw)

    return _spawner.submit(start).result()
