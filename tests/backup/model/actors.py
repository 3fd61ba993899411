"""The world of the model check: a real CF (the real Lua scripts on a real redis-server), group members whose logs
are in-memory record lists, the backup actor, and the checks that lose the CF and restore it.

Members write the records sqm/core/manager.py writes (built with sqm.core.records' constructors), in its order:
  * a put or get inside a UOW runs on the CF, then is logged with the LRSN the script returned (one step: nothing
    but a CF loss can observe the log, and the CF is lost only at step boundaries); a persistent put outside
    syncpoint is a UOW of its own (put, then commit);
  * COMMIT / BACKOUT are logged (forced) BEFORE the CF operation, as a step of their own, so that any other step
    can fall between the record and the CF update (the stall);
  * refusals: FloorError (the record is below a recovery floor set meanwhile) -> observe the floor, write a fresh
    record with a higher LRSN, retry; BackupActiveError on a backout -> write a fresh BACKOUT record carrying the
    data of the gets ("dd", from Structure.uow_entries), retry with has_data. Each record and each CF attempt is a
    step of its own.
  * like QueueManager.complete, a BACKOUT record carries the data when a backup is running as it is written, and
    the first CF attempt still passes has_data=False (sqm/core/manager.py _apply_one starts that way).
  * the fused operations: a persistent put outside syncpoint in one CF call (put_committed: its PUT and COMMIT
    records first, one forced write and a step of its own, then the CF call; refused below the floor, it is
    logged backed out and made again as a new UOW whose records lie above it); a get whose commit the next
    get_committed carries (the get and its GET record one step, its COMMIT record a step of its own, the commit
    applied by a later get_committed or, refused there or with no get after it, by the CF commit as for any UOW).

Mutations (for proving that the checker can fail): `Mutation.no_backout_data` disables the patent's exception
(no data in BACKOUT records; the CF backout is told has_data=True, so it never refuses); `Mutation.steps` lets the
backup run a different list of steps (e.g. without step 1).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import redis

from backup.protocol import STEPS, StepCount, copy_step_raw
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.cf import CF, Caller, CarriedCommit, Structure
from cfemu.entry import Entry
from cfemu.errors import BackupActiveError, FloorError
from restore.plan import Copy, RestorePlan
from restore.reference import plan_local
from restore.settle import HELD_INDOUBT, RESTORED, fifo_key
from sqm.core import records
from sqm.core.clock import LrsnClock
from sqm.core.records import Record

STRUCTURE = "APP1"
QUEUE = "Q1"  # the queue every scenario's persistent messages use
NP_QUEUE = "Q2"  # holds a non-persistent message that must never come back
T_START = 1_000_000  # model time (ms) for gets and browses until the expiry actor runs
T_EXPIRY = 2_000_000  # expiry time of a message that expires
T_LATE = 3_000_000  # model time once the expiry actor has run
BACKUP_ID = "APP1-model"

Steps = Generator[str, None, Any]


@dataclass
class Mutation:
    steps: Sequence[tuple[str, str]] = STEPS
    no_backout_data: bool = False


@dataclass
class Uow:
    id: str
    structures: dict[str, int] = field(default_factory=dict)
    persistent: bool = False
    decided_lrsn: int = 0


@dataclass
class BackupState:
    started: bool = False
    ended: bool = False
    floor: int = 0
    start: int = 0
    copies: list[Copy] = field(default_factory=list)
    counts: list[StepCount] = field(default_factory=list)


class Group:
    """The group every run starts from: a flushed CF with the structure and its queues defined and the members
    joined (through cfemu.admin.Admin), kept as a dump of every key so that each run restores it in one round
    trip instead of redefining it."""

    def __init__(self, client: redis.Redis, members: Sequence[tuple[str, int]]) -> None:
        client.flushall()
        admin = Admin(client)
        admin.define_structure(STRUCTURE)
        admin.define_queue(QUEUE, STRUCTURE)
        admin.define_queue(NP_QUEUE, STRUCTURE)
        self.client = client
        self.cf = CF(client)
        self.members = [(name, skew, admin.join(name, {}, 600_000)) for name, skew in members]
        self.dump: dict[bytes | str, bytes] = {}
        for k in client.keys("*"):
            payload = client.dump(k)
            assert payload is not None
            self.dump[k] = payload

    def reset(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.flushall()
        for k, v in self.dump.items():
            pipe.restore(k, 0, v)
        pipe.execute()


class World:
    """One run of a scenario, from the group's initial state."""

    def __init__(self, group: Group, mutation: Mutation) -> None:
        group.reset()
        self.client = group.client
        self.structure: Structure = group.cf.structure(STRUCTURE)
        self.mutation = mutation
        self.now_ms = T_START
        self.backup = BackupState()
        self.members = {name: Member(self, name, skew, epoch) for name, skew, epoch in group.members}
        self.relog_pass: tuple[str, dict[str, Any]] | None = None  # the last complete relog pass (model.relogging)

    def records(self, min_lrsn: int = 0) -> list[Record]:
        """The merged log of every member (as sqm.log.merged_records gives it: tagged with "m", by (l, m, position))."""
        keyed = [(r["l"], m.name, pos, {**r, "m": m.name})
                 for m in self.members.values() for pos, r in enumerate(m.log) if r["l"] >= min_lrsn]
        keyed.sort(key=lambda t: t[:3])
        return [t[3] for t in keyed]


