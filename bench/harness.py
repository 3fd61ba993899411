"""What the benchmarks in bench/ share: the machine a run is on, the measuring windows (--quick, --seconds,
--rounds), a work directory on a real disk, a member on a private redis-server, and the result line a run appends
to bench/results/NAME.jsonl. Not a benchmark itself (tests/bench runs the bench_*.py scripts)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS

RESULTS = Path(__file__).resolve().parent / "results"


# --- the machine -------------------------------------------------------------------------------------------
def _command(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def filesystem_of(path: Path) -> str:
    """The type and device of the mount holding path (from /proc/mounts: the longest matching mount point)."""
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (str(path).startswith(mnt.rstrip("/") + "/") or str(path) == mnt) and len(mnt) > len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]} (mount {best[0] or '?'})"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine(work: Path) -> dict[str, Any]:
    model = _command("lscpu").splitlines()
    return {"nproc": _command("nproc"),
            "cpu": next((line.split(":", 1)[1].strip() for line in model if line.startswith("Model name")), "?"),
            "memory": next((line.split()[1] + " GiB total" for line in _command("free", "-g").splitlines()
                            if line.startswith("Mem:")), "?"),
            "kernel": platform.release(), "python": platform.python_version(),
            "load_average_at_start": load_average(),
            "log_filesystem": filesystem_of(work)}


# --- measuring parts ------------------------------------------------------------------------------------------
class CountingClock:
    """A caller's LRSN clock for a benchmark that drives the CF's scripts directly (cfemu.cf.Clock): a counter,
    raised past every LRSN the CF returns."""

    def __init__(self) -> None:
        self.t = 0

    def now(self) -> int:
        self.t += 1
        return self.t

    def observe(self, lrsn: int) -> None:
        self.t = max(self.t, lrsn)


@dataclass
class Stopwatch:
    """The time spent in, and the calls of, every function it wraps."""

    seconds: float = 0.0
    calls: int = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


# --- the run ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Windows:
    """The measuring windows of a benchmark that interleaves its variants in rounds: --seconds a window and
    --rounds of them (the median reported), and --quick for a short run."""

    seconds: float
    rounds: int
    quick_seconds: float
    quick_rounds: int = 1

    def add_to(self, ap: argparse.ArgumentParser, quick_help: str = "") -> None:
        ap.add_argument("--quick", action="store_true", help=quick_help or (
            f"a short run: {self.quick_rounds} round(s) of {self.quick_seconds:g} s windows (unless --seconds, "
            "--rounds say otherwise)"))
        ap.add_argument("--seconds", type=float, default=None,
                        help=f"length of each window (default {self.seconds:g}, quick {self.quick_seconds:g})")
        ap.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds, the median reported "
                        f"(default {self.rounds}, quick {self.quick_rounds})")

    def of(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[float, int]:
        """(seconds, rounds) the run measures: as given, else the quick or the full defaults."""
        seconds = args.seconds if args.seconds is not None else self.quick_seconds if args.quick else self.seconds
        rounds = args.rounds if args.rounds is not None else self.quick_rounds if args.quick else self.rounds
        if seconds <= 0 or rounds < 1:
            ap.error("--seconds must be > 0 and --rounds >= 1")
        return seconds, rounds


def on_real_disk(bench: str, work_dir: Path | None, console: Console, **fields: Any) -> tuple[Path, dict[str, Any]] | None:
    """A new work directory under work_dir (default: the system's temporary directory) and the result's first
    fields (bench, date, machine, and ``fields``); None, said on the console, when it is on tmpfs, where an fsync
    costs nothing (the directory is gone again)."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{bench}-", dir=work_dir))
    result: dict[str, Any] = {"bench": bench, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": machine(work), **fields}
    if "tmpfs" in result["machine"]["log_filesystem"]:
        console.print(f"[red]{work} is on tmpfs: fsync costs nothing there; pass --work-dir on a real disk")
        shutil.rmtree(work, ignore_errors=True)
        return None
    return work, result


def measured_on_real_disk(bench: str, work_dir: Path | None, console: Console,
                          measure: Callable[[Path], dict[str, Any]], **fields: Any) -> dict[str, Any] | None:
    """The result of ``measure(work)`` in a work directory on a real disk (on_real_disk; removed again), with the
    load average at its end; None when the directory would be on tmpfs."""
    started = on_real_disk(bench, work_dir, console, **fields)
    if started is None:
        return None
    work, result = started
    try:
        result.update(measure(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["load_average_at_end"] = load_average()
    return result


@contextmanager
def one_member(bench: str, queue: str, structure: str = "APP1") -> Iterator[tuple[dict[str, Any], QueueManager]]:
    """(the machine, a started member QM1) on a private redis-server defining ``queue`` on ``structure``, its log
    in a temporary directory under the current one (a real disk); all stopped and removed again."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{bench}-", dir=Path.cwd()))
    host = machine(work)
    cf = EmbeddedRedis(data_dir=work / "cf").start()
    qm: QueueManager | None = None
    try:
        Admin(connect(cf.url)).ensure_structure(structure, (queue,))
        qm = QueueManager(QueueManagerConfig(name="QM1", log_root=work / "logs", redis_url=cf.url), wings=WINGS)
        qm.start()
        yield host, qm
    finally:
        if qm is not None:
            qm.stop()
        cf.stop()
        shutil.rmtree(work, ignore_errors=True)


def append_result(name: str, result: dict[str, Any]) -> None:
    """One JSON line appended to bench/results/NAME.jsonl."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(result, sort_keys=True) + "\n")


__all__ = ["RESULTS", "CountingClock", "Stopwatch", "Windows", "append_result", "filesystem_of", "load_average", "machine", "measured_on_real_disk",
           "on_real_disk",
           "one_member"]
