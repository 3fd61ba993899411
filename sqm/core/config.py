"""A queue manager's settings (QueueManagerConfig) and the port through which the top floor gives it automatic
structure recovery (RecoverStructure, used by sqm.core.recauto)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfemu.progress import Progress
from cfemu.settings import DEFAULT_MAX_UMSGS
from sqm.core.scans import DEFAULT_SCAN_SLOTS

LINEAR, CIRCULAR = "linear", "circular"
LOG_MODES = (LINEAR, CIRCULAR)

# The restore a member runs for a structure: it reports its phases through the progress port and returns what it
# did: {"backup": base id, "base_kind": kind, "replay_from": LRSN, "summary": one line}. It raises when it could
# not restore (nothing is retried inside it; the member retries with a growing delay).
RecoverStructure = Callable[[str, Progress], Mapping[str, Any]]


class StructureLeftRecovering(Exception):
    """What a RecoverStructure raises when its restore failed once it had claimed the structure (the restore point
    not written, the load not verified) and the structure stays RECOVERING under that claim: the member keeps its
    automatic recovery's mark, so that the recovery is tried again (sqm.core.recauto); without the mark the
    structure reads as an operator's restore, which no member recovers."""


@dataclass
class QueueManagerConfig:
    name: str
    log_root: Path  # this member's log is log_root/name; peers' logs are beside it
    redis_url: str | None = None
    lease_ms: int = 5000
    logload: int = 10000  # take a checkpoint every this many log records (MQ's LOGLOAD)
    # MAXUMSGS: the messages an application may put and get in one unit of work (IBM MQ's default). The put or get
    # past it is refused with MQRC_SYNCPOINT_LIMIT_REACHED; the unit of work stays open, to be committed or backed
    # out. It bounds what one application's commit or backout asks of the CF and of the log.
    max_umsgs: int = DEFAULT_MAX_UMSGS
    expiry_interval_ms: int = 1000
    # How often the wings' sweepers run from housekeeping (units of work sent to services: sqm.conversations.uowsweeper;
    # publications and subscriptions: sqm.pubsub.pubsub_sweeper); 0: never.
    uow_sweep_interval_ms: int = 1000
    clock_skew_us: int = 0
    segment_bytes: int = 64 * 2**20
    background: bool = True  # heartbeat, peer recovery, expiry and pending-work threads
    # CF connections: requests beyond this wait for a free one (up to cf_pool_timeout_s), then fail with
    # MQRC_RESOURCE_PROBLEM; a local limit is never reported as a failed CF structure.
    cf_connections: int = 64
    cf_pool_timeout_s: float = 30.0
    # Calls of multi-call scans (browse pages, peek scans) in the CF at once (sqm.core.scans): the rest wait here.
    scan_slots: int = DEFAULT_SCAN_SLOTS
    # Selective relogging (docs/log-management.md): the CPL's n (0: no relogging), the relog lock's lease, the
    # entries one relog_scan batch looks at.
    cpl_entries: int = 3
    relog_lock_ms: int = 60_000
    relog_batch: int = 500
    # Log management (docs/log-management.md): linear (the default) archives the inactive segments to
    # log_archive_dir/NAME (default: the member's log directory's archive/) and removes them from the active log;
    # circular reuses a ring of log_ring segments once inactive, and refuses new persistent work when none can be
    # freed. Checkpoints also every checkpoint_interval_s (0: never by time) and when the log runs low on space
    # (linear: the log's file system has less than log_low_space_bytes free; circular: one free segment left).
    log_mode: str = "linear"
    log_ring: int = 8
    log_archive_dir: Path | None = None
    checkpoint_interval_s: float = 300.0
    log_low_space_bytes: int = 256 * 2**20
    # The running persistent store report (seed 004's PSTORE-REPORT=YES: sqm.core.storereport): its file; None: none.
    pstore_report: Path | None = None
    # RECAUTO (sqm.core.recauto): how this member restores a failed structure; injected by the top floor (qsg.member
    # wires restore in); None: this member never recovers a structure by itself.
    recover_structure: RecoverStructure | None = None


__all__ = ["CIRCULAR", "LINEAR", "LOG_MODES", "QueueManagerConfig", "RecoverStructure", "StructureLeftRecovering"]
