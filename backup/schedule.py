"""cfbackup schedule: back up structures every N seconds, as its own long-running process (a daemon is a verb).

Each backup runs as a child ``cfbackup run S --wait 0`` so that one failed backup never takes the scheduler with
it; a backup that finds another running (an operator's) is skipped until the next tick rather than waited for. The
CF, log root and backup directory come from the same settings resolver as every command (flag, environment,
the nearest cluster directory, default), passed on to each child through its environment.

Retention: after each good backup of a structure the scheduler keeps its newest `keep` good backups and removes
older ones that no restore can need (backup.catalog.retain: never the restore base, a running backup, a damaged one,
nor a restore or purge point while anything older stays); with `keep_age` it also keeps every good backup younger
than that age; keep 0 keeps everything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from backup.catalog import retain
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.procs import popen_tied
from cfemu.repository import GroupRepository
from cfemu.settings import Settings
from cfemu.signals import handling

if TYPE_CHECKING:  # prometheus_client is imported by the scheduler only, not by every cfbackup command
    from backup.schedule_metrics import SchedulerMetrics

log = logging.getLogger("backup.schedule")

BACKUP_COMMAND = [sys.executable, "-m", "backup.cli"]
DEFAULT_KEEP = 5  # good backups kept per structure by the scheduler's retention
BUSY_REASON = "MQRC_CF_STRUC_IN_USE"  # a child's error line when another backup of its structure runs


def run_backup_scheduler(interval: float, settings: Settings, structures: Sequence[str] = (),
                         stop: threading.Event | None = None, keep: int = DEFAULT_KEEP,
                         metrics: SchedulerMetrics | None = None, keep_age: timedelta | None = None) -> None:
    """Every interval seconds run ``cfbackup run S`` for each structure (default: every ACTIVE one), until stop;
    after each good one, the retention (module doc) with `keep`. What it ran, and how long each backup and each
    of its steps took, goes to ``metrics`` (backup.schedule_metrics).

    settings (the scheduler's own, resolved once) go to every child through its environment, so that each backup
    uses the scheduler's CF, log root and backup directory whatever the child would find on its own.
    """
    if not 0 < interval < math.inf:  # NaN too: stop.wait(nan) returns at once, and the loop would spin
        raise ValueError(f"the interval must be above 0 seconds, and finite, not {interval}")
    stop = stop or threading.Event()
    if metrics is None:
        from backup.schedule_metrics import SchedulerMetrics

        metrics = SchedulerMetrics(interval, keep)
    child_env = {**os.environ, **settings.env()}
    current: list[subprocess.Popen[bytes]] = []

    def on_term(signum: int, frame: object) -> None:
        stop.set()
        for p in current:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()

    log.info("backup scheduler: every %gs, structures: %s", interval, ", ".join(structures) or "all ACTIVE")
    with handling((signal.SIGTERM, signal.SIGINT), on_term, in_thread=True):  # put back as found when it returns
        while not stop.wait(interval):
            for s in structures or _active_structures(settings.redis_url, metrics):
                if stop.is_set():
                    break
                t0 = time.monotonic()
                metrics.begin(s)
                proc = popen_tied([*BACKUP_COMMAND, "run", s, "--wait", "0", "--json"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=child_env)
                current.append(proc)
                out, err = proc.communicate()
                current.remove(proc)
                seconds = time.monotonic() - t0
                if proc.returncode == 0:
                    metrics.backup_done(s, "ok", seconds, _manifest(out))
                    log.info("backup of %s done in %.1fs", s, seconds)
                    if keep:
                        _retain(settings, s, keep, metrics, keep_age)
                else:
                    tail = (err or out).decode(errors="replace").strip().splitlines()[-1:] or [""]
                    metrics.backup_done(s, "busy" if BUSY_REASON in tail[0] else "failed", seconds, None)
                    log.error("backup of %s failed (exit %s): %s", s, proc.returncode, tail[0])


def _manifest(out: bytes) -> dict[str, Any] | None:
    """The manifest a good ``cfbackup run --json`` printed (None if it printed something else)."""
    try:
        found = json.loads(out)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _active_structures(url: str | None, metrics: SchedulerMetrics) -> list[str]:
    try:
        client = connect(url)
        try:
            admin = Admin(client)
            return sorted(s.name for s in admin.structures() if admin.state(s.name) == "ACTIVE")
        finally:
            client.close()
    except Exception as e:  # the CF may be down for a while: try again at the next tick
        log.warning("backup scheduler: cannot list structures: %s", e)
        metrics.list_failed()
        return []


def _retain(settings: Settings, structure: str, keep: int, metrics: SchedulerMetrics,
            keep_age: timedelta | None = None) -> None:
    """The retention after a good backup of `structure`; a failure is logged and tried again after the next."""
    try:
        client = connect(settings.redis_url)
        try:
            result = retain(settings.backup_dir, structure, keep, client=client,
                            repo=GroupRepository(settings.log_root), backup_keys=settings.backup_keys(),
                            keep_age=keep_age, log_root=settings.log_root)
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - retention never stops the backups
        log.warning("retention of %s's backups failed: %s", structure, e)
        metrics.retention_failed(structure)
        return
    metrics.retained(structure, len(result.removed))
    if result.removed:
        log.info("retention of %s: removed %d backup(s) (%s), kept %d", structure, len(result.removed),
                 ", ".join(b.id for b in result.removed), len(result.kept))
    if result.note:
        log.warning("retention of %s: %s", structure, result.note)
    for b, why in result.failed:
        log.warning("retention of %s: backup %s was not removed: %s", structure, b.id, why)
    for b, why in result.held:
        log.info("retention of %s: backup %s kept: %s", structure, b.id, why)
