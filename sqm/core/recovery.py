"""Restart recovery of a queue manager and peer recovery of a failed one.

Restart (the four phases of the selective-relogging design and MQ's restart messages; docs/log-management.md):
  1 current status rebuild: the last checkpoint's UOW table, then every later record; plus the UOWs the CF shows
    for this member (puts and gets that reached the CF but not the log);
  2 forward recovery: in-commit (and in-backout) UOWs are completed on the CF;
  3 backward recovery: in-flight UOWs are backed out;
  4 restart cleanup: in-doubt UOWs stay locked until the coordinator resolves them; a checkpoint is taken.

Peer recovery: when a member's lease lapses, one live member wins the recovery lock, fences the failed member
(bumps its epoch: every CF call it makes afterwards is refused), reads its log read-only, decides each of its
UOWs (in-commit -> commit, in-flight and in-backout -> backout, in-doubt -> left locked), and logs each decision
in its own log as a RECOVERY record, which outranks whatever the failed member writes later. Its clock first adopts
the failed member's highest LRSN (as restart does), so each RECOVERY record sorts after the UOW's operations; a
RECOVERY record that completes the owner's own COMMIT or BACKOUT counts at the owner's record (its `at`), where the
owner may have applied it already: the CF stamps the entries there, and restore places the outcome there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cfemu.errors import BackedOutError, MQError, StructureFailedError
from cfemu.repository import GroupRepository
from sqm.core.backupnote import note_from_log, note_new_backups
from sqm.core.cfcall import CF_DOWN
from sqm.core.records import INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT, Record
from sqm.core.relog import fitted
from sqm.core.uow import UnitOfWork, rebuild_table
from sqm.log import LogReader, RecordLog, holds_log

if TYPE_CHECKING:
    from sqm.core.member import RecoveringMember

log = logging.getLogger("sqm.recovery")

Progress = Callable[[str, dict[str, int]], None]


@dataclass
class RestartReport:
    member: str
    records_read: int = 0
    in_commit: int = 0
    in_backout: int = 0
    in_flight: int = 0
    in_doubt: int = 0
    waiting_for_cf: int = 0
    seconds: float = 0.0
    phases: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    # The log range restart read: from the checkpoint it used (its LRSN and position), the segments opened, and the
    # LRSN range of the records read. Messages (logger sqm.core.recovery) name them as MQ's CSQR messages do.
    checkpoint_lrsn: int = 0
    checkpoint_position: str = ""
    segments_read: list[int] = field(default_factory=list)
    lrsn_range: tuple[int, int] = (0, 0)
    forward_range: tuple[int, int] = (0, 0)  # LRSN range of the in-commit/in-backout UOWs completed
    backward_range: tuple[int, int] = (0, 0)  # LRSN range of the in-flight UOWs backed out
    messages: list[str] = field(default_factory=list)
    # Damaged active log segments restored from their archived copies when the log was opened (sqm.log.mediacopy).
    media_recovered: list[int] = field(default_factory=list)
    # The CPLs restart found of another length than the member's n now: {structure: (pairs found, n)}.
    cpl_reconciled: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The last BACKUP record of each structure in the log ({structure: {b, l, rf}}: sqm.core.backupnote).
    backups: dict[str, dict[str, int | str]] = field(default_factory=dict)


#: Restart reports its progress every this many records read (CSQR031I).
PROGRESS_EVERY = 50_000


@dataclass
class PeerRecoveryReport:
    failed: str
    by: str
    committed: int = 0
    backed_out: int = 0
    in_doubt: int = 0
    seconds: float = 0.0


def _table_from_log(reader_or_log: RecordLog | LogReader, owner: str,
                    rep: RestartReport | None = None,
                    say: Callable[[str], None] | None = None) -> tuple[dict[str, UnitOfWork], int, int]:
    """The UOW table at the end of a log, the number of records read, and the highest LRSN in the log. With rep,
    the range read is recorded there (the checkpoint used, the segments and LRSNs read) and said (say)."""
    ckpt = reader_or_log.last_checkpoint()
    start, ckpt_rec = (ckpt[0], ckpt[1]) if ckpt else (None, None)
    count = 0
    segs = reader_or_log.segments()
    high = max((s.max_lrsn or 0 for s in segs), default=0)
    low = -1
    read: set[int] = set()
    see_backup = note_from_log(rep.backups, ckpt_rec) if rep is not None else None
    if rep is not None and say is not None:
        first = start.segment if start else (segs[0].segment if segs else 0)
        rep.checkpoint_lrsn = int(ckpt_rec["l"]) if ckpt_rec else 0
        rep.checkpoint_position = str(start) if start else ""
        say(f"CSQR003I {owner} restart: " + (f"using the checkpoint at LRSN {rep.checkpoint_lrsn} (position {start})"
                                             if start else "no checkpoint: reading the whole log")
            + f"; reading log segments {first}..{segs[-1].segment if segs else first} up to LRSN {high}")

    def records() -> Iterator[Record]:
        nonlocal count, high, low
        for pos, rec in reader_or_log.records(start):
            count += 1
            lrsn = rec["l"]
            high = max(high, lrsn)
            low = lrsn if low < 0 else min(low, lrsn)
            read.add(pos.segment)
            if see_backup is not None:
                see_backup(rec)
            if say is not None and count % PROGRESS_EVERY == 0:
                say(f"CSQR031I {owner} restart: reading the log forward, {count} records, at LRSN {lrsn} (segment "
                    f"{pos.segment}) of {high}")
            yield rec

    table = rebuild_table(owner, ckpt_rec, records())
    if rep is not None:
        rep.segments_read = sorted(read)
        rep.lrsn_range = (max(low, 0), high if count else max(low, 0))
    return table, count, high


def _range(uows: list[UnitOfWork]) -> tuple[int, int]:
    lrsns = [x for u in uows for x in (u.first_lrsn, u.decided_lrsn, u.record_lrsn) if x]
    return (min(lrsns), max(lrsns)) if lrsns else (0, 0)


def _add_cf_only_uows(qm: RecoveringMember, owner: str, table: dict[str, UnitOfWork]) -> None:
    """UOWs that hold entries on a structure but never reached the owner's log are in flight."""
    for sdef in qm.admin.structures():
        try:
            held = qm.structure(sdef.name).member_uows(owner)
        except MQError:
            continue
        for uid, info in held.items():
            uow = table.get(uid)
            if uow is None:
                uow = table[uid] = UnitOfWork(uid, owner)
            uow.structures.setdefault(sdef.name, int(info.get("g", 0)))


