"""Property-based tests of restore against a reference model (hypothesis, stateful): random histories on three
in-process queue managers over one real CF (the session redis-server) with real logs, two structures (APP1 with
Q1 and Q2, APP2 with Q3; a unit of work may span both), fuzzy backups (backup.run.run_backup), CF losses restored
(restore.run.run_restore), one structure failing and restored while the other lives, purges, members that die
abruptly and are recovered by a peer (sqm.core.recovery.recover_peer) or by their own restart, and every member's LRSN
clock skewed.

What the histories hold:
- CF losses one after another: a loss and restore, live work on the restored structures (puts, gets, commits,
  backouts, in-doubt work, units of work the loss backed out behind the application's back: their commit, and
  their prepare, refused), then another loss, with or without a backup between; a purge followed by a loss. Before
  a loss each member's log is forced or not (drawn): records still in a member's buffer are invisible to that
  restore and reach the disk later.
- Clocks: each member's LRSN clock source is skewed by a drawn amount, ahead or behind, beyond the 1 s lease; a
  member that restarts draws a new one.
- Backups while the group works: a burst of work between two of a backup's copy steps (a get backed out then
  carries its data in the BACKOUT record: the patent's exception).
- Deaths: a member stops abruptly (tests/support/crash.py: its unwritten log records are lost, no checkpoint, its
  lease left to lapse) idle, mid-UOW, or inside a commit or backout at an sqm.core.failpoints point (before or after
  its COMMIT is forced, after it applied on one structure, after a BACKOUT is forced, after the CF took a put the
  log has not seen). A live peer, whichever its skew (often one that lags), recovers it; or it restarts; or the CF
  is lost first.

What they do not hold (in-process members, no network; covered elsewhere): a client leaving mid-call or a reply
lost (the outcome unknown: tests/sqm/test_service.py, the chaos suite's faulty network), a member paused that
wakes fenced, or cut from the CF while it lives (the chaos suite), two operators at once: a backup, purge or
restore racing another restore (tests/restore/test_ownership.py). A restore itself dying part way (its resume:
tests/restore/test_crash.py).

The reference model knows what must be there: each queue's available messages in get order (priority, then the
LRSN at which the put's commit counts, then put order: the order docs/log-format.md defines, with the LRSN read
from the member's decided UOW or, for work that is never logged, from the CF's answer), every open, in-doubt and
dead member's unit of work, and which structures lost a unit of work's work (its commit, or its prepare, is then
refused and the rest backed out). Checked after every step: each get returns exactly the message the model says;
the CF's available messages equal the model's (ids, bodies, priorities, persistence, backout counts, order);
the entries the CF holds uncommitted are exactly those of live units of work (nothing locked for good). At each
restore: the order of each queue on the live CF is recorded (browse) and the survivors must come back in the same
relative order; the restored CF must equal the model (no message lost, none twice, nothing resurrected), and the
UOWs restore reports in doubt must be the model's.

One thing the model cannot know and takes from the CF: whether a restore raised the backout count of a message
an in-flight UOW had got when the GET record never reached the disk (the restore backs that UOW out only if the
backup caught it holding the message). Either count is allowed once, and the model adopts the restored one; a
later restore must keep it.

The bugs the model found are kept below as the smallest deterministic histories (strict xfail while open); the
model steers around the open ones (OPEN_BUGS) so that a run finds the next. A failure prints the history (the
model's notes, one line a step) and the steps that reproduce it. CFEMU_PROPERTY_EXAMPLES sets the number of
histories, CFEMU_PROPERTY_NO_SHRINK=1 reports the first failing one as found, CFEMU_PROPERTY_UNGATED names open
bugs not to steer around. The soak (`pytest -m soak`) runs longer histories from a new seed each time.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from backup import points as backup_points
from backup import run as backup_run
from backup.protocol import STEPS as BACKUP_STEPS
from backup.run import run_backup
from cfemu import keys
from cfemu.cf import CF, Structure
from cfemu.connection import connect
from cfemu.errors import BackedOutError, InDoubtError, NoMessageError
from restore.result import RestoreResult
from restore.run import run_purge, run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.core.recovery import recover_peer
from sqm.core.uow import UnitOfWork
from sqm.log import LogReader, find_log_dirs
from tests.restore.test_restore import rejoin
from tests.support.crash import Crash, crash, failpoint_armed
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf
from tests.support.wall_clock import clock_behind

STRUCTURES = {"APP1": ("Q1", "Q2"), "APP2": ("Q3",)}
STRUCTURE, QUEUES = "APP1", STRUCTURES["APP1"]  # the single-structure histories below
ALL_QUEUES = ("Q1", "Q2", "Q3")
STRUCTURE_OF = {q: s for s, qs in STRUCTURES.items() for q in qs}
NAMES = ("QM1", "QM2", "QM3")
NOW_MS = 2**62  # browse: nothing in these histories expires
LEASE_MS = 1000
# A member's clock skew (microseconds): none, or ahead or behind by more than the lease.
SKEWS = st.one_of(st.just(0), st.integers(-4_000_000, -1_100_000), st.integers(1_100_000, 4_000_000))
# How a member dies: at once (idle or mid-UOW), or inside the completion of its open UOW at a failpoint
# (sqm.core.failpoints), or while the CF takes a put that the log has not seen.
DEATHS = ("now", "before-log-force", "after-log-force", "during-apply", "backout-after-log", "put-after-cf")
# A burst of application work in one step (so that a history holds enough work between its CF losses), mostly
# by one member (so that its units of work grow and span both structures).
WHO = st.sampled_from([0, 0, 0, 1, 2])
WORK = st.lists(st.one_of(
    st.tuples(st.just("put"), WHO, st.sampled_from(ALL_QUEUES), st.booleans(), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("get"), WHO, st.sampled_from(ALL_QUEUES), st.booleans()),
    st.tuples(st.sampled_from(["commit", "commit", "backout", "prepare"]), WHO),
    st.tuples(st.just("resolve"), st.integers(0, 20), st.booleans())), min_size=1, max_size=8)

# Bugs the model found that are still open, each reproduced by a strict-xfail test (below, or on the branch that
# fixes it). While one is open the model steers around its trigger, so that a run finds the next bug instead of
# this one again; once it is fixed, its name goes (the xfail test turns XPASS and says so).
# CFEMU_PROPERTY_UNGATED=all steers around none of them, CFEMU_PROPERTY_UNGATED=name,name around all but those.
OPEN_BUGS: set[str] = set()


@dataclass(eq=False)
class Msg:
    entry_id: str
    body: bytes
    queue: str
    priority: int
    persistent: bool
    put_seq: int  # put order: the order of the CF's put LRSNs among the puts of one commit
    o1: int = 0  # the LRSN at which its put's commit counts
    backouts: int = 0

    @property
    def structure(self) -> str:
        return STRUCTURE_OF[self.queue]

    def key(self) -> tuple[int, int, int]:
        return (-self.priority, self.o1, self.put_seq)

    def __repr__(self) -> str:
        return self.body.decode()


@dataclass(eq=False)
class Uow:
    member: int
    puts: list[Msg] = field(default_factory=list)
    gets: list[Msg] = field(default_factory=list)
    obj: UnitOfWork | None = None  # the queue manager's own UOW (where its decision counts)
    uow_id: str = ""
    # structures that lost its work there (a restore backed it out, a purge discarded it) while the application
    # did not know: its commit is refused there, so everywhere; what it holds elsewhere is backed out
    lost_on: set[str] = field(default_factory=set)
    # structures a purge emptied while it held entries there: more work there is refused, its commit goes on
    # (a purge discards messages, not outcomes)
    purged_on: set[str] = field(default_factory=set)
    lost_persistent: bool = False  # persistent work among what it lost (else its loss may be forgiven, below)

    @property
    def id(self) -> str:
        return self.obj.id if self.obj is not None else self.uow_id

    @property
    def persistent(self) -> bool:
        return any(m.persistent for m in self.puts + self.gets)

    def touches(self, structures: Iterable[str]) -> bool:
        """Did it work on any of these structures? As the queue manager counts: a get that found nothing there
        counts too (its commit then depends on that structure)."""
        done = {m.structure for m in self.puts + self.gets} | set(self.obj.structures if self.obj else ())
        return bool(done & set(structures))

    def drop(self, keep: Any) -> tuple[list[Msg], list[Msg]]:
        """Remove the puts and gets `keep` rejects; return them."""
        puts, gets = [m for m in self.puts if not keep(m)], [m for m in self.gets if not keep(m)]
        self.puts, self.gets = [m for m in self.puts if keep(m)], [m for m in self.gets if keep(m)]
        return puts, gets

    def __repr__(self) -> str:
        what = [f"put {m}" for m in self.puts] + [f"get {m}" for m in self.gets]
        lost = f" lost on {','.join(sorted(self.lost_on))}" if self.lost_on else ""
        lost += f" purged on {','.join(sorted(self.purged_on))}" if self.purged_on else ""
        return f"{self.uow_id or 'uow'}[{', '.join(what)}]{lost}"


@dataclass(eq=False)
class Member:
    name: str
    skew: int
    qm: QueueManager
    conn: Connection
    alive: bool = True
    open: Uow | None = None
    last_uow: UnitOfWork | None = None  # the latest UOW the queue manager made (a put's own UOW)
    # dead: its open UOW at death (None: none, or it already took effect), and how that one ends
    dead_work: Uow | None = None
    dead_commits: bool = False
    listed: bool = False  # dead, and still in the group's admin structure (a peer can recover it)
    prepared: str | None = None  # the UOW its connection prepared last, until the connection begins another


def purge(client: redis.Redis, backups: Path, logs: Path, structure: str = STRUCTURE) -> Any:
    """RECOVER CFSTRUCT TYPE(PURGE) of an ACTIVE structure, with the roots where the product takes them."""
    params = inspect.signature(run_purge).parameters
    extra = {k: v for k, v in (("backup_root", backups), ("log_root", logs)) if k in params}
    return run_purge(client, structure, mark_failed=True, **extra)


def on_disk(logs: Path) -> tuple[set[tuple[str, str]], set[str]]:
    """What a restore can read: (uow, entry id) of every GET record written to a log file, and the UOWs a
    RECOVERY record backed out."""
    gets: set[tuple[str, str]] = set()
    backed_out: set[str] = set()
    for d in find_log_dirs(logs):
        for _, r in LogReader(d).records():
            if r["k"] == "GET":
                gets.add((r["u"], r["i"]))
            elif r["k"] == "RECOVERY" and r["o"] == "B":
                backed_out.add(r["u"])
    return gets, backed_out


class RestoreHistory(RuleBasedStateMachine):
    """One random history. The class is made per test (make_machine) to bind the CF, a scratch root and stats."""

    redis_url: str
    root: Path
    open_bugs: ClassVar[frozenset[str]]
    examples: ClassVar[Iterator[int]]
    stats: ClassVar[Counter[str]]
    engine: ClassVar[str] = "local"  # the restore engine every restore of the history plans with

    def __init__(self) -> None:
        super().__init__()
        self.client: redis.Redis = connect(self.redis_url)
        lose_cf(self.client)
        for s, qs in STRUCTURES.items():
            define_group(self.redis_url, structure=s, queues=qs)
        run = self.root / f"example-{next(self.examples)}"
        self.logs, self.backups = run / "logs", run / "backups"
        self.cf: dict[str, Structure] = {s: CF(self.client).structure(s) for s in STRUCTURES}
        self.members: list[Member] = []
        self.seq = itertools.count(1)
        self.available: dict[str, list[Msg]] = {q: [] for q in ALL_QUEUES}
        self.in_doubt: dict[str, Uow] = {}  # prepared, work held on the CF
        # in doubt, and a structure lost its work: a purge since took a structure it only touched, or its prepare
        # was accepted though a structure had lost its non-persistent work; a commit may be refused
        self.doomed: dict[str, Uow] = {}
        self.consumed: set[str] = set()
        self.backed_up: set[str] = set()
        self.losses_since_backup = 0
        self.work_since_loss = False
        self.purged_since_backup: set[str] = set()
        self.maybe: dict[str, set[int]] = {}  # entry id -> the backout counts the last restore may have left
        self.generations: dict[str, set[int]] = {s: set() for s in STRUCTURES}  # every restore's
        self.only: dict[str, str] = {}  # queue -> the queue used instead (histories on one structure)
        self.registered: set[tuple[str, str]] = set()  # (uow, structure): in doubt there, non-persistent work only

    # --- life cycle ---------------------------------------------------------------------------------------
    @initialize(skews=st.lists(SKEWS, min_size=3, max_size=3), both=st.booleans())
    def start(self, skews: list[int], both: bool) -> None:
        """Three members, their clocks skewed; the work on both structures, or (half the histories, denser) on
        APP1 only."""
        for name, skew in zip(NAMES, skews, strict=True):
            self.members.append(self._start(name, skew))
        self.only = {} if both else {"Q3": "Q2"}
        self.say(f"members {', '.join(f'{m.name} skew {m.skew / 1e6:+.2f}s' for m in self.members)}"
                 + ("" if both else "; work on APP1 only"))

    def _start(self, name: str, skew: int, member: Member | None = None) -> Member:
        qm = start_qm(self.redis_url, self.logs, name, background=False, clock_skew_us=skew, lease_ms=LEASE_MS)
        m = member or Member(name, skew, qm, qm.connect())
        m.qm, m.conn, m.skew, m.alive, m.open, m.prepared = qm, qm.connect(), skew, True, None, None
        make = qm.new_uow

        def new_uow() -> UnitOfWork:
            m.last_uow = make()
            return m.last_uow

        qm.new_uow = new_uow  # type: ignore[method-assign]
        return m

    def teardown(self) -> None:
        for m in self.members:
            if m.alive:
                m.qm.stop(checkpoint=False)
        self.client.close()

    # --- helpers ------------------------------------------------------------------------------------------
    def say(self, line: str) -> None:
        note(line)

    def live(self, i: int) -> Member:
        alive = [m for m in self.members if m.alive]
        return alive[i % len(alive)]

    def dead(self) -> list[Member]:
        return [m for m in self.members if not m.alive]

    def uow(self, m: Member) -> Uow:
        if m.open is None:
            m.open = Uow(self.members.index(m))
        return m.open

    def make_available(self, m: Msg) -> None:
        self.available[m.queue].append(m)
        self.available[m.queue].sort(key=Msg.key)

    def apply(self, work: Uow, commit: bool, o1: int = 0) -> None:
        """A unit of work takes effect: committed at o1 (where its commit counts), or backed out."""
        if commit:
            for m in work.puts:
                m.o1 = o1
                self.make_available(m)
            for m in work.gets:
                assert m.entry_id not in self.consumed, f"{m} consumed twice"
                self.consumed.add(m.entry_id)
        else:
            for m in work.gets:
                m.backouts += 1
                self.make_available(m)
        work.puts, work.gets = [], []

    def decided_at(self, obj: UnitOfWork | None, qm: QueueManager) -> int:
        """Where a commit that just completed counts: its decision record (a UOW with persistent work), else the
        CF's answer to the commit (nothing logged: the CF stamps its own clock, which the member adopted)."""
        if obj is not None and obj.decided_lrsn:
            return obj.decided_lrsn
        return qm.clock.last

    def stamped_by_the_cf(self, obj: UnitOfWork | None, puts: list[Msg]) -> None:
        """A commit with no decision record (no persistent work): the CF stamped each structure's puts with its
        own clock at that structure's commit, which the member's clock afterwards (decided_at) does not tell
        when the UOW spans structures (it has adopted the last structure's answer): take the puts' order from the
        CF's answer."""
        if obj is not None and obj.decided_lrsn:
            return
        for q in {m.queue for m in puts}:
            o1 = {e.id: e.order[0] for e, _ in self.cf[STRUCTURE_OF[q]].browse(q, 10_000, NOW_MS)}
            for m in puts:
                if m.queue == q and m.entry_id in o1:
                    m.o1 = o1[m.entry_id]
            self.available[q].sort(key=Msg.key)

    def held(self) -> list[Uow]:
        """Units of work whose work the CF holds uncommitted."""
        out = [m.open for m in self.members if m.alive and m.open is not None]
        out += [m.dead_work for m in self.members if not m.alive and m.dead_work is not None]
        return out + list(self.in_doubt.values()) + list(self.doomed.values())

    def settle_dead(self, m: Member, how: str) -> None:
        """A dead member's open UOW ends as its log decided (a peer, its restart, or a restore finishes it)."""
        work, m.dead_work = m.dead_work, None
        if work is not None and (work.puts or work.gets):
            assert work.obj is not None
            self.say(f"  {how}: {m.name}'s {work} {'committed' if m.dead_commits else 'backed out'}")
            self.apply(work, m.dead_commits, work.obj.decided_lrsn)

    # --- application work -----------------------------------------------------------------------------------
    @rule(i=st.integers(0, 2), queue=st.sampled_from(ALL_QUEUES), persistent=st.booleans(),
          priority=st.integers(0, 2), syncpoint=st.booleans())
    def put(self, i: int, queue: str, persistent: bool, priority: int, syncpoint: bool) -> None:
        mem, queue = self.live(i), self.only.get(queue, queue)
        if syncpoint:  # its connection begins a UOW (or goes on with its open one): the prepared one is forgotten
            mem.prepared = None
        seq = next(self.seq)
        body = f"m{seq}".encode()
        what = f"{mem.name} put m{seq} {queue} p{priority} {'P' if persistent else 'NP'}" + \
               (" in its UOW" if syncpoint else "")
        if syncpoint and mem.open is not None and STRUCTURE_OF[queue] in mem.open.lost_on | mem.open.purged_on:
            with pytest.raises(BackedOutError):
                mem.conn.put(queue, body, persistent=persistent, priority=priority)
            self.say(f"{what}: refused, {STRUCTURE_OF[queue]} backed its UOW out")
            return
        try:
            msg = mem.conn.put(queue, body, persistent=persistent, priority=priority, syncpoint=syncpoint)
        except BackedOutError:
            if not (syncpoint and mem.open is not None and (mem.open.lost_on or mem.open.purged_on)):
                raise
            self.refused(mem, what, queue)  # a restore decided it: every structure may refuse it
            return
        m = Msg(msg.entry_id, body, queue, priority, persistent, put_seq=seq)
        if syncpoint:
            self.uow(mem).puts.append(m)
            self.uow(mem).obj = mem.conn.uow
        else:
            m.o1 = self.decided_at(mem.last_uow if persistent else None, mem.qm)
            self.make_available(m)
        self.work_since_loss = True
        self.say(what)

    @rule(i=st.integers(0, 2), queue=st.sampled_from(ALL_QUEUES), syncpoint=st.booleans())
    def get(self, i: int, queue: str, syncpoint: bool) -> None:
        mem, queue = self.live(i), self.only.get(queue, queue)
        if syncpoint:  # as put's
            mem.prepared = None
        what = f"{mem.name} get {queue}" + (" in its UOW" if syncpoint else "")
        if syncpoint and mem.open is not None and STRUCTURE_OF[queue] in mem.open.lost_on | mem.open.purged_on:
            with pytest.raises(BackedOutError):
                mem.conn.get(queue)
            self.say(f"{what}: refused, {STRUCTURE_OF[queue]} backed its UOW out")
            return
        expected = self.available[queue][0] if self.available[queue] else None
        try:
            got = mem.conn.get(queue, syncpoint=syncpoint)
        except NoMessageError:
            assert expected is None, f"{what}: none, the model expected {expected}"
            self.say(f"{what}: none")
            return
        except BackedOutError:
            if not (syncpoint and mem.open is not None and (mem.open.lost_on or mem.open.purged_on)):
                raise
            self.refused(mem, what, queue)  # a restore decided it: every structure may refuse it
            return
        assert expected is not None, f"{what}: got {got.body!r} from a queue the model holds empty"
        self.say(f"{what}: {got.body.decode()} (backout count {got.backout_count})")
        assert (got.body, got.entry_id) == (expected.body, expected.entry_id), \
            f"got {got.body!r}, the model expected {expected} (available: {self.available[queue]})"
        assert got.backout_count == expected.backouts, f"{expected}: backout count"
        self.available[queue].pop(0)
        if syncpoint:
            self.uow(mem).gets.append(expected)
            self.uow(mem).obj = mem.conn.uow
        else:
            self.apply(Uow(self.members.index(mem), gets=[expected]), commit=True)
        self.work_since_loss = True

    def committed(self, work: Uow) -> None:
        if len({m.structure for m in work.puts + work.gets}) > 1:
            type(self).stats["UOWs committed on two structures"] += 1

    def refused(self, mem: Member, what: str, queue: str) -> None:
        assert mem.open is not None
        mem.open.lost_on.add(STRUCTURE_OF[queue])
        self.say(f"{what}: refused, its UOW was backed out by recovery")

    def still_in_doubt(self, mem: Member) -> bool:
        """The UOW the member's connection prepared last is still in doubt: a commit or backout of the application
        with nothing open is refused (its coordinator resolves it)."""
        return mem.prepared is not None and (mem.prepared in self.in_doubt or mem.prepared in self.doomed)

    def refused_in_doubt(self, mem: Member, asked: str) -> None:
        with pytest.raises(InDoubtError):
            getattr(mem.conn, asked)()
        self.say(f"{mem.name} {asked}: refused, {mem.prepared} is in doubt")
        type(self).stats["commits or backouts refused after a prepare"] += 1

    @rule(i=st.integers(0, 2))
    def commit(self, i: int) -> None:
        mem = self.live(i)
        if mem.open is None and self.still_in_doubt(mem):
            self.refused_in_doubt(mem, "commit")
            return
        work, mem.open = mem.open, None
        obj = mem.conn.uow
        if work is not None and work.lost_on:
            with pytest.raises(BackedOutError):
                mem.conn.commit()
            self.say(f"{mem.name} commit {work}: refused, backed out")
            self.apply(work, False)
            return
        mem.conn.commit()
        if work is not None:
            self.say(f"{mem.name} commit {work}")
            self.committed(work)
            puts = list(work.puts)
            self.apply(work, True, self.decided_at(obj, mem.qm))
            self.stamped_by_the_cf(obj, puts)
            self.work_since_loss = True

    @rule(i=st.integers(0, 2))
    def backout(self, i: int) -> None:
        mem = self.live(i)
        if mem.open is None and self.still_in_doubt(mem):
            self.refused_in_doubt(mem, "backout")
            return
        work, mem.open = mem.open, None
        mem.conn.backout()
        if work is not None:
            self.say(f"{mem.name} backout {work}")
            self.apply(work, False)
            self.work_since_loss = True

    def preparable(self) -> list[Member]:
        return [m for m in self.members if m.alive and m.open is not None]

    @precondition(lambda self: bool(self.preparable()))
    @rule(i=st.integers(0, 2))
    def prepare(self, i: int) -> None:
        cands = self.preparable()
        mem = cands[i % len(cands)]
        work, mem.open = mem.open, None
        assert work is not None
        what = f"{mem.name} prepare {work}"
        self.work_since_loss = True
        # After its PREPARE is forced the member asks each structure of the UOW how it stands: one that lost the
        # UOW's work (a restore backed it out, a purge took a structure it only touched: lost_on) answers backed
        # out or lost, and the prepare votes no (BackedOutError, the UOW backed out with a record). A structure
        # that stands ACTIVE with the UOW's work, or a purge's 'P' tombstone (its outcome goes on), votes yes.
        try:
            work.uow_id = mem.conn.prepare(f"xid-{next(self.seq)}")
        except BackedOutError as e:
            assert work.lost_on, f"{what}: refused, though every structure holds its work ({e})"
            self.say(f"{what}: refused (a no vote), backed out")
            type(self).stats["prepares refused (a no vote)"] += 1
            self.apply(work, False)
            return
        # A yes vote the coordinator's commit could not honour: its persistent work is gone from a structure.
        assert not work.lost_persistent, f"{what}: accepted, though {sorted(work.lost_on)} lost its persistent work"
        (self.doomed if work.lost_on else self.in_doubt)[work.uow_id] = work
        mem.prepared = work.uow_id
        self.say(what)

    def resolvable(self) -> list[str]:
        return sorted(u for u, w in {**self.in_doubt, **self.doomed}.items() if self.members[w.member].alive)

    @precondition(lambda self: bool(self.resolvable()))
    @rule(i=st.integers(0, 20), commit=st.booleans())
    def resolve(self, i: int, commit: bool) -> None:
        cands = self.resolvable()
        uow_id = cands[i % len(cands)]
        work = self.in_doubt.pop(uow_id, None) or self.doomed.pop(uow_id)
        mem = self.members[work.member]
        what = f"{mem.name} resolve {work} {'commit' if commit else 'backout'}"
        self.work_since_loss = True
        obj = mem.qm.uows[uow_id]
        if work.lost_on and commit:
            try:
                mem.qm.resolve(uow_id, commit)
            except BackedOutError:
                self.say(f"{what}: refused, backed out")
                self.apply(work, False)
                return
            # Accepted: a restore since carried it in doubt where its work was lost. Right when that work was only
            # non-persistent (losing it does not back the UOW out), or when nothing is left to commit.
            assert not work.lost_persistent or not (work.puts or work.gets), \
                f"{what}: accepted, though {sorted(work.lost_on)} lost its persistent work"
            self.say(f"{what}: accepted")
            self.committed(work)
            puts = list(work.puts)
            self.apply(work, True, self.decided_at(obj, mem.qm))
            self.stamped_by_the_cf(obj, puts)
            return
        mem.qm.resolve(uow_id, commit)
        self.say(what)
        if commit:
            self.committed(work)
        puts = list(work.puts)
        self.apply(work, commit, self.decided_at(obj, mem.qm))
        if commit:
            self.stamped_by_the_cf(obj, puts)

    @precondition(lambda self: any(m.alive for m in self.members))
    @rule(i=st.integers(0, 2))
    def checkpoint(self, i: int) -> None:
        """A live member's checkpoint: a relog pass on every ACTIVE structure (RELOG copies of its entries, those
        held by open and in-doubt UOWs too; docs/log-management.md). Nothing the model sees changes; a later
        restore may fold the copies (a backup's replay reaching back past the pass, or a base of the logs alone).
        B12's shape (CHAOS-RESULTS.md): an in-doubt UOW carried across a restore, relogged, decided, then a backup
        whose replay reaches back past the pass, and a loss."""
        mem = self.live(i)
        mem.qm.checkpoint("test")
        type(self).stats["relog passes"] += 1
        self.say(f"{mem.name} checkpoint (relog pass)")

    @rule(i=st.integers(0, 2), queue=st.sampled_from(STRUCTURES["APP1"]),
          persistent=st.lists(st.booleans(), min_size=2, max_size=2), priority=st.integers(0, 2),
          end=st.sampled_from(["commit", "commit", "prepare", "open"]))
    def span(self, i: int, queue: str, persistent: list[bool], priority: int, end: str) -> None:
        """A member's unit of work on both structures (on APP1 alone in the histories that work there only): a
        put on each, then committed, prepared, or left open to the steps that follow. The work rule's bursts make
        such units of work too, but too seldom for a run to count on them."""
        mem = self.live(i)
        self.put(i, queue, persistent[0], priority, True)
        self.put(i, "Q3", persistent[1], priority, True)
        if end == "commit":
            self.commit(i)
        elif end == "prepare" and mem.open is not None:
            self.prepare(self.preparable().index(mem))

    @rule(ops=WORK)
    def work(self, ops: list[tuple[Any, ...]]) -> None:
        for op, *args in ops:
            if op == "prepare" and not self.preparable() or op == "resolve" and not self.resolvable():
                continue
            getattr(self, op)(*args)

    # --- backup, restores, purge ------------------------------------------------------------------------------
    @rule(structure=st.sampled_from(sorted(STRUCTURES)),
          during=st.one_of(st.none(), st.tuples(st.integers(1, len(BACKUP_STEPS)), WORK)),
          clock_back=st.booleans())
    def backup(self, structure: str, during: tuple[int, list[tuple[Any, ...]]] | None, clock_back: bool) -> None:
        """A fuzzy backup, while the group works or not: `during` is a burst of work done just before one of its
        copy steps (a get backed out then carries its data in the BACKOUT record: the patent's exception);
        `clock_back`: taken on a wall clock behind (NTP stepped it back, or another host's), so that its id names it
        older than the backups before it (the CF's LRSN orders them)."""

        def on_step(number: int, state: str) -> None:
            if during is not None and number == during[0]:
                self.say(f"  (backup {structure} before its step {number}, {state}:)")
                type(self).stats["backups with work between their steps"] += 1
                self.work(during[1])

        self.say(f"backup {structure}" + (" (on a clock stepped back)" if clock_back else ""))
        with clock_behind(backup_run) if clock_back else contextlib.nullcontext():
            run_backup(self.client, structure, self.backups, log_root=self.logs, on_step=on_step)
        self.backed_up.add(structure)
        self.losses_since_backup = 0
        self.purged_since_backup.discard(structure)

    # Steering that depends on time (LRSNs) is done inside a rule, never in a precondition: hypothesis needs the
    # same draws to enable the same rules.
    def restorable(self, structures: Iterable[str]) -> bool:
        return all(s in self.backed_up for s in structures)

    def prepare_restore(self, structures: list[str], forced: list[bool]) -> tuple[dict[str, list[str]], Any] | None:
        """Before the restore of `structures`: force the drawn members' logs; steer (OPEN_BUGS); record the live
        order of their queues and what the logs hold. None: steered away."""
        for m, force in zip(self.members, forced, strict=True):
            if m.alive and force:
                assert m.qm.log is not None
                m.qm.log.force()
        live = {q: [e.id for e, _ in self.cf[STRUCTURE_OF[q]].browse(q, 10_000, NOW_MS)]
                for s in structures for q in STRUCTURES[s]}
        names = [m.name for m, f in zip(self.members, forced, strict=True) if f and m.alive]
        self.say(f"logs forced: {', '.join(names) or 'none'}")
        return live, on_disk(self.logs)

    def restored(self, lost: set[str], results: list[RestoreResult], live: dict[str, list[str]],
                 disk: Any) -> None:
        """The model after a restore of `lost` (the CF lost, or one structure failed); then the checks."""
        for r in results:
            # the restore's LRSN (its clock, floor and generation) lies above its backup's replay start, so that a
            # later restore from that backup replays what happens now; and it is a new generation, so that a UOW
            # from before is known as lost
            assert r.restore_lrsn > r.replay_from, f"{r.structure}: restored at {r.restore_lrsn}, its backup " \
                f"replays from {r.replay_from}"
            assert r.restore_lrsn not in self.generations[r.structure], \
                f"{r.structure}: restored at {r.restore_lrsn} again"
            self.generations[r.structure].add(r.restore_lrsn)
        self.lose(lost, purged=False, disk=disk)
        self.registered |= {(u, s) for u, w in self.in_doubt.items() for s in lost
                            if w.touches([s]) and not any(m.structure == s for m in w.puts + w.gets)}
        self.check_cf(pin=self.maybe)
        self.say(f"  restored: {', '.join(f'{q} {self.available[q]}' for q in ALL_QUEUES)}")
        # the live order survives: the messages available before and after come back in the same relative order
        for q, before in live.items():
            after = [e.id for e, _ in self.cf[STRUCTURE_OF[q]].browse(q, 10_000, NOW_MS)]
            both = set(before) & set(after)
            assert [x for x in after if x in both] == [x for x in before if x in both], \
                f"{q}: get order after the restore differs from the live CF's"
        reported = {u for r in results for u in r.in_doubt_uows}
        must = {u for u, w in self.in_doubt.items()
                if w.obj is not None and set(w.obj.structures) & (lost - w.purged_on)}
        assert must <= reported <= set(self.in_doubt) | set(self.doomed), \
            f"restore reports in doubt {sorted(reported)}, the model {sorted(must)} (at most {sorted(self.in_doubt)})"

    def lose(self, lost: set[str], *, purged: bool, disk: Any = (set(), set())) -> None:
        """What the structures in `lost` keep through a restore (persistent messages, in-doubt work) or a purge
        (nothing), and what becomes of the work of every unit of work on them."""
        seen, backed_out = disk
        self.maybe = {}

        def on(m: Msg) -> bool:
            return m.structure in lost

        def give_back(work: Uow, gets: list[Msg]) -> None:
            """A restore backs out the gets of a UOW it saw; one it did not see may have (when the backup caught
            the UOW holding the message): the model takes the count from the CF."""
            for msg in gets:
                if purged or not msg.persistent:
                    continue
                if (work.id, msg.entry_id) in seen:
                    msg.backouts += 1
                else:
                    self.maybe[msg.entry_id] = {msg.backouts, msg.backouts + 1}
                self.make_available(msg)

        for q in ALL_QUEUES:
            if STRUCTURE_OF[q] in lost:
                self.available[q] = [] if purged else [m for m in self.available[q] if m.persistent]
        for m in self.members:
            work = m.open if m.alive else m.dead_work
            if work is None:
                continue
            if m.alive and purged:
                self.purge_work(work, lost, uow_id="")
                continue
            if m.alive:
                # A structure a purge took its work from is not lost again: the purge's 'P' tombstone is part of
                # the structure's state, which its restore point, every backup since and so every restore bring
                # back (cfemu.bulk.purged_tombstones, backup.run), so its commit stays a no-op there and goes on:
                # such a UOW commits after a purge and a CF loss, it is not MQRC_BACKED_OUT.
                gone = {s for s in lost if work.touches([s]) and s not in work.purged_on}
                if gone:
                    work.lost_on |= gone
                    puts, gets = work.drop(lambda x: not on(x))
                    work.lost_persistent |= purged or any(x.persistent for x in puts + gets)
                    give_back(work, gets)
                continue
            if purged:  # what it held there is gone; the rest ends as its log decided
                work.drop(lambda x: not on(x))
                continue
            work.drop(lambda x: not on(x) or x.persistent)  # its non-persistent work there went with it
            puts, gets = work.drop(lambda x: not on(x))
            if m.dead_commits:  # the restore completes its COMMIT there
                assert work.obj is not None
                self.apply(Uow(work.member, puts, gets), True, work.obj.decided_lrsn)
            else:
                give_back(work, gets)
        for uow_id, work in list(self.in_doubt.items()) + list(self.doomed.items()):
            if purged and work.touches(lost):
                self.purge_work(work, lost, uow_id)
                if work.lost_on:
                    self.doomed[uow_id] = work
                    self.in_doubt.pop(uow_id, None)
            elif not purged:
                work.drop(lambda x: not on(x) or x.persistent)
                if uow_id in self.doomed and uow_id in backed_out:  # the restore reads its backout: it holds
                    self.apply(Uow(work.member, *work.drop(lambda x: not on(x))), False)  # nothing there now

    def purge_work(self, work: Uow, lost: set[str], uow_id: str) -> None:
        """A purge of `lost` and a unit of work: where the CF held it (entries, or an in-doubt registration), a
        'P' tombstone: more work there is refused, its outcome goes on; where it only touched the structure (a get
        that found nothing), the purge lost it: its commit is refused."""
        for s in sorted(lost):
            if not work.touches([s]) or s in work.purged_on:
                continue  # a purge before left its 'P' tombstone, and a purge keeps the tombstones it finds
            if any(x.structure == s for x in work.puts + work.gets) or (uow_id, s) in self.registered:
                work.purged_on.add(s)
            else:
                work.lost_on.add(s)
                work.lost_persistent = True
        work.drop(lambda x: x.structure not in lost)

    @precondition(lambda self: self.restorable(STRUCTURES))
    @rule(forced=st.lists(st.booleans(), min_size=3, max_size=3), order=st.permutations(sorted(STRUCTURES)),
          relog=st.booleans())
    def lose_cf_and_restore(self, forced: list[bool], order: list[str], relog: bool) -> None:
        """The CF is lost and each structure restored from its latest backup and every member's log, as each
        member's log stands (forced first, or not: a member's buffered records are invisible to this restore).
        relog: a member's checkpoint follows at once, a relog pass while the UOWs the restore carried in doubt
        hold their entries in the new generation (B12's first half; the checkpoint rule alone seldom came
        between a restore and the resolution of what it carried)."""
        before = self.prepare_restore(order, forced)
        if before is None:
            return
        self.say("CF lost")
        stats = type(self).stats
        stats["CF losses"] += 1
        if self.losses_since_backup:
            stats["CF losses again before a new backup"] += 1
            if self.work_since_loss:
                stats["... with live work on the restored structures"] += 1
        if self.purged_since_backup:
            stats["restores after a purge"] += 1
        lose_cf(self.client)
        results = [run_restore(self.client, s, backup_root=self.backups, log_root=self.logs, engine=self.engine)
                   for s in order]
        self.losses_since_backup += 1
        self.work_since_loss = False
        for m in self.members:
            if m.alive:
                rejoin(m.qm)
            else:
                m.listed = False  # the group's admin structure went with the CF: only its restart recovers it
        self.restored(set(STRUCTURES), results, *before)
        if relog:
            self.checkpoint(0)

    @precondition(lambda self: bool(self.backed_up))
    @rule(structure=st.sampled_from(sorted(STRUCTURES)), forced=st.lists(st.booleans(), min_size=3, max_size=3),
          now=st.booleans())
    def fail_structure(self, structure: str, forced: list[bool], now: bool) -> None:
        """One structure fails and is restored (RECOVER CFSTRUCT); the other lives on, and so does the group."""
        if not now or not self.restorable([structure]):
            return  # half as often as a step of each other kind
        before = self.prepare_restore([structure], forced)
        if before is None:
            return
        self.say(f"{structure} fails")
        type(self).stats["structure failures"] += 1
        if structure in self.purged_since_backup:
            type(self).stats["restores after a purge"] += 1
        result = run_restore(self.client, structure, backup_root=self.backups, log_root=self.logs,
                             mark_failed=True, engine=self.engine)
        self.restored({structure}, [result], *before)

    @precondition(lambda self: bool(self.backed_up - self.purged_since_backup))
    @rule(structure=st.sampled_from(sorted(STRUCTURES)), now=st.integers(0, 7),
          fails=st.one_of(st.none(), st.lists(st.booleans(), min_size=3, max_size=3)), clock_back=st.booleans())
    def purge(self, structure: str, now: int, fails: list[bool] | None, clock_back: bool) -> None:
        """A purge; `fails`: the structure fails at once and is restored from the purge's point (the members'
        logs forced as drawn), else whatever follows; `clock_back`: its point named on a wall clock behind, older
        by its id than the backup before it (a restore that ordered by ids crossed it: the purged work came back)."""
        if now or structure not in self.backed_up or structure in self.purged_since_backup:
            return  # a purge is rare: it empties the structure
        with clock_behind(backup_points) if clock_back else contextlib.nullcontext():
            purge(self.client, self.backups, self.logs, structure)
        self.say(f"purge {structure}" + (" (on a clock stepped back)" if clock_back else ""))
        type(self).stats["purges"] += 1
        self.purged_since_backup.add(structure)
        self.lose({structure}, purged=True)
        if fails is not None:
            self.fail_structure(structure, fails, now=True)

    # --- deaths, peer recovery, restart -------------------------------------------------------------------
    @precondition(lambda self: sum(m.alive for m in self.members) >= 2)
    @rule(i=st.integers(0, 2), how=st.sampled_from(DEATHS + ("after-log-force",)), queue=st.sampled_from(ALL_QUEUES),
          now=st.booleans(), by=st.sampled_from([None, None, 0, 1, 2]))
    def die(self, i: int, how: str, queue: str, now: bool, by: int | None) -> None:
        """A member dies; `by`: a live peer (drawn) recovers it at once, else whatever follows (another peer
        later, its restart, a CF loss first)."""
        if not now:
            return  # half as often as a step of each other kind
        mem, queue = self.live(i), self.only.get(queue, queue)
        if how in ("before-log-force", "after-log-force", "during-apply", "backout-after-log") and (
                mem.open is None or not (mem.open.persistent or mem.open.lost_on)):
            self.put(i, queue, persistent=True, priority=0, syncpoint=True)  # work for the failpoint to decide
        if how == "after-log-force" and not self.only and mem.open is not None and not (
                mem.open.lost_on or mem.open.purged_on):
            # a forced COMMIT that spans both structures: what its owner's restart completes again after a peer
            # recovered it and a structure was restored since (each structure must answer that it stands)
            for s, queues in STRUCTURES.items():
                if not mem.open.touches([s]):
                    self.put(i, queues[0], persistent=True, priority=0, syncpoint=True)
        if mem.open is not None and mem.open.lost_on and (
                how in ("after-log-force", "during-apply", "put-after-cf") or mem.conn.uow is None
                or not mem.conn.uow.persistent):
            how = "now"  # a UOW a structure backed out: it dies in flight (nothing logged reaches those points)
        if how == "put-after-cf" and mem.open is not None and STRUCTURE_OF[queue] in mem.open.purged_on:
            how = "now"  # its put there is refused before the CF takes it: a purge took its work there
        work = mem.open
        mem.dead_commits = False
        if how == "now":
            pass
        elif how == "put-after-cf":
            seq = next(self.seq)
            with failpoint_armed(how), pytest.raises(Crash):
                mem.conn.put(queue, f"m{seq}".encode())
            # the CF holds the put (UP, its entry id unknown to the model: the depth check counts it)
            work = self.uow(mem)
            work.obj = mem.conn.uow
            work.puts.append(Msg("?", f"m{seq}".encode(), queue, 0, True, seq))
        else:
            assert work is not None
            commit = how != "backout-after-log"
            with failpoint_armed(how), pytest.raises(Crash):
                if commit:
                    mem.conn.commit()
                else:
                    mem.conn.backout()
            mem.dead_commits = commit and how != "before-log-force"
            if how == "during-apply":  # applied on the CF, on the structures it reached, before it died
                assert work.obj is not None
                done = work.drop(lambda x: x.structure not in work.obj.applied)  # type: ignore[union-attr]
                self.apply(Uow(work.member, *done), True, work.obj.decided_lrsn)
        crash(mem.qm)
        mem.alive, mem.listed, mem.open = False, True, None
        mem.dead_work = work if work is not None and (work.puts or work.gets) else None
        self.say(f"{mem.name} dies ({how}) holding {mem.dead_work}"
                 + (" decided: commit" if mem.dead_commits and mem.dead_work else ""))
        type(self).stats[f"deaths {how}"] += 1
        if by is not None:
            self.peer_recovery(self.recoverable().index(mem), by)

    def recoverable(self) -> list[Member]:
        return [m for m in self.members if not m.alive and m.listed]

    @precondition(lambda self: bool(self.recoverable()))
    @rule(i=st.integers(0, 2), by=st.integers(0, 2), forced=st.booleans())
    def peer_recovery(self, i: int, by: int, forced: bool = False) -> None:
        """A live peer recovers a dead member; `forced`: the peer's log, its RECOVERY and END records, then reaches
        the disk (as its next forced work takes them there), before whatever follows (a CF loss, the dead
        member's restart)."""
        cands = self.recoverable()
        dead, peer = cands[i % len(cands)], self.live(by)
        peer.qm.redis.delete(keys.lease(dead.name))  # its lease has lapsed
        rep = recover_peer(peer.qm, dead.name)
        if forced:
            assert peer.qm.log is not None
            peer.qm.log.force()
            type(self).stats["... the peer's log forced after it"] += 1
        self.say(f"{peer.name} (skew {peer.skew / 1e6:+.2f}s) recovers {dead.name}: {rep.committed} committed, "
                 f"{rep.backed_out} backed out, {rep.in_doubt} in doubt")
        stats = type(self).stats
        stats["peer recoveries"] += 1
        if peer.skew < dead.skew:
            stats["... by a peer whose clock lags"] += 1
        if dead.dead_commits and dead.dead_work is not None:
            stats["... completing a forced COMMIT"] += 1
        dead.listed = False
        owned = [u for u, w in {**self.in_doubt, **self.doomed}.items() if self.members[w.member] is dead]
        assert rep.in_doubt == len(owned), f"{dead.name} holds {owned} in doubt"
        self.settle_dead(dead, "peer recovery")

    @precondition(lambda self: bool(self.dead()))
    @rule(i=st.integers(0, 2), skew=SKEWS)
    def restart(self, i: int, skew: int) -> None:
        dead = self.dead()[i % len(self.dead())]
        self._start(dead.name, skew, dead)
        self.say(f"{dead.name} restarts (skew {skew / 1e6:+.2f}s)")
        type(self).stats["restarts"] += 1
        dead.listed = False
        self.settle_dead(dead, "restart")
        owned = {u for u, w in {**self.in_doubt, **self.doomed}.items() if self.members[w.member] is dead}
        assert {u.id for u in dead.qm.indoubt()} == owned

    # --- invariants ---------------------------------------------------------------------------------------
    def check_cf(self, pin: dict[str, set[int]] | None = None) -> None:
        """The CF's available messages are the model's, in order; `pin`: entry ids whose backout count the model
        takes from the CF when it is one of those given."""
        for q in ALL_QUEUES:
            cf = [(e.id, d, e.priority, e.persistent, e.backout_count)
                  for e, d in self.cf[STRUCTURE_OF[q]].browse(q, 10_000, NOW_MS)]
            model = self.available[q]
            assert [c[:4] for c in cf] == [(m.entry_id, m.body, m.priority, m.persistent) for m in model], \
                f"{q}: CF {[c[1].decode() for c in cf]} model {model}"
            for c, m in zip(cf, model, strict=True):
                if pin and c[4] in pin.get(m.entry_id, ()):
                    m.backouts = c[4]
            assert [c[4] for c in cf] == [m.backouts for m in model], \
                f"{q}: backout counts: CF {[(c[1].decode(), c[4]) for c in cf]} model " \
                f"{[(m, m.backouts) for m in model]}"

    @invariant()
    def cf_is_the_model(self) -> None:
        """The CF's available messages are the model's, in order, and its uncommitted entries are those of the
        model's live units of work: nothing is locked for good."""
        if not self.members:
            return
        self.check_cf()
        want = {q: {"UP": 0, "UG": 0} for q in ALL_QUEUES}
        for work in self.held():
            for m in work.puts:
                want[m.queue]["UP"] += 1
            for m in work.gets:
                want[m.queue]["UG"] += 1
        have = {}
        for s in STRUCTURES:
            for q, d in self.cf[s].depths().items():
                have[q] = {"UP": d["UP"], "UG": d["UG"]}
        assert have == want, f"uncommitted entries on the CF {have}, the model's live units of work {want}"


