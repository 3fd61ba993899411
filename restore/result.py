"""What a restore or a purge did: the results the CLI prints, the report file holds and --json shows."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cfemu.private_files import open_private, private_dir, refuse_others_writing


@dataclass
class RestoreResult:
    structure: str
    backup_id: str
    backup_path: str
    engine: str
    dry_run: bool
    state_before: str
    replay_from: int = 0
    replay_to: int = 0  # highest LRSN read (backup or logs)
    restore_lrsn: int = 0  # the restored structure's generation and recovery floor; its clock starts above
    log_ranges: dict[str, dict[str, Any]] = field(default_factory=dict)  # member -> {dir, from, to}
    records_by_member: dict[str, int] = field(default_factory=dict)  # records read that concern the structure
    counts: dict[str, int] = field(default_factory=dict)  # by disposition, and UOWs in doubt / backed out
    nonpersistent_lost: dict[str, int] = field(default_factory=dict)  # skipped by the backup / found in the CF
    in_doubt_uows: dict[str, str] = field(default_factory=dict)  # UOW -> owner, still in doubt
    decisions_logged: int = 0  # RECOVERY records written by this run
    keys_deleted: int = 0
    loaded_entries: int = 0
    loaded_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    report_path: str | None = None
    started_at: str = ""
    base_kind: str = "fuzzy"  # the base's kind: fuzzy, restore, purge (restore points) or definition
    restore_point: str = ""  # the restore point this restore wrote (backup.points)
    unfinished_points_removed: list[str] = field(default_factory=list)  # restore points earlier runs left unfinished
    start: str = ""  # which start it used, in words: a backup (which), or the logs alone (which relog pass)
    peak_rss_bytes: int = 0  # peak resident memory at the end of the restore (plan and load; with its workers')
    memory_limit: int = 0  # the working memory the local engine was given (0: another engine)
    partitions: int = 0  # how many partitions the local engine planned in
    workers: int = 0  # the local engine's worker processes (1: it planned in the restore's own process)

    @property
    def nothing_to_replay(self) -> bool:
        """No record lies in the replay range: the highest LRSN read is below where the replay starts."""
        return self.replay_to < self.replay_from

    def replay_range(self) -> dict[str, Any]:
        """The LRSN range replayed, explicitly empty when there is nothing to replay (from and to then null)."""
        if self.nothing_to_replay:
            return {"empty": True, "from": None, "to": None}
        return {"empty": False, "from": self.replay_from, "to": self.replay_to}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "replay_range": self.replay_range()}


@dataclass
class PurgeResult:
    structure: str
    state_before: str
    discarded: int  # entries the structure held (0 when it was lost with the CF)
    discarded_bytes: int
    gen: int
    restore_point: str = ""  # the empty restore point the purge wrote (backup.points)


def write_report(result: RestoreResult, path: Path) -> None:
    """Write the JSON report durably (temp file, fsync, rename), the file 0600; restore.report documents its
    fields. The directory is left as it is (an operator's own: never chmodded), refused when other users can
    write it; a missing one is made 0700."""
    parent = path.absolute().parent
    if parent.is_dir():
        refuse_others_writing(parent)
    else:
        private_dir(parent)
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        json.dump(result.to_json(), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