def restart(qm: RecoveringMember, progress: Progress | None = None) -> RestartReport:
    t0 = time.monotonic()
    rep = RestartReport(qm.name)

    def phase(name: str, counts: dict[str, int]) -> None:
        rep.phases.append((name, counts))
        log.info("%s restart: %s %s", qm.name, name, " ".join(f"{k}={v}" for k, v in counts.items()))
        if progress:
            progress(name, counts)

    def say(text: str) -> None:
        rep.messages.append(text)
        log.info("%s", text)

    assert qm.log is not None
    say(f"CSQR001I {qm.name} restart initiated")
    for m in qm.log.media_recovered:
        rep.media_recovered.append(m.segment)
        say(f"{qm.name} restart: media recovery of log segment {m.segment}: it was damaged ({m.why}); restored from "
            f"its archived copy {m.copy}")
    table, rep.records_read, high = _table_from_log(qm.log, qm.name, rep, say)
    qm.clock.observe(high)  # LRSNs this member wrote before the restart stay below the ones it writes now
    qm.backups_noted = rep.backups
    _add_cf_only_uows(qm, qm.name, table)
    with qm.uow_lock:
        qm.uows.update(table)
    by_state = {s: [u for u in table.values() if u.state == s] for s in (INCOMMIT, INBACKOUT, INFLIGHT, INDOUBT)}
    rep.in_commit, rep.in_backout = len(by_state[INCOMMIT]), len(by_state[INBACKOUT])
    rep.in_flight, rep.in_doubt = len(by_state[INFLIGHT]), len(by_state[INDOUBT])
    phase("current status rebuild", {"records": rep.records_read, "in-commit": rep.in_commit,
                                     "in-backout": rep.in_backout, "in-flight": rep.in_flight,
                                     "in-doubt": rep.in_doubt})
    if qm.config.log_mode == "circular":
        # A ring left full by the last run: release what is inactive now that the UOW table is known, so that the
        # records restart writes (backouts, the start checkpoint) find room without overwriting a needed one.
        qm.manage_log()

    def finish(uow: UnitOfWork, commit: bool) -> None:
        try:
            qm.apply(uow, commit)
        except BackedOutError:
            pass  # recovery decided otherwise while we were down; the log now says so
        except StructureFailedError:
            rep.waiting_for_cf += 1
            qm.pending[uow.id] = lambda: qm.apply(uow, commit)

    rep.forward_range = _range(by_state[INCOMMIT] + by_state[INBACKOUT])
    rep.backward_range = _range(by_state[INFLIGHT])
    say(f"CSQR004I {qm.name} restart: {rep.records_read} records read, LRSN {rep.lrsn_range[0]}..{rep.lrsn_range[1]} "
        f"in segments {', '.join(map(str, rep.segments_read)) or 'none'}")
    if rep.in_commit + rep.in_backout:
        say(f"CSQR005I {qm.name} restart: forward recovery of {rep.in_commit + rep.in_backout} units of work, log "
            f"range LRSN {rep.forward_range[0]}..{rep.forward_range[1]}")
    if rep.in_flight:
        say(f"CSQR006I {qm.name} restart: backward recovery of {rep.in_flight} units of work, log range LRSN "
            f"{rep.backward_range[0]}..{rep.backward_range[1]}")
    for uow in by_state[INCOMMIT]:
        finish(uow, True)
    for uow in by_state[INBACKOUT]:
        finish(uow, False)
    phase("forward recovery", {"completed": rep.in_commit + rep.in_backout, "waiting for CF": rep.waiting_for_cf})

    for uow in by_state[INFLIGHT]:
        try:
            qm.complete(uow, False, reason="restart")
        except BackedOutError:
            pass
    phase("backward recovery", {"backed out": rep.in_flight})
    _say_backups(qm, say)
    for line in qm.hooks.member_recovered(qm.name):  # the wings' work of the restarted member (sqm.core.hooks)
        say(line)

    _reconcile_cpls(qm, rep, say)
    qm.checkpoint("start")
    phase("restart cleanup", {"in-doubt kept": rep.in_doubt})
    rep.seconds = time.monotonic() - t0
    say(f"CSQR002I {qm.name} restart completed in {rep.seconds:.3f}s: {rep.in_commit + rep.in_backout} units of "
        f"work completed, {rep.in_flight} backed out, {rep.in_doubt} in doubt")
    return rep


