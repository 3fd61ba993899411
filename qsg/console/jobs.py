"""The operator actions under way and done: each runs in a thread of its own, reports its progress
(cfemu.progress: phase, done, total) to its Job, which the page shows live, and ends with a one-line result or
a one-line error. Bounded: at most MAX_RUNNING at once, one per target, and the last KEPT ended ones remembered.
A running job is never forgotten: it stays listed (and counted by both checks) until it ends, however many jobs
end meanwhile."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cfemu.progress import Progress

log = logging.getLogger("qsg.console")

MAX_RUNNING = 4
KEPT = 50
RUNNING, DONE, FAILED = "running", "done", "failed"


class JobRefusedError(RuntimeError):
    """An action not started: too many running, or one already running on the same target."""


@dataclass
class Job:
    id: int
    action: str
    target: str  # what it acts on (a structure, a member, a UOW): one job per target at a time
    title: str
    state: str = RUNNING
    phase: str = ""
    done: int = 0
    total: int | None = None
    result: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None

    def progress(self, phase: str, done: int, total: int | None) -> None:
        self.phase, self.done, self.total = phase, done, total

    @property
    def percent(self) -> int | None:
        return min(100, int(100 * self.done / self.total)) if self.total else None

    @property
    def seconds(self) -> float:
        return round((self.ended or time.time()) - self.started, 1)


class Jobs:
    def __init__(self, *, max_running: int = MAX_RUNNING, kept: int = KEPT,
                 on_change: Callable[[Job], None] | None = None) -> None:
        """on_change(job) is called (from the job's thread at its end) when a job starts and when it ends."""
        self.max_running = max_running
        self.on_change = on_change
        self._running: dict[int, Job] = {}
        self._ended: deque[Job] = deque(maxlen=kept)  # newest first
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, action: str, target: str, title: str, work: Callable[[Progress], str]) -> Job:
        """Run work(progress) in a thread; its returned line is the job's result, its exception its error."""
        with self._lock:
            running = list(self._running.values())
            if len(running) >= self.max_running:
                raise JobRefusedError(f"{len(running)} actions are running already: wait for one to end")
            clash = next((j for j in running if j.target == target), None)
            if clash is not None:
                raise JobRefusedError(f"{clash.title} is still running: wait for it to end")
            job = Job(next(self._ids), action, target, title)
            self._running[job.id] = job
        self._changed(job)
        threading.Thread(target=self._run, args=(job, work), name=f"console-job-{job.id}", daemon=True).start()
        return job

    def _changed(self, job: Job) -> None:
        if self.on_change is not None:
            try:
                self.on_change(job)
            except Exception:  # noqa: BLE001 - a listener's failure is not the job's
                log.exception("console: a job listener failed")

    def _run(self, job: Job, work: Callable[[Progress], str]) -> None:
        try:
            result, state = work(job.progress), DONE
        except Exception as e:  # noqa: BLE001 - the operator reads why on the page
            result, state = " ".join(str(e).split()) or type(e).__name__, FAILED
            log.warning("console: %s failed: %s", job.title, result)
        with self._lock:  # ended and moved at once: a job seen as ended is no longer counted as running
            job.result, job.state, job.ended = result, state, time.time()
            self._running.pop(job.id, None)
            self._ended.appendleft(job)
        log.info("console: %s: %s (%s)", job.title, job.state, job.result)
        self._changed(job)

    def list(self) -> list[Job]:
        """Newest first."""
        with self._lock:
            return sorted([*self._running.values(), *self._ended], key=lambda j: j.id, reverse=True)

    def get(self, job_id: int) -> Job | None:
        return next((j for j in self.list() if j.id == job_id), None)


__all__ = ["DONE", "FAILED", "KEPT", "MAX_RUNNING", "RUNNING", "Job", "JobRefusedError", "Jobs"]
