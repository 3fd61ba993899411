"""cfbackup schedule: back up structures every N seconds, as its own long-running process (a daemon is a verb).

Each backup runs as a child ``cfbackup run S`` so that one failed backup never takes the scheduler with it. The
CF, log root and backup directory come from the same settings resolver as every command (flag, environment,
the nearest cluster directory, default), passed on to each child through its environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.procs import popen_tied
from cfemu.settings import Settings

log = logging.getLogger("backup.schedule")

BACKUP_COMMAND = [sys.executable, "-m", "backup.cli"]


def run_backup_scheduler(interval: float, settings: Settings, structures: Sequence[str] = (),
                         stop: threading.Event | None = None) -> None:
    """Every interval seconds run ``cfbackup run S`` for each structure (default: every ACTIVE one), until stop.

    settings (the scheduler's own, resolved once) go to every child through its environment, so that each backup
    uses the scheduler's CF, log root and backup directory whatever the child would find on its own.
    """
    stop = stop or threading.Event()
    child_env = {**os.environ, **settings.env()}
    current: list[subprocess.Popen[bytes]] = []

    def on_term(signum: int, frame: object) -> None:
        stop.set()
        for p in current:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
    log.info("backup scheduler: every %gs, structures: %s", interval, ", ".join(structures) or "all ACTIVE")
    while not stop.wait(interval):
        for s in structures or _active_structures(settings.redis_url):
            if stop.is_set():
                break
            t0 = time.monotonic()
            proc = popen_tied([*BACKUP_COMMAND, "run", s], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=child_env)
            current.append(proc)
            out, _ = proc.communicate()
            current.remove(proc)
            tail = out.decode(errors="replace").strip().splitlines()[-1:] or [""]
            if proc.returncode == 0:
                log.info("backup of %s done in %.1fs", s, time.monotonic() - t0)
            else:
                log.error("backup of %s failed (exit %s): %s", s, proc.returncode, tail[0])


def _active_structures(url: str | None) -> list[str]:
    try:
        client = connect(url)
        try:
            admin = Admin(client)
            return sorted(s.name for s in admin.structures() if admin.state(s.name) == "ACTIVE")
        finally:
            client.close()
    except Exception as e:  # the CF may be down for a while: try again at the next tick
        log.warning("backup scheduler: cannot list structures: %s", e)
        return []