def make_machine(redis_url: str, root: Path, engine: str = "local") -> type[RestoreHistory]:
    ungated = {n.strip() for n in os.environ.get("CFEMU_PROPERTY_UNGATED", "").split(",") if n.strip()}
    assert ungated <= OPEN_BUGS | {"all"}, f"CFEMU_PROPERTY_UNGATED: no such open bug {ungated - OPEN_BUGS}"
    open_bugs = frozenset() if "all" in ungated else frozenset(OPEN_BUGS - ungated)
    return type("BoundRestoreHistory", (RestoreHistory,), {
        "redis_url": redis_url, "root": root, "open_bugs": open_bugs, "examples": itertools.count(),
        "stats": Counter(), "engine": engine})


def run(machine: type[RestoreHistory], examples: int, steps: int, derandomize: bool) -> None:
    # No explain phase: its line tracing slows a failing run tenfold, and the history says more.
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if not os.environ.get("CFEMU_PROPERTY_NO_SHRINK"):
        phases.append(Phase.shrink)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, derandomize=derandomize, database=None, deadline=None,
        suppress_health_check=list(HealthCheck), print_blob=True, phases=phases))
    print("; ".join(f"{k}: {v}" for k, v in sorted(machine.stats.items())))


@pytest.mark.deep  # the default suite runs the columnar engine's (below)
@pytest.mark.timeout(900)  # a failure shrinks for up to 5 minutes (hypothesis's own bound) before it is reported
def test_random_histories_with_cf_losses_deaths_and_skewed_clocks(redis_url: str, tmp_path: Path) -> None:
    machine = make_machine(redis_url, tmp_path)
    run(machine, int(os.environ.get("CFEMU_PROPERTY_EXAMPLES", "200")), 50, derandomize=True)
    s = machine.stats  # the histories do reach what they are for (each bound half or less of what this run gives)
    assert s["CF losses"] >= 50 and s["CF losses again before a new backup"] >= 20, s
    assert s["... with live work on the restored structures"] >= 5, s
    assert s["structure failures"] >= 20 and s["UOWs committed on two structures"] >= 8, s
    assert s["peer recoveries"] >= 15 and s["... by a peer whose clock lags"] >= 7, s
    assert s["... completing a forced COMMIT"] >= 2, s
    assert s["purges"] >= 10 and s["restores after a purge"] >= 3, s
    assert s["prepares refused (a no vote)"] >= 5 and s["commits or backouts refused after a prepare"] >= 50, s


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_histories_restored_by_the_columnar_engine(redis_url: str, tmp_path: Path) -> None:
    """The same histories, every restore planned by the columnar engine (restore.engine_columnar): the CF it
    leaves is the model's, as the local engine's is. Fewer of them: the local engine's test runs the long list,
    the deep twin below 40 of these."""
    machine = make_machine(redis_url, tmp_path, engine="columnar")
    run(machine, int(os.environ.get("CFEMU_PROPERTY_EXAMPLES", "16")), 50, derandomize=True)
    s = machine.stats  # each bound below what these 16 gave in two runs (5-18, 3-22, 5-23)
    assert s["CF losses"] >= 3 and s["structure failures"] >= 2 and s["peer recoveries"] >= 3, s