def _reconcile_cpls(qm: RecoveringMember, rep: RestartReport, say: Callable[[str], None]) -> None:
    """Restart cleanup (seed 000, Table 5): the CPL of each structure the member carries from its last checkpoint is
    made n pairs long, n the number defined now (--cpl-entries, which may have changed since): fewer pairs than n,
    the missing (oldest) ones take the values of the most recent pair; more, the oldest excess pairs are dropped.
    The CF's stored CPL is fitted the same way by the next pass that reads it (sqm.core.relog.fitted)."""
    n = qm.config.cpl_entries
    if n <= 0:
        return  # relogging off: no CPL is kept
    for structure, carried in sorted(qm.relog_passes.items()):
        cpl = carried.get("cpl") or []
        if not cpl or len(cpl) == n:
            continue
        rep.cpl_reconciled[structure] = (len(cpl), n)
        qm.relog_passes[structure] = {**carried, "cpl": fitted(cpl, n)}
        how = (f"the {n - len(cpl)} missing pairs take the most recent pair's values" if len(cpl) < n
               else f"the {len(cpl) - n} oldest pairs are dropped")
        say(f"{qm.name} restart: the CPL of {structure} had {len(cpl)} entry pairs and {n} are defined now: {how}")


def _say_backups(qm: RecoveringMember, say: Callable[[str], None]) -> None:
    """Note the backups completed while the member was down (the CF may be down too: then at the next
    housekeeping), and say the newest backup of each structure the log records (its log position)."""
    try:
        note_new_backups(qm, force=True)
    except (MQError, *CF_DOWN) as e:
        log.info("%s restart: the backup catalog cannot be read now (%s): backups are noted later", qm.name, e)
    for structure, b in sorted(qm.backups_noted.items()):
        say(f"{qm.name} restart: the last backup of {structure} recorded in the log is {b['b']} (at LRSN {b['l']}): "
            f"CF recovery from it replays the logs from LRSN {b['rf']}")


_UNREADABLE_SAID: dict[tuple[str, str], float] = {}  # (recoverer, failed) -> when it last said so


