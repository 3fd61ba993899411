"""Automatic structure recovery (RECAUTO, as MQ's CFSTRUCT RECAUTO(YES)): a member restores a failed structure.

The member's housekeeping calls ``StructureRecovery.check`` (every ``CHECK_INTERVAL_S``). A structure needs
recovering when the group repository defines it with RECAUTO on (cfemu.repository; the repository outlives the
CF, the admin structure does not) and the CF says

  FAILED       failed, or missing from a CF that came back empty (cfemu.admin.Admin.state counts that FAILED), or
  RECOVERING   with an automatic recovery's mark ({ADMIN}:recauto-attempts) and no live lock: the member that
               ran it died mid-way, or its restore failed after claiming the structure (StructureLeftRecovering:
               tried again). A RECOVERING structure without the mark is an operator's restore: left alone.

A structure the group repository records as migrated (a store migration's source, backup.migrate) is never
recovered, whatever the CF says: its messages are served by the migration's target, and the CF loss that made it
FAILED took away the MIGRATED header that kept it apart. The member says so once (CSQE138W); only ``cfemu migrate
reopen`` gives it back.

One member recovers it: the one that takes the lock ``{ADMIN}:recauto:<structure>`` (SET NX PX, value
``member@epoch``, renewed every third of its TTL while the restore runs; admin_hold_lock.lua renews and releases
only the holder's own). The others see the lock, say once that they wait, and carry on: their calls on the
structure fail with MQRC_CF_STRUC_FAILED until it is ACTIVE, then work again (re-joining it as after any restore).

The restore itself runs in a thread of its own (a restore may take long; the member's other work goes on). It is
not this floor's: sqm does not import restore (the floors, docs/architecture.md). The top floor injects it as a
``RecoverStructure`` (qsg.member wires restore.run.run_restore into ``sqm run``). Two restores never run at once
even when the lock is lost (its TTL lapsed while the holder stalled, or the CF was lost again): restore's own
ownership (cfemu.bulk claim and guarded writes, restore's log lock) refuses or stops the later one, and a lock
only decides who tries, never what is written.

Progress is logged as MQ's CSQE messages, in the member's log::

    CSQE132I structure recovery started for APP1 by QM2 (epoch E)
    CSQE133I recovery of APP1: <phase>                          (each restore phase, as it starts)
    CSQE130I recovery of APP1 used backup <id> (<kind>), logs from LRSN <n>
    CSQE131I recovery of APP1 completed in 2.3 s: <counts>
    CSQE135E recovery of APP1 by QM2 failed after 0.4 s: <reason>; retrying in 2 s (or: cfrestore run APP1)
    CSQE136I structure APP1 is being recovered by QM1@E; QM2 waits for it to be ACTIVE
    CSQE137W QM2 lost the recovery lock of APP1 (...): the restore goes on, its ownership of the structure holds
    CSQE138W QM2 does not recover APP1: structure APP1 was migrated (...) ... 'cfemu migrate reopen APP1' ...

and counted in the queue manager's counters (the service's metric ``sqm_structure_recoveries_total{event}``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from cfemu.latency import SLOW_BUCKETS, Latencies, Latency, PhaseTimes
from cfemu.repository import migrated_refusal
from sqm.core.cfcall import CF_DOWN
from sqm.core.config import RecoverStructure, StructureLeftRecovering  # the port the top floor injects

if TYPE_CHECKING:
    from sqm.core.member import Member

log = logging.getLogger("sqm.recauto")

EVENTS = ("started", "completed", "failed")  # the counter's label values (a fixed set)
CHECK_INTERVAL_S = 0.5
RETRY_MAX_S = 60.0


def counter(event: str) -> str:
    """The queue manager's counter of a RECAUTO event (QueueManager.counters, shown by status and metrics)."""
    return f"structure_recoveries_{event}"