@pytest.mark.deep  # the default suite runs 16 of these histories (above)
@pytest.mark.timeout(900)
def test_more_random_histories_restored_by_the_columnar_engine(redis_url: str, tmp_path: Path) -> None:
    machine = make_machine(redis_url, tmp_path, engine="columnar")
    run(machine, int(os.environ.get("CFEMU_PROPERTY_EXAMPLES", "40")), 50, derandomize=True)
    s = machine.stats
    assert s["CF losses"] >= 10 and s["structure failures"] >= 4 and s["peer recoveries"] >= 3, s


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_soak_random_histories(redis_url: str, tmp_path: Path) -> None:
    """Many more, longer histories, a new random seed each run (hypothesis prints the seed of a failure:
    `pytest --hypothesis-seed=N` runs it again)."""
    run(make_machine(redis_url, tmp_path), int(os.environ.get("CFEMU_PROPERTY_EXAMPLES", "400")), 60,
        derandomize=False)


# --- what the model found: each bug as the smallest deterministic history --------------------------------------

AHEAD_US = 30_000_000  # a member whose clock runs 30 s ahead: far more than any test takes


def _one_member_ahead(redis_url: str, logs: Path) -> tuple[QueueManager, QueueManager]:
    """QM1, its clock AHEAD_US ahead of the wall clock, and QM2 on it: both started in this process."""
    return (start_qm(redis_url, logs, "QM1", background=False, clock_skew_us=AHEAD_US),
            start_qm(redis_url, logs, "QM2", background=False))


