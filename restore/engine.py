"""Restore engines: where the restore plan is computed (docs/architecture.md, "Restore engines"; docs/spark.md).

An engine turns a backup plus the logs of every member into a `restore.plan.RestorePlan`: the final state of
every message of one structure, settled by the one fold `restore.settle.settle`. Engines differ only in where
the work runs; every engine must produce the same plan for the same input.

The interface is one method:

    class Engine(Protocol):
        name: str
        def plan(self, structure, backup, log_dirs, replay_from, now_ms, progress) -> RestorePlan

  structure    the structure to restore (e.g. "APP1")
  backup       a good backup (`BackupSource`: `.manifest`, `.copies()` yielding (structure, descriptor, data))
  log_dirs     every log directory to read (each member's, plus restore's own `_restore` log)
  replay_from  the LRSN the replay starts at (the backup manifest's `replay_from`); earlier records are ignored
  now_ms       "now" for expiry (ms since the epoch): a message whose expiry is at or before it is not restored
  progress     `progress(phase, done, total)`, called as work advances: phases READ_BACKUP, READ_LOGS, SETTLE

An engine must raise `sqm.log.LogCorruptError` / `LogFormatError` for a bad log (never skip it), and must not
change anything: restore writes to the CF only after the whole plan is computed.

`get_engine(name, **options)` returns an engine by name: "columnar" (the plan as SQL on DuckDB over columns its C
readers decode, in bounded memory: `restore.engine_columnar`; options memory, work_dir, workers; the default),
"local" (in-process, in bounded memory: restore.partitioned; the same options and partitions; the reference the
others are tested against, and the default where the columnar engine's C readers were not built: default_engine)
or "spark" (`restore.engine_spark`); columnar and spark are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import resource
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from cfemu.progress import Progress, no_progress
from cfemu.settings import default_workers
from restore.log_slices import log_slices
from restore.partitioned import DEFAULT_MEMORY, partitions_for, plan_partitioned
from restore.plan import Copy, RestorePlan, base_lrsn
from restore.spill import SpillDir
from sqm.log.format import log_segments, read_manifest, trusted_segments

READ_BACKUP, READ_LOGS, SETTLE, LOAD = "read backup", "read logs", "settle", "load"
PHASES = (READ_BACKUP, READ_LOGS, SETTLE, LOAD)
# A purge (a COLD or WARM start, `cfrestore purge`) reports this once it has claimed the structure: from then on a
# failure leaves the structure RECOVERING under its claim, as a restore's does once its load began.
PURGING = "purging"

class BackupSource(Protocol):
    """What an engine needs of a backup (backup.files.Backup provides it)."""

    @property
    def manifest(self) -> dict[str, Any]: ...

    def copies(self) -> Iterable[Copy]: ...


class Engine(Protocol):
    name: str

    def plan(self, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int, now_ms: int,
             progress: Progress) -> RestorePlan: ...


class UnknownEngineError(ValueError):
    pass


def _counted(copies: Iterable[Copy], progress: Progress, total: int | None) -> Iterator[Copy]:
    n = 0
    progress(READ_BACKUP, n, total)
    for c in copies:
        yield c
        n += 1
        if n % 1000 == 0:
            progress(READ_BACKUP, n, total)
    progress(READ_BACKUP, n, total)


def input_bytes(backup: BackupSource, log_dirs: list[Path], replay_from: int) -> int:
    """About how many bytes a plan reads: the backup's data and descriptors, and the log segments that may hold
    records from `replay_from` on (what restore.partitioned sizes its partitions by)."""
    m = backup.manifest
    total = int(m.get("bytes", 0) or 0) + 200 * int(m.get("entries", 0) or 0)
    for d in log_dirs:
        manifest = read_manifest(d)
        trusted = trusted_segments(d, manifest)
        for segno, path in log_segments(d, manifest):  # archived segments too: they are read where archived
            info = trusted.get(segno)
            if info is not None and info.max_lrsn is not None and info.max_lrsn < replay_from:
                continue
            with contextlib.suppress(OSError):
                total += path.stat().st_size
    return total


def _allow_open_files(n: int) -> None:
    """Raise this process's soft limit of open files to `n` when it is lower (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