def run_to_end(steps: Steps) -> Any:
    """Run an actor's steps without interleaving (a scenario's setup)."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


class Member:
    """A member of the group, reduced to what the protocol needs: a caller (epoch, LRSN clock) and a log."""

    def __init__(self, world: World, name: str, skew_us: int, epoch: int) -> None:
        self.world = world
        self.name = name
        self.clock = LrsnClock(skew_us)
        self.caller = Caller(name, epoch, self.clock)
        self.log: list[Record] = []
        self._seq = 0

    @property
    def s(self) -> Structure:
        return self.world.structure

    def new_uow(self) -> Uow:
        self._seq += 1
        return Uow(f"{self.name}.{self.caller.epoch:x}.{self._seq}")

    def entry(self, entry_id: str, *, persistent: bool = True, priority: int = 0, expiry: int = 0,
              queue: str = QUEUE) -> Entry:
        return Entry(id=entry_id, queue=queue, priority=priority, persistent=persistent, msgid=entry_id.encode().hex(),
                     expiry=expiry, put_time=T_START)

    # --- puts and gets inside a UOW: CF first, then the log -------------------------------------------------
    def put(self, uow: Uow, entry: Entry, body: bytes) -> Steps:
        yield f"put {entry.id} in {uow.id}"
        cf, gen, _ = self.s.put(self.caller, entry, body, uow=uow.id, gen=uow.structures.get(STRUCTURE, 0))
        uow.structures[STRUCTURE] = gen
        if entry.persistent:
            uow.persistent = True
            self.log.append(records.put(uow.id, cf, structure=STRUCTURE, gen=gen, entry=entry.wire(), data=body))

    def get(self, uow: Uow, queue: str = QUEUE) -> Steps:
        yield f"get in {uow.id}"
        got = self.s.get(self.caller, queue, uow=uow.id, gen=uow.structures.get(STRUCTURE, 0),
                         now_ms=self.world.now_ms)
        gen, entry = got.gen, got.entry
        uow.structures[STRUCTURE] = gen
        if entry is not None and entry.persistent:
            uow.persistent = True
            self.log.append(records.get(uow.id, entry.lrsn, structure=STRUCTURE, gen=gen, entry_id=entry.id,
                                        queue=queue))
        return entry.id if entry is not None else None

    def put_nonpersistent(self, entry: Entry, body: bytes) -> Steps:
        """A non-persistent put outside syncpoint: on the CF only, never logged."""
        yield f"put {entry.id} (non-persistent)"
        self.s.put(self.caller, entry, body)

    def put_committed(self, entry: Entry, body: bytes) -> Steps:
        """A persistent put outside syncpoint in one CF operation (put_committed.lua): its PUT record and forced
        COMMIT first, then the CF call. Refused below the floor of a backup begun meanwhile, the UOW is logged backed
        out (a COMMIT followed by a BACKOUT is a commit the CF refused) and the put made again as a new UOW and entry,
        its records above the floor. Returns the id of the entry put."""
        gen = int(self.s.info()["gen"])  # a member knows the generation from its earlier CF replies
        while True:
            uow = self.new_uow()
            yield f"log PUT+COMMIT {entry.id} in {uow.id}"
            put_lrsn = self.clock.now()
            self.log.append(records.put(uow.id, put_lrsn, structure=STRUCTURE, gen=gen, entry=entry.wire(),
                                        data=body))
            lrsn = self.clock.now()
            self.log.append(records.commit(uow.id, lrsn, {STRUCTURE: gen}))
            yield f"CF put_committed {entry.id} in {uow.id}"
            try:
                self.s.put_committed(self.caller, entry, body, uow=uow.id, gen=gen, put_lrsn=put_lrsn, lrsn=lrsn)
            except FloorError as e:
                self.clock.observe(e.floor)
                yield f"relog BACKOUT {uow.id} (put_committed below the floor)"
                self.log.append(records.backout(uow.id, self.clock.now(), {STRUCTURE: gen}))
                entry = replace(entry, id=entry.id + "+")
                continue
            self.log.append(records.end(uow.id, self.clock.now()))
            return entry.id

    def get_committed(self, uow: Uow, carried: Sequence[Uow] = ()) -> Steps:
        """A get that carries the commits of earlier gets (get_committed.lua), CF first, then its GET record; the
        END of each commit applied. Returns the UOWs whose commit it did not apply (the CF commit finishes them)."""
        yield f"get_committed in {uow.id} carrying {[u.id for u in carried]}"
        reply = self.s.get_committed(
            self.caller, QUEUE, uow=uow.id, gen=uow.structures.get(STRUCTURE, 0), now_ms=self.world.now_ms,
            commits=[CarriedCommit(u.id, u.structures[STRUCTURE], u.decided_lrsn) for u in carried])
        left = []
        for u, refusal in zip(carried, reply.commits, strict=True):
            if refusal is None:
                self.log.append(records.end(u.id, self.clock.now()))
            else:
                left.append(u)
        assert reply.got is not None, reply.error
        gen, got = reply.got.gen, reply.got.entry
        uow.structures[STRUCTURE] = gen
        if got is not None and got.persistent:
            uow.persistent = True
            self.log.append(records.get(uow.id, got.lrsn, structure=STRUCTURE, gen=gen, entry_id=got.id,
                                        queue=QUEUE))
        return left

    def put_outside_syncpoint(self, entry: Entry, body: bytes) -> Steps:
        """A persistent put outside syncpoint is a UOW of its own (sqm/core/manager.py): the put, then its commit."""
        uow = self.new_uow()
        yield from self.put(uow, entry, body)
        yield from self.commit(uow)

    # --- log-first work: COMMIT and BACKOUT ---------------------------------------------------------------------
    def commit(self, uow: Uow) -> Steps:
        return self._complete(uow, True)

    def backout(self, uow: Uow) -> Steps:
        return self._complete(uow, False)

    def _complete(self, uow: Uow, commit: bool) -> Steps:
        yield from self.decide(uow, commit)
        yield from self.apply(uow, commit)

    def decide(self, uow: Uow, commit: bool) -> Steps:
        """The forced COMMIT or BACKOUT record, a step of its own."""
        yield f"log {'COMMIT' if commit else 'BACKOUT'} {uow.id}"
        if uow.persistent:
            self._log_outcome(uow, commit, with_data=not commit and self._backup_running())

    def apply(self, uow: Uow, commit: bool) -> Steps:
        """The decided outcome on the CF, each attempt a step of its own, then END."""
        what = "COMMIT" if commit else "BACKOUT"
        lrsn = uow.decided_lrsn if uow.persistent else 0
        has_data = self.world.mutation.no_backout_data
        while True:
            yield f"CF {what.lower()} {uow.id}"
            try:
                if commit:
                    self.s.commit(self.caller, uow.id, gen=uow.structures[STRUCTURE], lrsn=lrsn)
                else:
                    self.s.backout(self.caller, uow.id, gen=uow.structures[STRUCTURE], lrsn=lrsn, has_data=has_data)
            except FloorError as e:
                self.clock.observe(e.floor)
                yield f"relog {what} {uow.id} (floor)"
                lrsn = self._log_outcome(uow, commit)
                continue
            except BackupActiveError:
                yield f"relog {what} {uow.id} with data (backup active)"
                lrsn = self._log_outcome(uow, commit, with_data=True)
                has_data = True
                continue
            if uow.persistent:
                self.log.append(records.end(uow.id, self.clock.now()))
            return

    def _log_outcome(self, uow: Uow, commit: bool, with_data: bool = False) -> int:
        lrsn = self.clock.now()  # before the CF is asked for the gets' data, as sqm/core/manager.py does
        if commit:
            rec = records.commit(uow.id, lrsn, uow.structures)
        else:
            dd = self._gets_data(uow) if with_data and not self.world.mutation.no_backout_data else []
            rec = records.backout(uow.id, lrsn, uow.structures, data=dd)
        self.log.append(rec)
        uow.decided_lrsn = lrsn
        return lrsn

    def _backup_running(self) -> bool:
        return bool(self.world.client.hexists(keys.meta(STRUCTURE), "backup"))

    def _gets_data(self, uow: Uow) -> list[list[Any]]:
        return [[STRUCTURE, e.wire(), d] for e, d in self.s.uow_entries(uow.id)
                if e.state == "UG" and e.persistent and e.uow == uow.id]

    # --- the expiry task ------------------------------------------------------------------------------------
    def expire(self, now_ms: int) -> Steps:
        yield f"expire at {now_ms}"
        self.world.now_ms = now_ms
        ids, _ = self.s.expire(now_ms)
        if ids:
            self.log.append(records.expire(self.clock.now(), structure=STRUCTURE, ids=ids))


class _TakenSnapshot:
    """Hands copy_step_raw a snapshot taken in an earlier step, so that the fetch is a step of its own."""

    def __init__(self, structure: Structure, ids: list[str]) -> None:
        self.cf, self.name = structure.cf, structure.name  # what the fetch reads through
        self._ids = ids

    def snapshot(self, state: str) -> list[str]:
        return self._ids

    def snapshot_raw(self, state: str) -> list[bytes]:
        return [i.encode() for i in self._ids]


def backup_actor(world: World) -> Steps:
    """backup.protocol's steps: begin (sets the floor), then per step an atomic snapshot of the ids and, as a
    separate step, the fetch of their current copies; then end. A step whose snapshot is empty fetches nothing
    and so has no fetch step."""
    clock = LrsnClock()
    s = world.structure
    b = world.backup
    yield "backup begin"
    b.start, b.floor, _ = s.backup_begin(BACKUP_ID, clock.now())
    clock.observe(b.start)
    b.started = True
    for number, (state, _) in enumerate(world.mutation.steps, start=1):
        yield f"backup step {number} {state} snapshot"
        ids = s.snapshot(state)
        count = StepCount(snapshot=0)
        b.counts.append(count)
        if ids:
            yield f"backup step {number} {state} fetch"
        taken = cast(Structure, _TakenSnapshot(s, ids))
        # The backup's own path (backup.run): the CF's descriptor bytes, selected by select_raw (the reference of
        # the selection in C that backup.run's write_part takes: tests/backup/test_frames_native.py).
        b.copies.extend((STRUCTURE, bulk.unpack_wire(raw), d) for copies in copy_step_raw(taken, state, count)
                        for raw, d in copies)
    yield "backup end"
    s.backup_end(BACKUP_ID, clock.now(), ok=True)
    b.ended = True


# --- the checks: lose the CF, restore, compare -----------------------------------------------------------------
Row = tuple[str, str, bytes, int]  # (id, queue, data, backout count)


class Violation(AssertionError):
    pass


def restored_rows(plan: RestorePlan) -> dict[str, list[Row]]:
    """The restored structure per queue, in get order (priority, then FIFO)."""
    held = [s.id for s in plan.settled if s.disposition == HELD_INDOUBT]
    if held:
        raise Violation(f"restore holds {held} in doubt, but no UOW was prepared")
    out: dict[str, list[Row]] = {}
    for s in sorted((s for s in plan.settled if s.disposition == RESTORED), key=lambda s: fifo_key(s.entry or {})):
        assert s.entry is not None
        out.setdefault(s.entry["q"], []).append((s.id, s.entry["q"], s.data, int(s.entry.get("bc", 0))))
    return out


def cf_truth(world: World) -> dict[str, list[Row]]:
    """The CF's committed persistent messages per queue, in get order, at model time now."""
    out: dict[str, list[Row]] = {}
    for q in (QUEUE, NP_QUEUE):
        rows = [(e.id, e.queue, d, e.backout_count) for e, d in world.structure.browse(q, 1000, world.now_ms)
                if e.persistent]
        if rows:
            out[q] = rows
    return out


