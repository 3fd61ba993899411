"""What happens to UOWs with no caller: lifetimes and postponement on the pseudo-clock, status lifetimes, and the
settling of UOWs whose holder is gone (the restart tables, docs/uow.md). Run by every member's housekeeping (about once
a second) and, for one member, by its restart and by the peer that recovers it. Every change is one replacement of
the UOW's control entry (sqm.conversations.uowcontrols.replace), so two members sweeping at once change a UOW once: the second
finds the control taken or changed, and leaves it.

Lifetimes count on the structure's pseudo-clock (cfemu/scripts/pclock.lua), which runs only while the structure is
ACTIVE and some member ticks it: a group stopped for a day does not come back to find every UOW timed out, and a
structure that is failed or being restored times nothing out. MQ's own message expiry stays on the wall clock, as
MQ defines it (an MQMD expiry is real time); a UOW's messages carry none, their UOW's lifetime governs them."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

from cfemu.errors import MQError, StructureFailedError, UowStatusError
from sqm.conversations import bindings
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import settle_orphan
from sqm.conversations.uowstatus import (
    ACCEPTED,
    ACTIVE,
    DELIVERED,
    FINAL,
    POSTPONED,
    RECEIVED,
    SYSTEM,
    Control,
    after_restart,
    finish,
    transition,
)
from sqm.core.member import Member
from sqm.core.pclock import member_epochs

log = logging.getLogger(__name__)


class Sweeper:
    """One member's sweeper. Each sweep reads a bounded batch of each status of each service (peek_scan.lua: the CF's
    cost per sweep does not grow with the number of UOWs or kept statuses; a full pass takes as many sweeps as there
    are batches). An orphan (a RECEIVED or DELIVERED UOW held by a unit of work this member no longer has) is
    settled when a later sweep sees it again, so that a caller settling its own backout goes first."""

    BATCH = 500

    def __init__(self, qm: Member) -> None:
        self.qm = qm
        self.cursors: dict[tuple[str, str], str] = {}  # (service, status) -> where its pass goes on
        self.suspects: dict[tuple[str, str], int] = {}  # (uow, owner) -> the sweep that first saw it orphaned
        self.sweeps = 0
        self.counts: Counter[str] = Counter()

    def sweep(self) -> Counter[str]:
        qm = self.qm
        done: Counter[str] = Counter()
        self.sweeps += 1
        self.suspects = {k: n for k, n in self.suspects.items() if self.sweeps - n < 1000}
        for svc in list(ctl.services(qm)):
            try:
                done += self._sweep_service(svc)
            except (StructureFailedError, UowStatusError):
                continue  # not ACTIVE (no timeout processing while the store is unavailable), or raced
            except MQError as e:  # one service's trouble must not stop every other's lifetimes
                log.warning("%s: sweeping service %s failed: %s", qm.name, svc.name, e)
        self.counts += done
        return done

    def _batch(self, svc: ctl.Service, status: str) -> list[Control]:
        key = (svc.name, status)
        cursor, controls = ctl.scan_status(self.qm, svc, status, self.cursors.get(key, "0"), self.BATCH)
        self.cursors[key] = cursor
        return controls

    def _sweep_service(self, svc: ctl.Service) -> Counter[str]:
        qm = self.qm
        done: Counter[str] = Counter()
        pc = ctl.pseudo_clock(qm, svc.structure)
        by_status = {st: self._batch(svc, st) for st in (*ACTIVE, *FINAL)}
        newest = max((c.changed_pc for cs in by_status.values() for c in cs), default=0)
        if newest > pc:  # a restored structure: its clock resumes from the newest status it holds
            pc = ctl.pseudo_clock(qm, svc.structure, floor=newest)
        for c in by_status[ACCEPTED]:
            if c.created_pc + c.lifetime_ms <= pc:
                done[_apply(qm, svc, c, lambda old: finish(old, transition(SYSTEM, "TIMEOUT", old.status), pc),
                            "timed-out")] += 1
        for c in by_status[POSTPONED]:
            if c.until_pc <= pc:
                done[_apply(qm, svc, c, lambda old: replace(old, status=transition(SYSTEM, "RESUME", old.status),
                                                            until_pc=0, changed_pc=pc), "resumed")] += 1
        epochs = member_epochs(qm)
        done += _settle_outlived(qm, svc, [c for st in ACTIVE for c in by_status[st]], epochs)
        for c in (*by_status[RECEIVED], *by_status[DELIVERED]):
            if c.owner_member == qm.name and c.owner not in qm.uows and not c.outlived(epochs)[0]:
                key = (c.uow, c.owner)
                if self.suspects.setdefault(key, self.sweeps) < self.sweeps:
                    settle_orphan(qm, svc, c.uow, c.owner, wait_s=0.0)
                    self.suspects.pop(key, None)
                    done["orphans-settled"] += 1
        for st in FINAL:
            for c in by_status[st]:
                if c.final_pc + c.status_mult * c.lifetime_ms <= pc:
                    done[_apply(qm, svc, c, lambda old: None, "statuses-expired")] += 1
        key = (svc.name, "conversations")
        self.cursors[key], ended = bindings.expire_idle(qm, svc, pc, self.cursors.get(key, "0"), self.BATCH)
        if ended:
            done["conversations-ended"] += ended
        return done


def _apply(qm: Member, svc: ctl.Service, seen: Control, change: object, what: str) -> str:
    """One sweeper change, if the control is still as seen (another member may have changed it). A control held by
    someone else is left to a later sweep at once (wait_s 0): the sweep does not wait on a change in flight."""
    def guarded(old: Control) -> Control | None:
        if (old.status, old.owner, old.changed_pc) != (seen.status, seen.owner, seen.changed_pc):
            raise UowStatusError(f"unit of work {old.uow} changed meanwhile")
        return change(old)  # type: ignore[operator]
    try:
        _, new = ctl.replace(qm, svc, seen.uow, guarded,
                             drain=lambda old, new: new is None or new.status in FINAL, wait_s=0.0)
    except UowStatusError:
        return "raced"
    return what


def settle_member(qm: Member) -> Counter[str]:
    """After a member restarted (qm is it) or was recovered by a peer (qm is the peer, after the fence): every UOW
    that a gone member incarnation held is settled by the restart tables (docs/uow.md; sqm.conversations.uowstatus.after_restart).
    Idempotent, and safe while the members work on: only gone incarnations are named (Control.outlived)."""
    done: Counter[str] = Counter()
    epochs = member_epochs(qm)
    for svc in list(ctl.services(qm)):
        try:
            controls = [c for st in ACTIVE for c in ctl.scan_all(qm, svc, st)]
        except StructureFailedError:
            continue
        done += _settle_outlived(qm, svc, controls, epochs)
    if done:
        log.info("%s: units of work of gone member incarnations settled: %s", qm.name, dict(done))
    return done


def _settle_outlived(qm: Member, svc: ctl.Service, controls: list[Control],
                     epochs: dict[str, int]) -> Counter[str]:
    """The ones a unit of work of a gone incarnation held (RECEIVED, DELIVERED), and the ones it was home to that
    nobody holds (a non-persistent UOW lives as long as the member incarnation it was sent through; a postponed one
    is ACCEPTED again). A UOW that a live receiver on another member holds is left to it.

    A held one waits until the gone holder's unit of work is backed out (restart and peer recovery do that before
    they settle, but every member's sweeper sees the new epoch at once, and a peer that cannot read the dead
    member's log fences it and leaves its work in flight): its puts and gets still hold the UOW's messages, so a
    UOW made ACCEPTED then would be received in part, and one discarded then would get its messages back, with no
    status to own them, from the backout.

    A settled UOW's home becomes its home member's current incarnation: each later restart or recovery of that
    member settles it again (Table 1 once per restart). A persistent ACCEPTED UOW is left as it is (its stale home
    changes nothing), and a postponement makes the postponing member its home (sqm.conversations.conversation), so a restart
    the UOW lived through does not cut a later postponement's delay short."""
    done: Counter[str] = Counter()
    holding: dict[str, dict[str, object]] = {}  # member -> the units of work it still holds on the structure

    def still_held(c: Control) -> bool:
        member = c.owner_member
        if member not in holding:
            holding[member] = qm.cf_call(lambda: qm.structure(svc.structure).member_uows(member))
        return c.owner in holding[member]

    for c in controls:
        held, home = c.outlived(epochs)
        if not (held or (home and not c.owner)):
            continue
        if held and still_held(c):
            continue  # its holder's work is not backed out yet: a later sweep settles it
        new = after_restart(c)
        if new == c:
            continue  # a persistent ACCEPTED UOW is restored as it is: rewriting it moved it behind later commits
        if new is not None and home:
            member = c.home.split(".", 1)[0]
            new = replace(new, home=f"{member}.{epochs[member]:x}" if member in epochs else "")
        what = "restart-" + (new.status.lower() if new is not None else "dropped")
        done[_apply(qm, svc, c, lambda old, new=new: new, what)] += 1
    return done


def settle_member_best_effort(qm: Member) -> Counter[str]:
    try:
        return settle_member(qm)
    except MQError as e:
        log.warning("%s: settling the units of work of gone members failed (the sweeper retries): %s", qm.name, e)
        return Counter()


__all__ = ["Sweeper", "settle_member", "settle_member_best_effort"]