def bounded_resources(memory: int, work_dir: Path | None, workers: int | None) -> tuple[int, Path | None, int]:
    """What an engine that plans in bounded memory is given, checked: ``memory`` bytes (positive), its work directory
    (None: the system's temporary directory) and its ``workers`` (at least 1; None: the setting's default, one a
    core)."""
    if memory <= 0:
        raise ValueError(f"the restore memory limit must be positive, not {memory}")
    count = default_workers() if workers is None else workers
    if count < 1:
        raise ValueError(f"the restore workers must be at least 1, not {count}")
    return memory, Path(work_dir) if work_dir is not None else None, count


class LocalEngine:
    """The engine of this machine: plans in bounded memory (restore.partitioned), partitioned by entry id through
    spill files in a private temporary directory under `work_dir`, so that the partitions being settled (one per
    worker process), the scan's buffers and the load's batches stay within `memory` bytes of working memory.
    `workers` processes settle the partitions side by side (1: this process alone; None: the setting's default,
    one a core)."""

    name = "local"

    def __init__(self, memory: int = DEFAULT_MEMORY, work_dir: Path | None = None,
                 partitions: int | None = None, workers: int | None = None) -> None:
        self.memory, self.work_dir, self.workers = bounded_resources(memory, work_dir, workers)
        self.partitions = partitions  # None: from the input's size and `memory` (partitions_for)

    def plan(self, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int, now_ms: int,
             progress: Progress = no_progress) -> RestorePlan:
        total = backup.manifest.get("entries")
        # Each worker holds one partition at a time: the partitions are sized to a worker's share of the memory.
        partitions = self.partitions or partitions_for(input_bytes(backup, log_dirs, replay_from),
                                                       self.memory // self.workers)
        _allow_open_files(partitions + 128)  # the load merges one open run per partition
        spill = SpillDir(self.work_dir)
        try:
            # The logs are read in slices by the worker processes side by side, while this process reads the
            # backup (plan_partitioned), a few slices a worker so that they end together.
            plan = plan_partitioned(
                structure, _counted(backup.copies(), progress, int(total) if total is not None else None),
                (), slices=log_slices(log_dirs, replay_from, 3 * self.workers), spill=spill, partitions=partitions,
                memory=self.memory, now_ms=now_ms, gen=int(backup.manifest.get("gen", 0) or 0),
                carried=backup.manifest.get("carried", ()), lrsn=base_lrsn(backup.manifest),
                registered=list(backup.manifest.get("uows") or ()), progress=progress, workers=self.workers)
        except BaseException:
            spill.close()
            raise
        return plan


_ENGINES: dict[str, Callable[..., Engine]] = {"local": lambda **options: LocalEngine(**options)}
# Imported on first use: pyspark is an optional dependency; the columnar engine brings DuckDB in.
_LAZY = {"spark": "restore.engine_spark", "columnar": "restore.engine_columnar"}


def engine_names() -> list[str]:
    return sorted(set(_ENGINES) | set(_LAZY))


def register_engine(name: str, factory: Callable[..., Engine]) -> None:
    """Make an engine available to get_engine (an engine module calls this when it is imported)."""
    _ENGINES[name] = factory


def default_engine() -> str:
    """The engine a restore plans with unless told otherwise: the columnar one, whose plan and output cost less
    than the local engine's (BENCHMARKS.md, "The columnar engine, fourth pass"); the local one where the columnar
    engine's C readers were not built (an install made where no C compiler was), so that no restore, the automatic
    ones after a CF loss least of all, stops for want of them."""
    return "columnar" if importlib.util.find_spec("restore._columns") is not None else "local"


def get_engine(name: str | None = None, **options: Any) -> Engine:
    """The engine called `name`, made with `options`. A lazily imported engine module registers itself with
    register_engine(name, factory) when imported (or defines `make_engine(**options)`). None: default_engine()."""
    name = name or default_engine()
    if name not in _ENGINES and name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        if name not in _ENGINES and hasattr(module, "make_engine"):
            _ENGINES[name] = module.make_engine
    factory = _ENGINES.get(name)
    if factory is None:
        raise UnknownEngineError(f"unknown restore engine {name!r}: choose one of {', '.join(engine_names())}")
    return factory(**options)