def expected_after_loss(world: World) -> dict[str, Row]:
    """What restore must rebuild if the CF is lost now (any moment after the backup ended), read off the CF and
    the logs: committed messages stay; an uncommitted put stays iff its UOW's COMMIT is logged (in-commit work
    is completed); an uncommitted get is consumed iff its UOW's COMMIT is logged, else it is backed out (its
    backout count rises)."""
    decided: dict[str, str] = {}  # UOW -> its owner's last decision (a COMMIT then a BACKOUT: a refused commit)
    for m in world.members.values():
        for r in m.log:
            if r["k"] in ("COMMIT", "BACKOUT"):
                decided[r["u"]] = r["k"]
    committed = {u for u, k in decided.items() if k == "COMMIT"}
    pipe = world.client.pipeline(transaction=False)
    pipe.hgetall(keys.entries(STRUCTURE))
    pipe.hgetall(keys.data(STRUCTURE))
    raw_descs, raw_datas = pipe.execute()
    descs = {keys.text(k): Entry.unpack(v) for k, v in raw_descs.items()}
    datas = {keys.text(k): v for k, v in raw_datas.items()}
    out: dict[str, Row] = {}
    for eid, e in descs.items():
        if not e.persistent or e.expired(world.now_ms):
            continue
        row = (eid, e.queue, datas[eid], e.backout_count)
        if (e.state == "CP" or (e.state == "UP" and e.uow in committed)):
            out[eid] = row
        elif e.state == "UG" and e.uow not in committed:
            out[eid] = (eid, e.queue, datas[eid], e.backout_count + 1)
    # A put committed in one operation whose CF call has not run yet: its logged PUT is redone from the log (it
    # cannot have been got: it never was in the CF) when its records lie at or above the backup's floor. Below it,
    # the CF refuses the call (FLOOR, or after a restore the older generation its records name) and the member
    # logs it backed out: no reply told the application it was put.
    got = {r["i"] for m in world.members.values() for r in m.log if r["k"] == "GET"}
    for m in world.members.values():
        for r in m.log:
            if r["k"] != "PUT":
                continue
            put_id = str(r["e"]["id"])
            if (put_id not in descs and put_id not in got and r["u"] in committed and r["l"] >= world.backup.floor
                    and not 0 < int(r["e"].get("exp", 0)) <= world.now_ms):
                out[put_id] = (put_id, r["e"]["q"], r["d"], int(r["e"].get("bc", 0)))
    return out