class StructureRecovery:
    """RECAUTO for one queue manager: detection (check), the lock, the restore's thread, its messages."""

    def __init__(self, qm: Member, recover: RecoverStructure, *, lock_ttl_ms: int | None = None) -> None:
        self.qm = qm
        self.recover = recover
        self.ttl_ms = lock_ttl_ms or max(10_000, 3 * qm.config.lease_ms)
        self.threads: dict[str, threading.Thread] = {}
        self._failures: dict[str, int] = {}
        self._next_try: dict[str, float] = {}
        self._waiting: dict[str, str] = {}  # structure -> the holder we said we wait for
        self._migrated_said: set[str] = set()  # migrated structures we said we do not recover
        self._next_check = 0.0
        self._lock = threading.Lock()
        for event in EVENTS:
            qm.counters.setdefault(counter(event), 0)
        # How long the recoveries this member completed took, in all and per restore phase (sqm.service.metrics).
        self.seconds = Latency(SLOW_BUCKETS)
        self.phase_seconds = Latencies(SLOW_BUCKETS)

    @property
    def holder(self) -> str:
        return f"{self.qm.name}@{self.qm.caller.epoch}"

    def busy(self) -> list[str]:
        """Structures this member is recovering now."""
        with self._lock:
            return [s for s, t in self.threads.items() if t.is_alive()]

    def wait(self, timeout: float) -> bool:
        """Until no recovery of this member runs (tests, shutdown); False when one still runs after timeout."""
        deadline = time.monotonic() + timeout
        for t in list(self.threads.values()):
            t.join(max(0.0, deadline - time.monotonic()))
        return not self.busy()

    # --- detection ---------------------------------------------------------------------------------------------
    def check(self, *, now: float | None = None) -> list[str]:
        """Start the recovery of every structure that needs it and whose lock this member takes; returns those
        started. Called by housekeeping; CF errors propagate (the CF is not back yet: nothing to do)."""
        t = time.monotonic() if now is None else now
        if t < self._next_check:
            return []
        self._next_check = t + CHECK_INTERVAL_S
        repo = self.qm.repository
        if repo is None:
            return []
        started = []
        migrated = repo.migrated()
        self._migrated_said &= set(migrated)  # reopened: say it again if it is migrated again
        for name, sdef in sorted(repo.structures().items()):
            if not sdef.recauto or name in self.busy() or t < self._next_try.get(name, 0.0):
                continue
            if name in migrated:
                if name not in self._migrated_said and self._needs_recovery(name):
                    self._migrated_said.add(name)
                    log.warning("CSQE138W %s does not recover %s: %s", self.qm.name, name,
                                migrated_refusal(name, migrated[name], "recovering"))
                continue
            if not self._needs_recovery(name):
                self._waiting.pop(name, None)
                continue
            holder = self.holder
            if self.qm.admin.try_structure_recovery_lock(name, holder, self.ttl_ms):
                self._waiting.pop(name, None)
                self._start(name, holder)
                started.append(name)
            else:
                other = self.qm.admin.structure_recovery_holder(name) or "?"
                if self._waiting.get(name) != other:
                    self._waiting[name] = other
                    log.info("CSQE136I structure %s is being recovered by %s; %s waits for it to be ACTIVE", name,
                             other, self.qm.name)
        return started

    def _needs_recovery(self, name: str) -> bool:
        admin = self.qm.admin
        state = admin.state(name)
        if state == "FAILED":
            return True
        if state == "RECOVERING":  # an automatic restore whose member died mid-way (its lock lapsed)
            return admin.recovery_attempt(name) is not None and admin.structure_recovery_holder(name) is None
        return False

    # --- the recovery ------------------------------------------------------------------------------------------
    def _start(self, name: str, holder: str) -> None:
        t = threading.Thread(target=self._run, args=(name, holder), name=f"{self.qm.name}-recauto-{name}",
                             daemon=True)
        with self._lock:
            self.threads[name] = t
        t.start()

    def _run(self, name: str, holder: str) -> None:
        qm, admin = self.qm, self.qm.admin
        t0 = time.monotonic()
        done = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(name, holder, done), daemon=True,
                                   name=f"{qm.name}-recauto-lock-{name}")
        ok = left = False
        try:
            admin.set_recovery_attempt(name, holder)
            renewer.start()
            qm.counters[counter("started")] += 1
            log.info("CSQE132I structure recovery started for %s by %s (epoch %d)", name, qm.name,
                     qm.caller.epoch)
            phases: set[str] = set()

            def said(phase: str, n: int, total: int | None) -> None:
                if phase not in phases:
                    phases.add(phase)
                    log.info("CSQE133I recovery of %s: %s", name, phase)

            timer = PhaseTimes(self.phase_seconds, said)
            try:
                outcome = self.recover(name, timer)
            finally:
                timer.finish()
            seconds = time.monotonic() - t0
            self.seconds.observe(seconds)
            log.info("CSQE130I recovery of %s used backup %s (%s), logs from LRSN %s", name,
                     outcome.get("backup", "?"), outcome.get("base_kind", "?"), outcome.get("replay_from", "?"))
            log.info("CSQE131I recovery of %s completed in %.2f s: %s", name, seconds, outcome.get("summary", ""))
            qm.counters[counter("completed")] += 1
            self._failures.pop(name, None)
            self._next_try.pop(name, None)
            ok = True
        except Exception as e:  # noqa: BLE001 - every failure is a CSQE line and a retry, never a dead thread
            left = isinstance(e, StructureLeftRecovering)
            n = self._failures[name] = self._failures.get(name, 0) + 1
            delay = min(RETRY_MAX_S, 2.0 ** n)
            self._next_try[name] = time.monotonic() + delay
            qm.counters[counter("failed")] += 1
            log.error("CSQE135E recovery of %s by %s failed after %.2f s: %s: %s; retrying in %.0f s (or restore it: "
                      "cfrestore run %s)", name, qm.name, time.monotonic() - t0, type(e).__name__, e, delay, name)
        finally:
            done.set()
            with contextlib.suppress(*CF_DOWN):
                # A failed attempt that left the structure RECOVERING under its own claim keeps its mark: without it
                # the structure reads as an operator's restore, which no member recovers, where CSQE135E said that
                # it is tried again. (One refused because an operator's restore claimed it first leaves it alone.)
                if admin.recovery_attempt(name) == holder and not left:
                    admin.set_recovery_attempt(name, None)
                admin.release_structure_recovery_lock(name, holder)
            if not ok:
                log.debug("%s: recovery of %s ended without success", qm.name, name)

    def _renew(self, name: str, holder: str, done: threading.Event) -> None:
        """Keep the lock while the restore runs. A lost lock stops nothing: restore's ownership decides."""
        lost = False
        while not done.wait(self.ttl_ms / 3000):
            try:
                held = self.qm.admin.renew_structure_recovery_lock(name, holder, self.ttl_ms)
            except Exception as e:  # noqa: BLE001 - the CF may be gone; the restore says what that means
                held, why = False, f"{type(e).__name__}: {e}"
            else:
                why = "it lapsed or another member took it"
            if not held and not lost:
                lost = True
                log.warning("CSQE137W %s lost the recovery lock of %s (%s): the restore goes on, its ownership of "
                            "the structure decides whether it may write", self.qm.name, name, why)


__all__ = ["CHECK_INTERVAL_S", "EVENTS", "RecoverStructure", "StructureLeftRecovering", "StructureRecovery",
           "counter"]