def _cannot_read_log(qm: RecoveringMember, failed: str, log_dir: Path) -> None:
    """Say (once a minute per failed member, not every housekeeping pass) why the failed member is not recovered."""
    key = (qm.name, failed)
    if time.monotonic() - _UNREADABLE_SAID.get(key, -math.inf) < 60.0:
        return
    _UNREADABLE_SAID[key] = time.monotonic()
    log.error("%s: cannot read the log of %s at %s (no log there): its work is not recovered; it stays fenced with "
              "its entries locked until its log is back there, it restarts, or its log is declared lost for good "
              "(sqm log lost)", qm.name, failed, log_dir)


def recover_peers(qm: RecoveringMember) -> list[PeerRecoveryReport]:
    """Called periodically by every live member: recover any member whose lease has lapsed."""
    reports = []
    for failed in qm.admin.lapsed_members():
        if failed == qm.name or qm.fenced:
            continue
        if not qm.admin.try_recovery_lock(failed, qm.name, ttl_ms=max(30_000, 6 * qm.config.lease_ms)):
            continue
        try:
            rep = recover_peer(qm, failed)
            if rep is not None:
                reports.append(rep)
        finally:
            qm.admin.release_recovery_lock(failed)
    return reports


def recover_peer(qm: RecoveringMember, failed: str) -> PeerRecoveryReport | None:
    """Fence the failed member and complete its work from its log. None when its log cannot be read: then nothing
    is decided (it stays fenced, its entries locked, until its log is back or it restarts and recovers itself)."""
    t0 = time.monotonic()
    rep = PeerRecoveryReport(failed, qm.name)
    epoch = qm.admin.fence(failed, repair_ms=qm.config.lease_ms)
    if not epoch:
        log.info("%s: %s holds a lease again (it restarted) or left the group: nothing to recover", qm.name, failed)
        return rep
    log_dir = qm.config.log_root / failed
    if holds_log(log_dir):
        table, _, high = _table_from_log(LogReader(log_dir), failed)
    elif (GroupRepository(qm.config.log_root).lost_logs().get(failed) or {}).get("pending"):
        # Its log was declared lost for good (sqm log lost): nothing but the CF is left to decide its work, and
        # every UOW found there is backed out, as its own restart with a new log would.
        log.warning("%s: the log of %s was declared lost: its units of work on the CF are backed out", qm.name,
                    failed)
        table, high = {}, 0
    else:
        # Without the log, a UOW found only in the CF could be in flight (back it out) or committed with its
        # COMMIT forced (complete it): backing them all out lost committed messages.
        _cannot_read_log(qm, failed, log_dir)
        return None
    # As restart does: every RECOVERY record this member writes for the failed one sorts after everything the
    # failed member logged, whatever our own clock says. A peer whose clock lags (skewed, or idle since before
    # the failed member's last operations) would decide a UOW below its own operations, and restore would leave
    # its entries locked for good (the redo rule: DESIGN-NOTES section 4; invariant 1, docs/invariants.md).
    qm.clock.observe(high)
    _add_cf_only_uows(qm, failed, table)
    for uow in table.values():
        if uow.state == INDOUBT:
            rep.in_doubt += 1
            continue
        commit = uow.state == INCOMMIT
        try:
            qm.complete(uow, commit, for_member=failed)
        except BackedOutError:
            # A structure refused the commit: a restore backed the UOW out there (or its work there was lost with
            # the CF). complete() backed it out everywhere; the member's other UOWs are recovered all the same, as
            # restart does (before, the first refusal stopped the recovery: every later UOW of the member stayed
            # locked, and every later attempt failed the same way).
            commit = False
        if commit:
            rep.committed += 1
        else:
            rep.backed_out += 1
    # Counted before the member is forgotten: whoever sees it gone from the group sees its recovery counted (a
    # test polling the members read the counter a moment too early under load).
    qm.hooks.member_recovered(failed)  # the wings' work of the failed member, whose epoch is fenced (sqm.core.hooks)
    qm.counters["peer_recoveries"] += 1
    if not qm.admin.forget_member(failed, epoch):  # it joined again while its previous incarnation was recovered
        log.info("%s: %s joined again during its recovery: it stays a member", qm.name, failed)
    rep.seconds = time.monotonic() - t0
    log.warning("%s recovered %s in %.3fs: %d committed, %d backed out, %d in doubt kept", qm.name, failed,
                rep.seconds, rep.committed, rep.backed_out, rep.in_doubt)
    return rep
