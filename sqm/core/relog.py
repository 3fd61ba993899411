"""Selective relogging with a Checkpoint Positioning List (docs/log-management.md), applied to shared queues.

At each checkpoint a member relogs, for every ACTIVE structure whose relog lock it can take, the entries whose
newest logged copy is at or below the oldest pair's end of the structure's CPL (every entry at a termination
checkpoint), and ages the CPL. The design, and why it is one member per structure at a time, the floor raised at
each pass, and how restore reads the copies: docs/log-management.md.

A pass, in order (a crash anywhere leaves the previous complete pass in force):
  begin      relog_begin.lua: the lock, B, the floor raised to B, the stored CPL;
  copy       relog_scan.lua in batches, a RELOG record per qualifying entry;
  force      the RELOG records, then mark the entries (relog_end.lua, rl = R);
  complete   the checkpoint record carries the pass (QueueManager.checkpoint), then the aged CPL is stored and
             the lock released (finish()).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfemu.errors import MQError, RelogBusyError
from sqm.core import records
from sqm.core.cfcall import CF_DOWN
from sqm.core.clock import now_ms
from sqm.core.failpoints import failpoint
from sqm.log import LogFullError, LogReader

if TYPE_CHECKING:
    from sqm.core.member import LogUser

log = logging.getLogger("sqm.relog")

EVERYTHING = -1  # relog_scan's threshold at a termination checkpoint


@dataclass
class Pass:
    """One relog pass on one structure: begun and copied, completed by the checkpoint record that carries it."""

    structure: str
    gen: int
    begin: int  # B
    threshold: int  # T: copies at or below it were relogged (EVERYTHING at termination)
    window: int  # w: from the complete pass on, the merged logs from here hold a copy of every live entry
    old_cpl: list[list[int]]
    carried: list[str]
    copies: int = 0
    bytes: int = 0
    scanned: int = 0
    end: int = 0  # E: the LRSN of the checkpoint record that completes it
    cpl: list[list[int]] = field(default_factory=list)  # the CPL aged with [B, E]

    def complete(self, end: int, entries: int, termination: bool) -> None:
        self.end = end
        self.cpl = [[self.begin, end]] * entries if termination else aged(self.old_cpl, [self.begin, end], entries)

    def as_record(self) -> dict[str, Any]:
        """The pass as a checkpoint record carries it (sqm.core.records.RelogPasses)."""
        return {"cpl": self.cpl, "gen": self.gen, "w": self.window, "b": self.begin, "e": self.end,
                "held": list(self.carried), "copies": self.copies}


def aged(cpl: list[list[int]], newest: list[int], entries: int) -> list[list[int]]:
    """The CPL after a checkpoint: the oldest pair dropped, the newest added (docs/log-management.md), n pairs."""
    return [list(p) for p in (*cpl, newest)][-entries:]


def fitted(cpl: list[list[int]], entries: int) -> list[list[int]]:
    """A CPL of another length than n (n changed) made n long: excess oldest pairs dropped, missing ones copied
    from the most recent (docs/log-management.md)."""
    if len(cpl) >= entries:
        return [list(p) for p in cpl[-entries:]]
    return [list(cpl[-1])] * (entries - len(cpl)) + [list(p) for p in cpl]


def begin_passes(qm: LogUser, why: str) -> list[Pass]:
    """The copy half of the relog passes of one checkpoint: for each ACTIVE structure this member can take the
    relog lock of, relog the old copies, force them, mark them. The checkpoint then completes them."""
    if qm.config.cpl_entries <= 0 or qm.log is None:
        return []
    passes = []
    try:
        structures = [s.name for s in qm.admin.structures() if qm.admin.state(s.name) == "ACTIVE"]
    except Exception as e:  # noqa: BLE001 - a checkpoint never fails for want of relogging (the CF may be down)
        log.debug("%s: no relog pass (%s)", qm.name, e)
        return []
    for name in structures:
        try:
            p = _relog_structure(qm, name, termination=why == "shutdown")
        except RelogBusyError:
            continue  # another member relogs it
        except LogFullError as e:
            log.warning("%s: relog pass on %s stopped: %s; the previous pass stays in force", qm.name, name, e)
            break
        except (MQError, *CF_DOWN) as e:
            log.warning("%s: relog pass on %s did not finish (%s): the previous pass stays in force", qm.name,
                        name, e)
            continue
        passes.append(p)
    return passes


def _relog_structure(qm: LogUser, name: str, *, termination: bool) -> Pass:
    assert qm.log is not None
    s = qm.structure(name)
    entries = qm.config.cpl_entries
    begun = qm.cf_call(lambda: s.relog_begin(qm.caller, now_ms=now_ms(), lease_ms=qm.config.relog_lock_ms))
    stored = begun.cpl if begun.cpl is not None and int(begun.cpl.get("g", -1)) == begun.gen else None
    old = fitted(stored["p"], entries) if stored and stored.get("p") else [[begun.begin, begun.begin]] * entries
    if termination:
        threshold, window = EVERYTHING, begun.begin
    else:
        threshold = old[0][1]
        window = threshold
    # An in-doubt UOW's PREPARE lies above its first LRSN, and nothing re-logs it: the window reaches back to it.
    p = Pass(name, begun.gen, begun.begin, threshold, min(window, begun.first), old, begun.carried)
    cursor = "0"
    while True:
        batch = qm.cf_call(partial(s.relog_scan, qm.caller, threshold=threshold, cursor=cursor,
                                   count=qm.config.relog_batch))
        p.scanned += batch.scanned
        if batch.copies:
            room = qm.log.room()
            if room >= 0 and room - sum(len(d) + 200 for _, d, _ in batch.copies) < qm.log_reserve:
                # A circular log: the copies would eat the space kept for the checkpoint and the outcomes of work
                # begun. The pass stops, incomplete; the previous one stays in force (the ring is too small for
                # n intervals of relogging, or a unit of work holds it: ensure_log_space says which).
                raise LogFullError(f"{qm.log.directory}: no room in the circular log for the relog copies")
            lrsn = qm.clock.now()
            try:  # straight to the log: a pass's records are not activity that calls for another checkpoint
                for _entry, data, stored_desc in batch.copies:
                    qm.log.append(records.relog(lrsn, structure=name, gen=begun.gen, entry=stored_desc, data=data))
                    p.copies += 1
                    p.bytes += len(data)
                failpoint("relog-before-force")
                qm.log.force()
            except LogFullError:
                raise  # a full circular log: the pass stops, incomplete (the previous one stays in force)
            except OSError as e:
                qm.log_failure(e)
            failpoint("relog-after-force")
            ids = [e.id for e, _, _ in batch.copies]
            qm.cf_call(partial(s.relog_end, qm.caller, relog_lrsn=lrsn, ids=ids))
        cursor = batch.cursor
        if cursor == "0":
            break
    qm.counters["relog_records"] = qm.counters.get("relog_records", 0) + p.copies
    qm.counters["relog_bytes"] = qm.counters.get("relog_bytes", 0) + p.bytes
    return p


def finish(qm: LogUser, passes: list[Pass]) -> None:
    """After the checkpoint record that carries them is on disk: store each aged CPL and release the lock."""
    for p in passes:
        cpl = {"g": p.gen, "p": p.cpl}
        try:
            qm.cf_call(partial(qm.structure(p.structure).relog_end, qm.caller, relog_lrsn=0, ids=(), cpl=cpl))
        except (MQError, *CF_DOWN) as e:
            log.warning("%s: the CPL of %s was not stored (%s): the next pass starts from the previous one",
                        qm.name, p.structure, e)


def newest_pass(log_dirs: Iterable[Path], structure: str) -> tuple[str, dict[str, Any]] | None:
    """The newest complete relog pass of `structure` (docs/log-management.md), as (member, pass): each member
    carries the last pass it completed for each structure in every checkpoint record, so its last checkpoint
    says it. A pass is complete only once that record is on disk: a pass cut short by a crash is in no record.
    Restore starts from its window; log retention (sqm.core.retention) keeps the logs from there."""
    best: tuple[str, dict[str, Any]] | None = None
    for d in log_dirs:
        reader = LogReader(d)
        last = reader.last_checkpoint()
        p = ((last[1].get("rl") or {}).get(structure)) if last else None
        if p and (best is None or int(p["e"]) > int(best[1]["e"])):
            best = (reader.member, p)
    return best


def last_passes(checkpoint: records.Record | None) -> dict[str, dict[str, Any]]:
    """The relog passes a checkpoint record carries (restart seeds the member's from its last checkpoint)."""
    return dict((checkpoint or {}).get("rl") or {})


__all__ = ["Pass", "aged", "begin_passes", "finish", "fitted", "last_passes", "newest_pass", "EVERYTHING"]