def test_work_after_a_restore_is_replayed_by_the_next_restore_from_the_same_backup(
        redis_url: str, tmp_path: Path) -> None:
    """QM1's clock runs ahead and moves the CF's clock ahead of the wall clock (a non-persistent put, nothing
    logged); a backup replays from there. The CF is lost and restored. QM2 consumes m1 (GET and COMMIT logged).
    The CF is lost again before a new backup, and the operator restores from the same backup: QM2's records must
    be replayed, and m1 stay consumed. (No record read was as high as the backup's replay start, so the restored
    clock used to be the wall clock, below it: QM2's records lay below the second replay, and m1 came back,
    consumed twice. Now a restore's LRSN lies above every LRSN its base records: restore.plan.base_lrsn.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm1, qm2 = _one_member_ahead(redis_url, logs)
    try:
        qm2.connect().put("Q1", b"m1", syncpoint=False)
        qm1.connect().put("Q2", b"np", persistent=False, syncpoint=False)  # the CF's clock jumps 30 s ahead
        backup_id = run_backup(client, STRUCTURE, backups, log_root=logs)["id"]
        for again in (False, True):
            lose_cf(client)
            run_restore(client, STRUCTURE, backup_root=backups, log_root=logs, backup_id=backup_id)
            for qm in (qm1, qm2):
                rejoin(qm)
            if not again:
                assert qm2.connect().get("Q1", syncpoint=False).body == b"m1"  # consumed, logged, forced
        with pytest.raises(NoMessageError):
            qm2.connect().get("Q1", syncpoint=False)
    finally:
        qm1.stop()
        qm2.stop()


@pytest.mark.parametrize("named", [False, True])  # the latest backup, or the fuzzy one named again
def test_a_uow_open_across_two_restores_from_one_backup_cannot_commit_what_they_lost(
        redis_url: str, tmp_path: Path, named: bool) -> None:
    """QM1's clock runs ahead: m0 commits at an LRSN ahead of the wall clock, and QM1's later work moves the CF's
    clock further ahead; a backup replays from there. The CF is lost and restored: its generation is m0's LRSN + 1.
    QM2 puts m1 in a UOW; the CF is lost again and restored, from the latest backup or (named) the same one again:
    the second restore must start a new generation, so that QM2's UOW, whose put it could not see, is known as
    lost and its commit refused. (Nothing new was read, so the generation used to be the same: QM2's commit
    succeeded, COMMIT forced, with m1 nowhere; the restore point, below its base's LRSNs, even sorted before it.
    Now a restore's LRSN lies above its base's and every earlier generation: restore.plan.base_lrsn,
    restore.run.history_lrsn.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm1, qm2 = _one_member_ahead(redis_url, logs)
    try:
        qm1.connect().put("Q1", b"m0", syncpoint=False)
        time.sleep(0.05)
        qm1.connect().put("Q2", b"np", persistent=False, syncpoint=False)  # the CF's clock moves on, unlogged
        backup_id = run_backup(client, STRUCTURE, backups, log_root=logs)["id"]
        conn = qm2.connect()
        gens = []
        for again in (False, True):
            lose_cf(client)
            gens.append(run_restore(client, STRUCTURE, backup_root=backups, log_root=logs,
                                    backup_id=backup_id if named else None).restore_lrsn)
            for qm in (qm1, qm2):
                rejoin(qm)
            if not again:
                conn.put("Q1", b"m1")
        try:
            conn.commit()
        except BackedOutError:
            pass  # right: the loss took m1
        else:
            bodies = sorted(m.body for m in qm1.connect().browse("Q1"))
            assert bodies == [b"m0", b"m1"], f"QM2's commit succeeded, the CF holds {bodies} (generations {gens})"
    finally:
        qm1.stop()
        qm2.stop()


@pytest.mark.parametrize("forgot", ["restored", "purged"])
def test_peer_recovery_recovers_every_uow_of_a_member_whose_structure_forgot_one(
        redis_url: str, tmp_path: Path, forgot: str) -> None:
    """QM2 commits U1, a put of m1 (its END appended, not forced). The structure forgets U1: restored after a CF
    loss from a backup taken since (U1 lies before its replay), or purged. QM2's U2 gets m2, and QM2 dies (U1's END
    is lost). QM1's peer recovery must finish U1 (nothing to do there) and back U2 out: m2 available again. (It
    used to commit U1 again, the CF answered 'lost with the CF', recover_peer raised BackedOutError before U2, and
    m2 stayed locked for as long as QM2 stayed down. Now the restore, or the purge, leaves U1 a tombstone: its
    commit is in the base, or its work there discarded; and a refusal no longer stops a peer recovery:
    test_peer_recovery_goes_on_past_a_commit_a_restore_backed_out.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm1, qm2 = _two_members(redis_url, logs, lease_ms=LEASE_MS)
    try:
        qm2.connect().put("Q1", b"m1", syncpoint=False)  # U1
        run_backup(client, STRUCTURE, backups, log_root=logs)
        if forgot == "restored":
            lose_cf(client)
            run_restore(client, STRUCTURE, backup_root=backups, log_root=logs)
            for qm in (qm1, qm2):
                rejoin(qm)
        else:
            purge(client, backups, logs)
        qm1.connect().put("Q2", b"m2", syncpoint=False)
        assert qm2.connect().get("Q2").body == b"m2"  # U2, in flight
        crash(qm2)
        qm1.redis.delete(keys.lease("QM2"))  # its lease has lapsed
        recover_peer(qm1, "QM2")
        assert [(m.body, m.backout_count) for m in qm1.connect().browse("Q2")] == [(b"m2", 1)]
        assert not any(d["UP"] or d["UG"] for d in qm1.structure(STRUCTURE).depths().values())
    finally:
        qm1.stop()
        qm2.stop(checkpoint=False)


def _two_members(redis_url: str, logs: Path, **options: Any) -> tuple[QueueManager, QueueManager]:
    """QM1 and QM2 started in this process on the group's CF, with the same start_qm options."""
    return (start_qm(redis_url, logs, "QM1", background=False, **options),
            start_qm(redis_url, logs, "QM2", background=False, **options))


def _two_structures_and_two_members(redis_url: str, logs: Path, **options: Any
                                    ) -> tuple[redis.Redis, QueueManager, QueueManager]:
    """APP1 (Q1) and APP2 (Q3) defined, QM1 and QM2 started (_two_members): the CF's client and the members."""
    client = define_group(redis_url, queues=("Q1",))
    define_group(redis_url, structure="APP2", queues=("Q3",))
    return (client, *_two_members(redis_url, logs, **options))


def _commit_across_structures_between_backups_then_crash(client: Any, qm1: QueueManager, logs: Path,
                                                         backups: Path) -> None:
    """APP1 is backed up; QM1 commits a UOW that puts a on APP1 (Q1) and b on APP2 (Q3); APP2 is backed up; QM1
    dies (its END appended, not forced, is lost)."""
    run_backup(client, "APP1", backups, log_root=logs)
    conn = qm1.connect()
    conn.put("Q1", b"a")
    conn.put("Q3", b"b")
    conn.commit()
    run_backup(client, "APP2", backups, log_root=logs)
    crash(qm1)


def _restart_without_backing_out(redis_url: str, logs: Path) -> QueueManager:
    """QM1 restarts, and its log decides no UOW BACKOUT (its committed UOW stays committed)."""
    qm1 = start_qm(redis_url, logs, "QM1", background=False)
    decided = [r["k"] for _, r in LogReader(logs / "QM1").records() if r["k"] in ("COMMIT", "BACKOUT")]
    assert "BACKOUT" not in decided, f"QM1's log decides its committed UOW {decided}"
    return qm1


def test_a_member_restarts_after_a_structure_forgot_its_commit_and_the_next_restore_keeps_it(
        redis_url: str, tmp_path: Path) -> None:
    """APP1 is backed up; QM1 commits a UOW that puts a on APP1 and b on APP2 (its END appended, not forced);
    APP2 is backed up; QM1 dies (the END is lost) and the CF is lost. APP1's restore replays the COMMIT (a UOW in
    commit: a tombstone), APP2's starts after it. QM1's restart commits the UOW again: both structures must
    answer that the commit stands, and QM1's log must not back it out. (APP2 used to refuse as 'lost with the
    CF'; the restart logged BACKOUT and backed out on APP1, which refused as committed by recovery: the restart
    failed, every time. The BACKOUT after the COMMIT is what loses a committed message in a later restore:
    test_a_commit_a_structure_restored_since_forgot_is_not_backed_out_by_its_owner. Now APP2's restore leaves the
    UOW a 'C' tombstone: restore.run.committed_before_base.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, qm1, qm2 = _two_structures_and_two_members(redis_url, logs)
    try:
        _commit_across_structures_between_backups_then_crash(client, qm1, logs, backups)
        lose_cf(client)
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs)
        rejoin(qm2)
        qm1 = _restart_without_backing_out(redis_url, logs)
        assert [m.body for m in qm2.connect().browse("Q1")] == [b"a"]
        assert [m.body for m in qm2.connect().browse("Q3")] == [b"b"]
        run_restore(client, "APP1", backup_root=backups, log_root=logs, mark_failed=True)
        assert [m.body for m in qm2.connect().browse("Q1")] == [b"a"], "a committed message was lost"
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


@pytest.mark.parametrize("engine", ["local", "columnar", "partitioned"])
def test_a_commit_a_peer_completed_and_ended_stays_committed_through_a_cf_loss_and_its_owners_restart(
        redis_url: str, tmp_path: Path, engine: str) -> None:
    """QM1 dies right after forcing the COMMIT of a UOW that put a on APP1 and b on APP2; QM2 recovers it (commits
    it on both, logs RECOVERY and END) and its log reaches the disk; the CF is lost and both structures restored
    from the logs. QM1's restart completes its COMMIT again: both structures must answer that it stands, and its
    log must not back it out; a later restore keeps a and b. (The restore took QM2's END as the end of the UOW and
    left no 'C' tombstone: APP2 answered 'lost with the CF', QM1 logged BACKOUT after its COMMIT and failed on
    APP1 as committed by recovery, every restart; a restore after that BACKOUT loses a and b. The chaos suite's
    seed 15 with peer-clock-skew met it as a member that would not restart: CHAOS-RESULTS.md, R1.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, qm1, qm2 = _two_structures_and_two_members(redis_url, logs, lease_ms=LEASE_MS)
    engines: dict[str, dict[str, Any]] = {
        "local": {"engine": "local"}, "columnar": {"engine": "columnar"},
        "partitioned": {"engine": "local", "engine_options": {"partitions": 7, "workers": 2}}}
    options = engines[engine]
    try:
        conn = qm1.connect()
        conn.put("Q1", b"a")
        conn.put("Q3", b"b")
        with failpoint_armed("after-log-force"), pytest.raises(Crash):
            conn.commit()
        crash(qm1)
        qm2.redis.delete(keys.lease("QM1"))  # its lease has lapsed
        report = recover_peer(qm2, "QM1")
        assert report is not None and report.committed == 1 and qm2.log is not None
        qm2.log.force()  # the peer's END reaches the disk (by its next forced work, in a running group)
        lose_cf(client)
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs, **options)
        rejoin(qm2)
        qm1 = _restart_without_backing_out(redis_url, logs)
        assert [m.body for m in qm2.connect().browse("Q1")] == [b"a"]
        assert [m.body for m in qm2.connect().browse("Q3")] == [b"b"]
        assert qm1.log is not None
        qm1.log.force()
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs, mark_failed=True, **options)
        assert [m.body for m in qm2.connect().browse("Q1")] == [b"a"], "a committed message was lost"
        assert [m.body for m in qm2.connect().browse("Q3")] == [b"b"], "a committed message was lost"
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