def check_after_loss(world: World) -> None:
    """Lose the CF now (the backup has ended): the restore from the backup plus the logs from its floor must
    rebuild exactly the expected messages."""
    b = world.backup
    plan = plan_local(STRUCTURE, b.copies, world.records(b.floor), now_ms=world.now_ms)
    got = {row[0]: row for rows in restored_rows(plan).values() for row in rows}
    want = expected_after_loss(world)
    compare(want, got)


def check_complete(world: World) -> None:
    """At the end of a schedule: the restore equals the CF's committed state (ids, queues, data, backout counts,
    get order); the same with the replay started at LRSN 0; and the fold is idempotent (twice on the same input,
    and again over its own result as the backup: the redo rule skips what the copies already reflect)."""
    b = world.backup
    truth = cf_truth(world)
    plan = plan_local(STRUCTURE, b.copies, world.records(b.floor), now_ms=world.now_ms)
    restored = restored_rows(plan)
    compare_ordered(truth, restored, "replay from the floor")
    compare_ordered(truth, restored_rows(plan_local(STRUCTURE, b.copies, world.records(0), now_ms=world.now_ms)),
                    "replay from LRSN 0")
    compare_ordered(restored, restored_rows(plan_local(STRUCTURE, b.copies, world.records(b.floor),
                                                       now_ms=world.now_ms)), "second run of the fold")
    again = [(s.structure, dict(s.entry), s.data) for s in plan.loaded() if s.entry is not None]
    compare_ordered(restored, restored_rows(plan_local(STRUCTURE, again, world.records(b.floor),
                                                       now_ms=world.now_ms)), "fold over its own result")


def compare(want: dict[str, Row], got: dict[str, Row]) -> None:
    lost = sorted(set(want) - set(got))
    resurrected = sorted(set(got) - set(want))
    wrong = sorted(i for i in set(want) & set(got) if want[i] != got[i])
    if lost or resurrected or wrong:
        raise Violation(f"lost {lost}, resurrected {resurrected}, "
                        f"changed {[(want[i], got[i]) for i in wrong]}")


def compare_ordered(want: dict[str, list[Row]], got: dict[str, list[Row]], how: str) -> None:
    ids = [r[0] for rows in got.values() for r in rows]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise Violation(f"{how}: duplicated {dups}")
    try:
        compare({r[0]: r for rows in want.values() for r in rows}, {r[0]: r for rows in got.values() for r in rows})
    except Violation as v:
        raise Violation(f"{how}: {v}") from None
    if want != got:
        raise Violation(f"{how}: get order differs: CF {want} restored {got}")


Scenario = Callable[[World], list[tuple[str, Steps]]]
