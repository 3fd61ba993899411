"""Units of work: the in-memory UOW table, and its rebuild from a log (restart and peer recovery)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqm.core.records import DONE, INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT, Record, counts_at, kind_of


@dataclass
class UnitOfWork:
    id: str
    owner: str
    state: str = INFLIGHT
    structures: dict[str, int] = field(default_factory=dict)  # structure -> generation it started in (0: unknown)
    persistent: bool = False  # has logged work: its outcome is decided by a forced record
    xid: str = ""  # external (XA) transaction id once prepared
    # The LRSN at which the decided outcome counts (sqm.core.records.counts_at of the first record of the decision):
    # the CF stamps the entries with it, restore places the outcome there.
    decided_lrsn: int = 0
    record_lrsn: int = 0  # LRSN of the latest record of that decision: the CF checks it against its floor
    data_logged: bool = False  # that record carries the data of the UOW's persistent gets (backup running)
    operations: int = 0
    # The messages the application put and got in it (MAXUMSGS counts these: QueueManagerConfig.max_umsgs). A
    # wing's own bookkeeping entries and a poison message's move to the backout queue are not counted, so that a
    # unit of work refused at its limit can always be settled.
    umsgs: int = 0
    # The LRSN of its first logged record (0: not known, a UOW from a checkpoint written before this was kept):
    # the log must keep it while the UOW is active or in doubt (sqm.core.retention).
    first_lrsn: int = 0
    # Why this UOW can only be backed out (empty: it may commit): a CF call of it failed, so its state on that
    # structure is unknown to the member (the call may have run, its reply lost). MQ backs such a UOW out.
    doomed: str = ""
    # Structures on which this process has applied the decided outcome: a retry skips them (fewer CF calls). Not
    # needed for correctness: a structure that applied the outcome answers a retry as done, durably (a tombstone
    # when a restore carried the UOW into a new generation; see commit.lua), also after a restart.
    applied: set[str] = field(default_factory=set)
    # What it created and deleted in the persistent store, reported if it commits (sqm.core.storereport).
    store_notes: list[dict[str, Any]] = field(default_factory=list)
    # Puts committed in one CF operation (put_committed.lua), as their PUT records hold them: [structure, entry
    # (wire form), data, put LRSN]. Logged before the CF call, so the commit of the UOW redoes them on the CF.
    redo: list[list[Any]] = field(default_factory=list)
    # UOWs (by structure) whose put_committed tombstones the CF may drop: their END was on disk when this UOW's
    # COMMIT was forced (Outcomes.complete).
    forget: dict[str, list[str]] = field(default_factory=dict)
    # When this process began it (wall-clock seconds; at restart, a UOW rebuilt from the log begins anew): its age
    # as DISPLAY CONN shows it.
    began: float = field(default_factory=time.time, compare=False)
    # An in-doubt UOW a resolve has claimed (Outcomes.resolve): it has one decision, so a second resolve (the
    # coordinator's and an operator's, say) is refused while the first is under way, not logged beside it.
    resolving: bool = field(default=False, compare=False)

    def snapshot(self) -> dict[str, Any]:
        snap = {"st": self.state, "ss": dict(self.structures), "x": self.xid, "dl": self.decided_lrsn,
                "rl": self.record_lrsn, "p": self.persistent, "f": self.first_lrsn}
        if self.redo:
            snap["rd"] = [list(r) for r in self.redo]
        return snap

    @classmethod
    def from_snapshot(cls, uow_id: str, owner: str, snap: dict[str, Any]) -> UnitOfWork:
        dl = int(snap.get("dl", 0))
        return cls(uow_id, owner, snap["st"], dict(snap.get("ss", {})), bool(snap.get("p", True)),
                   snap.get("x", ""), dl, int(snap.get("rl", dl)), first_lrsn=int(snap.get("f", 0)),
                   redo=[list(r) for r in snap.get("rd", ())])

    def decide(self, state: str, record: Record) -> None:
        """Take the state a decision record leaves. A record of the decision already taken is a re-log of it (the
        CF refused the first): the outcome still counts where the first one said."""
        if state in (INCOMMIT, INBACKOUT):
            if state != self.state or not self.decided_lrsn:
                self.decided_lrsn = counts_at(record)
            self.record_lrsn = record["l"]
        self.state = state


def rebuild_table(owner: str, checkpoint: Record | None, records: Iterable[Record]) -> dict[str, UnitOfWork]:
    """Current status rebuild (restart phase 1): the checkpoint's active UOWs, then every later record."""
    table: dict[str, UnitOfWork] = {}
    if checkpoint:
        for uid, snap in checkpoint.get("uows", {}).items():
            table[uid] = UnitOfWork.from_snapshot(uid, owner, snap)
    for rec in records:
        kind = kind_of(rec)
        if kind.uow_state is None or not rec.get("u"):
            continue
        uid = rec["u"]
        uow = table.get(uid)
        if uow is None:
            if kind.uow_state == DONE:
                continue
            uow = table[uid] = UnitOfWork(uid, owner, first_lrsn=int(rec["l"]))
        uow.persistent = True
        if "s" in rec and rec.get("g"):
            uow.structures.setdefault(rec["s"], rec["g"])
        for s, g in rec.get("ss", {}).items():
            if g or s not in uow.structures:
                uow.structures[s] = g
        if kind.uow_state == DONE:
            del table[uid]
            continue
        if rec.get("c"):  # a put committed in one CF operation: redone from the record
            uow.redo.append([rec["s"], rec["e"], rec["d"], int(rec["l"])])
        if kind.uow_state == INFLIGHT and uow.state != INFLIGHT:
            continue  # a late-appended PUT/GET record never moves a UOW back to in-flight
        if kind.uow_state == INDOUBT:
            uow.xid = rec.get("x", "")
        uow.decide(kind.uow_state, rec)
    return table


__all__ = ["UnitOfWork", "rebuild_table", "INFLIGHT", "INDOUBT", "INCOMMIT", "INBACKOUT", "DONE"]