@pytest.mark.parametrize("base", ["backup", "point"])
def test_an_in_doubt_uow_stays_committable_across_two_restores_of_a_structure_it_held_only_non_persistent_work_on(
        redis_url: str, tmp_path: Path, base: str) -> None:
    """QM1 prepares a UOW that put x (persistent) on APP2 and y (non-persistent) on APP1. The CF is lost; both
    structures are restored (the UOW in doubt on both: on APP1 registered with no entries). APP1 fails and is
    restored again, from a backup taken since or from the restore point: the UOW must still be in doubt there, and
    the coordinator's commit go through (x committed). (Neither base kept the registration: the fuzzy backup read
    the UOW's PREPARE, but the generation rule left it out, of an older generation and naming no entry in the base;
    the point did not even read it. The UOW was no longer in doubt on APP1, the commit was refused as 'lost with
    the CF', and x was backed out. Now both bases list the UOWs they hold ("uows"), the generation rule keeps their
    records, and a point's replay starts at their first LRSN.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    define_group(redis_url, structure="APP2", queues=("Q3",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q3", b"x")
        conn.put("Q1", b"y", persistent=False)
        uow = conn.prepare("xid-1")
        for s in ("APP1", "APP2"):
            run_backup(client, s, backups, log_root=logs)
        lose_cf(client)
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs)
        rejoin(qm)
        if base == "backup":
            run_backup(client, "APP1", backups, log_root=logs)
        result = run_restore(client, "APP1", backup_root=backups, log_root=logs, mark_failed=True)
        assert result.base_kind == ("fuzzy" if base == "backup" else "restore")
        assert result.in_doubt_uows == {uow: "QM1"}
        qm.resolve(uow, True)
        assert [m.body for m in qm.connect().browse("Q3")] == [b"x"]
    finally:
        qm.stop()


@pytest.mark.parametrize("recoverer", ["restart", "peer"])
def test_a_backout_count_raised_by_recovery_survives_a_restore(redis_url: str, tmp_path: Path,
                                                               recoverer: str) -> None:
    """Backout counts only (nothing is lost or consumed twice). QM2 gets m1 in a UOW and dies before the GET record
    reaches the disk. Its restart (or QM1's peer recovery) backs the UOW out: m1 is available with backout count
    1. APP1 fails and is restored from the backup taken before: m1 comes back with count 0."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm1, qm2 = _two_members(redis_url, logs, lease_ms=LEASE_MS)
    try:
        qm1.connect().put("Q1", b"m1", syncpoint=False)
        run_backup(client, STRUCTURE, backups, log_root=logs)
        assert qm2.connect().get("Q1").body == b"m1"
        crash(qm2)
        if recoverer == "restart":
            qm2 = start_qm(redis_url, logs, "QM2", background=False, lease_ms=LEASE_MS)
        else:
            qm1.redis.delete(keys.lease("QM2"))  # its lease has lapsed
            recover_peer(qm1, "QM2")
        assert [(m.body, m.backout_count) for m in qm1.connect().browse("Q1")] == [(b"m1", 1)]
        run_restore(client, STRUCTURE, backup_root=backups, log_root=logs, mark_failed=True)
        assert [(m.body, m.backout_count) for m in qm1.connect().browse("Q1")] == [(b"m1", 1)]
    finally:
        qm1.stop()
        qm2.stop(checkpoint=False)


def test_a_commit_a_structure_restored_since_forgot_is_not_backed_out_by_its_owner(
        redis_url: str, tmp_path: Path) -> None:
    """Bug (d) as a committed message lost. APP1 is backed up; QM1 commits a UOW that puts a on APP1 and b on APP2
    (its END appended, not forced); APP2 is backed up and QM1 dies (the END is lost). APP2 alone fails and is
    restored from that backup, which holds b committed: the UOW lies before its replay. QM1 restarts and retries
    the commit: APP2 must not answer 'lost with the CF' (it would make QM1 log BACKOUT after its COMMIT); then the
    CF is lost, and APP1's restore from its backup replays the UOW: a, whose put was committed, must come back."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, qm1, qm2 = _two_structures_and_two_members(redis_url, logs)
    try:
        _commit_across_structures_between_backups_then_crash(client, qm1, logs, backups)
        run_restore(client, "APP2", backup_root=backups, log_root=logs, mark_failed=True)
        qm1 = _restart_without_backing_out(redis_url, logs)
        lose_cf(client)
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs)
        for qm in (qm1, qm2):
            rejoin(qm)
        assert [m.body for m in qm2.connect().browse("Q1")] == [b"a"], "a committed message was lost"
        assert [m.body for m in qm2.connect().browse("Q3")] == [b"b"]
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


def test_peer_recovery_goes_on_past_a_commit_a_restore_backed_out(redis_url: str, tmp_path: Path) -> None:
    """QM2's U1 puts m1 (its PUT forced); APP1 fails and is restored: U1 was in flight, the restore backs it out.
    QM2's U2 gets m2, and QM2 dies just after forcing U1's COMMIT. QM1's peer recovery commits U1, which APP1
    refuses as backed out by recovery (right: U1 is backed out); it must still back U2 out (m2 available again,
    its backout count raised) and finish, instead of stopping there with m2 locked while QM2 stays down."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm1, qm2 = _two_members(redis_url, logs, lease_ms=LEASE_MS)
    try:
        qm1.connect().put("Q2", b"m2", syncpoint=False)
        run_backup(client, STRUCTURE, backups, log_root=logs)
        u1, u2 = qm2.connect(), qm2.connect()
        u1.put("Q1", b"m1")
        assert qm2.log is not None
        qm2.log.force()
        result = run_restore(client, STRUCTURE, backup_root=backups, log_root=logs, mark_failed=True)
        assert result.counts["uows in flight backed out"] == 1
        assert u2.get("Q2").body == b"m2"
        with failpoint_armed("after-log-force"), pytest.raises(Crash):
            u1.commit()
        crash(qm2)
        qm1.redis.delete(keys.lease("QM2"))  # its lease has lapsed
        rep = recover_peer(qm1, "QM2")
        assert (rep.committed, rep.backed_out) == (0, 2)
        assert [(m.body, m.backout_count) for m in qm1.connect().browse("Q2")] == [(b"m2", 1)]
        assert [m.body for m in qm1.connect().browse("Q1")] == []
        assert not any(d["UP"] or d["UG"] for d in qm1.structure(STRUCTURE).depths().values())
    finally:
        qm1.stop()
        qm2.stop(checkpoint=False)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_uow_whose_work_a_purge_took_commits_as_a_no_op_after_a_later_cf_loss(
        redis_url: str, tmp_path: Path, persistent: bool) -> None:
    """What the model relies on (lose: a structure in purged_on is not lost again). QM1's UOW gets m; APP1 is
    purged (m discarded, the UOW left a 'P' tombstone); the CF is lost and APP1 restored from the purge's point,
    which carries the tombstone: the commit is still a no-op there, accepted, and m stays gone. (The model used
    to expect MQRC_BACKED_OUT, the first failure of its checkpoint rule; either answer loses nothing, and the
    tombstone is the structure's own state, which a restore rebuilds.)"""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=QUEUES)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        run_backup(client, STRUCTURE, backups, log_root=logs)
        qm.connect().put("Q2", b"m", persistent=persistent, syncpoint=False)
        conn = qm.connect()
        assert conn.get("Q2").body == b"m"
        assert conn.uow is not None
        uow = conn.uow.id
        purge(client, backups, logs)
        assert qm.log is not None
        qm.log.force()
        lose_cf(client)
        result = run_restore(client, STRUCTURE, backup_root=backups, log_root=logs)
        rejoin(qm)
        assert result.base_kind == "purge"
        assert client.hget(keys.tomb(STRUCTURE), uow) == b"P"
        conn.commit()
        assert qm.connect().browse("Q2") == []
    finally:
        qm.stop()
