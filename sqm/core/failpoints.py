"""Named crash points (as in TiKV's fail-rs or FoundationDB's buggify): kill the process for real at a chosen line.

``failpoint(name)`` does nothing unless the environment variable ``SQM_FAILPOINTS``, read once at import, names
it. The variable is a comma-separated list of ``name`` (crash on the first hit) or ``name=N`` (crash on the N-th
hit). A crash is a real ``SIGKILL`` of the whole process: no ``finally`` blocks, no atexit handlers, no flushing of
buffers, exactly what ``kill -9`` does, so tests see the same disk and CF state a real crash leaves.

The check for an unarmed name is one frozenset lookup, so the calls stay in production code at no cost.

Every failpoint in the project (add a row with each new ``failpoint()`` call):

    name                 where                              the process dies
    before-log-force     sqm.core.manager.QueueManager.complete  before the UOW's decision record is forced
                         (and apply_many, for a batch holding commits under syncpoint: before its force)
    after-log-force      sqm.core.manager.QueueManager.complete  after a commit is forced, before it is applied
                         (and apply_many, for such a batch: after its force, before its commits are applied)
    backout-after-log    sqm.core.manager.QueueManager.complete  after a backout is forced, before it is applied
    during-apply         sqm.core.manager.QueueManager.apply     after each structure of the UOW is applied
    put-after-cf         sqm.core.connection (put in a UOW)      after the CF holds the put, before it is logged
    batch-before-force   sqm.core.connection (put_batch, get_batch)  after a batch's CF calls and its records'
                                                            appends, before its commit's force
    lifecycles-before-force  sqm.core.outcomes (commit_many)   after a batch of puts and gets outside syncpoint
                                                            and commits under syncpoint appended its records
                                                            and COMMITs, before their force
    lifecycles-after-force   sqm.core.outcomes (commit_many)   after that force, before the commits are applied
                                                            (no reply of the batch is sent)
    group-force          sqm.log.writer (RecordLog._lead_flush)  when other committers wait on a flush, before its
                                                            leader writes their records (none of them is on disk)
    shared-cf-round-trip sqm.core.cfgroup (GroupedCF._lead)   after the CF answered a round trip shared by
                                                            several callers, before any of them has its reply
    relog-before-force   sqm.core.relog (a relog pass)           after a batch's RELOG records are appended, before the force
    relog-after-force    sqm.core.relog (a relog pass)           after they are forced, before the entries are marked
    relog-before-checkpoint  sqm.core.manager.checkpoint         after the relog passes, before the checkpoint record
    restore-load-batch   restore.load.load_plan             after each pipelined batch of the bulk load
                                                            (``=N``: after batch N; the structure stays RECOVERING)
    migrate-load-batch   backup.migrate._load_entries       after each loaded batch of a store migration's load
                                                            (the target stays RECOVERING; its report unfinished)
"""

from __future__ import annotations

import os
import signal
import threading

ENV_VAR = "SQM_FAILPOINTS"


def parse_failpoints(spec: str) -> dict[str, int]:
    """``"a,b=3"`` -> ``{"a": 1, "b": 3}``; a malformed item is a one-line ValueError naming it."""
    armed: dict[str, int] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, count = item.partition("=")
        name = name.strip()
        if not name or (sep and not count.strip().isdigit()) or (sep and int(count) < 1):
            raise ValueError(f"{ENV_VAR}: bad failpoint {item!r} (expected name or name=N with N >= 1)")
        armed[name] = int(count) if sep else 1
    return armed


_ARMED: dict[str, int] = parse_failpoints(os.environ.get(ENV_VAR, ""))
_NAMES: frozenset[str] = frozenset(_ARMED)
_hits: dict[str, int] = {}
_hits_lock = threading.Lock()


def failpoint(name: str) -> None:
    """Crash here with SIGKILL when SQM_FAILPOINTS arms ``name`` and this is its chosen hit."""
    if name not in _NAMES:
        return
    with _hits_lock:
        _hits[name] = _hits.get(name, 0) + 1
        fire = _hits[name] == _ARMED[name]
    if fire:
        os.kill(os.getpid(), signal.SIGKILL)


def armed() -> dict[str, int]:
    """The failpoints this process was started with (name -> hit that crashes)."""
    return dict(_ARMED)
