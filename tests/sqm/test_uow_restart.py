"""Seed 003's restart Tables 1 and 2 on real processes, and the UOW lifetime's pseudo-clock across downtime.

Every row of the tables is one UOW of one group run per scenario: the members are child processes
(tests/support/uow_member.py) driving conversations in-process, killed with SIGKILL. The scenarios:

  restart        the member that holds the UOW is killed and started again: the receiver's member (it holds the
                 DELIVERED ones), then the sender's (it holds the RECEIVED ones and is the home of every UOW);
                 their leases are long, so no peer steps in: the restart settles them
  peer-recovery  both killed and not restarted: a live peer recovers them when their leases lapse
  cf-restore     the redis-server killed and started empty, the structure restored by restore.run from a fuzzy
                 backup (taken half way through the rows, members at work) plus the members' logs

After each: the status through QUERY (on a live member), the control record's lifetime, and the UOW's messages:
a restored UOW (ACCEPTED) is received whole and in order, any other has no message left on the CF.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.uow_attributes import UWSTATP_NONE, control_queue, data_queue
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.uowstatus import (
    ACCEPTED,
    BACKEDOUT,
    CANCELLED,
    DELIVERED,
    DISCARDED,
    POSTPONED,
    PROCESSED,
    RECEIVED,
    TIMEOUT,
    Control,
    after_restart,
    status_letter_hex,
)
from tests.support.restart_table import RESTART_TABLE_1
from tests.support.uow_member import UowMember, start_members

S, SVC = "APP1", "SVC"
N = 3  # messages per UOW
PSTAT = 200  # UWSTATP of the rows with a persistent status: kept 200 lifetimes
LONG_LEASE_MS = 60_000  # no peer steps in while a member restarts
SHORT_LEASE_MS = 1000
# The observer is never killed and no row waits for its lease: one that outlasts the stalls of a loaded machine, so
# that its peers never fence it while it reads the statuses.
OBSERVER_LEASE_MS = 5000
SETTLE_S = 20.0


@dataclass(frozen=True)
class Row:
    before: str
    persistent: bool  # persistent UOW (its messages)
    pstatus: bool  # persistent status
    after: str | None  # None: no trace kept ("---")

    @property
    def id(self) -> str:
        return f"{self.before}-{'P' if self.persistent else 'np'}-{'PS' if self.pstatus else 'nps'}"

    def bodies(self) -> list[bytes]:
        return [f"{self.id}-{i}".encode() for i in range(N)]


TABLE_1 = [Row(*r) for r in RESTART_TABLE_1]  # Seed 003, Restart Table 1 (tests.support.restart_table)
# Restart Table 2: only the persistent status exists, and it stays. DISCARDED is only ever a non-persistent UOW's.
TABLE_2 = [Row(s, p, True, s) for s in (CANCELLED, BACKEDOUT, TIMEOUT) for p in (True, False)] + [
    Row(DISCARDED, False, True, DISCARDED)]
ROWS = TABLE_1 + TABLE_2
SCENARIOS = ("restart", "peer-recovery", "cf-restore")


@dataclass
class Observed:
    uow: str
    before: str | None = None  # QUERY just before the event
    control_before: Control | None = None
    after: str | None = None  # QUERY once settled
    control_after: Control | None = None
    left_before_drain: int = -1  # the UOW's messages on the CF (any state) once settled
    received: list[tuple[bytes, str]] = field(default_factory=list)  # what a receiver got of it, in order
    left_after_drain: int = -1


@dataclass
class Run:
    rows: dict[str, Observed]
    notes: dict[str, Any]


# --- the group -----------------------------------------------------------------------------------------------

class Group:
    def __init__(self, cf: EmbeddedRedis, logs: Path) -> None:
        self.cf, self.logs = cf, logs
        self.members: dict[str, UowMember] = {}

    def start(self, *names: str, lease_ms: int) -> list[UowMember]:
        started = start_members(self.cf.url, self.logs, list(names), lease_ms=lease_ms)
        self.members.update({m.name: m for m in started})
        return started

    def kill(self, *names: str) -> None:
        for n in names:
            self.members.pop(n).kill()

    def stop_all(self) -> None:
        for n in list(self.members):
            self.members.pop(n).stop()

    def structure(self) -> Any:
        return CF(self.cf.client()).structure(S)


def define_service(url: str, **attrs: Any) -> None:
    admin = Admin(connect(url))
    admin.ensure_structure(S, ())
    admin.define_queue(SVC, S, uow={"postpone_attempts": 1, "postpone_delay_s": 3600, **attrs})


def control_of(g: Group, uow: str) -> Control | None:
    found = g.structure().peek(control_queue(SVC), "m", uow, 1)
    return Control.unpack(found[0][1]) if found else None


def messages_on_cf(g: Group, uow: str) -> int:
    """Every entry of the UOW's messages, in any state (committed, or held by a put or get of any unit of work)."""
    return int(g.structure().index_count(data_queue(SVC), "c", uow))


def pclock_value(g: Group) -> int:
    """The structure's pseudo-clock as the CF holds it, read without ticking it."""
    return int(g.cf.client().hget(keys.pclock(S), "v") or 0)


def newest_restored_stamp(out: dict[str, Observed]) -> int:
    """The newest stamp among the statuses a CF loss keeps (logged, and kept by the restart tables: after_restart),
    as observed before the loss: what restore floors the pseudo-clock at. A status the restore does not bring back
    (a non-persistent UOW with a non-persistent status is never logged) leaves no stamp, though it may be newer."""
    return max((c.changed_pc for o in out.values()
                if (c := o.control_before) is not None and after_restart(c) is not None), default=0)


def send(m: UowMember, conv: str, row: Row, *, commit: bool, lifetime_s: int = 0) -> str:
    uow = ""
    for i, body in enumerate(row.bodies()):
        uow = m.call(conv, "send", SVC, body, store=row.persistent,
                     status_lifetime=PSTAT if row.pstatus else UWSTATP_NONE, lifetime_s=lifetime_s,
                     commit=commit and i == N - 1)["uow"]
    return uow


def wait_for(what: str, check: Callable[[], bool], timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def build_rows(g: Group, home: UowMember, recv: UowMember, halfway: Callable[[], None]) -> dict[str, str]:
    """One UOW per row in its status before the event; every one sent through ``home``. Returns row id -> UOW id."""
    uows: dict[str, str] = {}
    by = {r.id: r for r in ROWS}
    rows = lambda status: [r for r in ROWS if r.before == status]  # noqa: E731
    home.conv("snd", "alice", "tok-a")
    recv.conv("rcv", "bob", "tok-b")
    # Through a receiver first, one at a time (a receive takes the oldest ACCEPTED UOW)
    for r in rows(DELIVERED) + rows(POSTPONED) + rows(PROCESSED):
        uows[r.id] = send(home, "snd", r, commit=True)
        conv = "rcv"
        if r.before == DELIVERED:
            conv = f"rcv-{r.id}"  # held at the event: a session each
            recv.conv(conv, "bob", f"tok-{r.id}")
        got = recv.call(conv, "receive", SVC, option="SYNC", wait_ms=5000)
        assert got["uow"] == uows[r.id], r.id
        if r.before == DELIVERED:
            recv.call(conv, "receive", SVC)  # two of its three messages read when its holder goes
        elif r.before == POSTPONED:
            assert recv.call(conv, "cancel")["status"] == POSTPONED
        else:
            recv.call(conv, "commit")
    halfway()
    # Final statuses the sender or the sweeper make
    for r in rows(CANCELLED):
        uows[r.id] = send(home, "snd", r, commit=True)
        assert home.call("snd", "cancel", uows[r.id])["status"] == CANCELLED
    for r in rows(BACKEDOUT):
        uows[r.id] = send(home, "snd", r, commit=False)
        home.call("snd", "backout")
    for r in rows(TIMEOUT):
        uows[r.id] = send(home, "snd", r, commit=True, lifetime_s=1)
    # DISCARDED: sent through a member that dies and is recovered by its peers before the event
    doomed = g.start("QM9", lease_ms=SHORT_LEASE_MS)[0]
    doomed.conv("snd", "carol", "tok-c")
    row = by[f"{DISCARDED}-np-PS"]
    uows[row.id] = send(doomed, "snd", row, commit=True)
    g.kill("QM9")
    for r in rows(ACCEPTED):
        uows[r.id] = send(home, "snd", r, commit=True)
    for r in rows(RECEIVED):
        home.conv(f"snd-{r.id}", "alice", f"tok-{r.id}")
        uows[r.id] = send(home, f"snd-{r.id}", r, commit=False)
    return uows


def observe_before(g: Group, observer: UowMember, uows: dict[str, str]) -> dict[str, Observed]:
    expected = {r.id: (None if r.before in (PROCESSED, ) and not r.pstatus else r.before) for r in ROWS}
    out = {rid: Observed(uow) for rid, uow in uows.items()}
    wait_for("TIMEOUT and DISCARDED before the event",
             lambda: all(observer.query(uows[rid]) == expected[rid] for rid in uows
                         if rid.startswith((TIMEOUT, DISCARDED))))
    for o in out.values():
        o.before = observer.query(o.uow)
        o.control_before = control_of(g, o.uow)
    return out


def observe_after(g: Group, observer: UowMember, out: dict[str, Observed]) -> None:
    by = {r.id: r for r in ROWS}

    def settled() -> bool:
        return all(observer.query(o.uow) == by[rid].after for rid, o in out.items())
    try:
        wait_for("every row settled as the restart tables say", settled)
    except AssertionError:
        pass  # each row's test reports its own
    time.sleep(1.0)  # a few more sweeps: nothing changes a settled row again
    for o in out.values():
        o.after = observer.query(o.uow)
        o.control_after = control_of(g, o.uow)
        o.left_before_drain = messages_on_cf(g, o.uow)
    drained = observer.request("drain", service=SVC)
    for o in out.values():
        o.received = [(b, r) for b, r in drained.get(o.uow, [])]
        o.left_after_drain = messages_on_cf(g, o.uow)


# --- the scenarios -----------------------------------------------------------------------------------------

def run_scenario(scenario: str, tmp: Path) -> Run:
    from backup.run import run_backup
    from restore.run import run_restore

    cf = EmbeddedRedis(data_dir=tmp / "cf").start()
    g = Group(cf, tmp / "logs")
    notes: dict[str, Any] = {}
    try:
        define_service(cf.url)
        # restart: long leases, so that no peer steps in; cf-restore: a lease renewed every second, which is when
        # a member finds the CF lost and joins the restored one
        lease = {"restart": LONG_LEASE_MS, "peer-recovery": SHORT_LEASE_MS, "cf-restore": 3000}[scenario]
        home, recv = g.start("QM1", "QM2", lease_ms=lease)
        observer = g.start("QM3", lease_ms=OBSERVER_LEASE_MS)[0]

        def halfway() -> None:
            if scenario == "cf-restore":  # a fuzzy backup while the members work: what follows is in the logs only
                notes["backup"] = run_backup(cf.client(), S, tmp / "backups", log_root=g.logs)

        t0 = time.monotonic()
        uows = build_rows(g, home, recv, halfway)
        out = observe_before(g, observer, uows)
        notes["built_s"] = time.monotonic() - t0
        if scenario == "restart":
            g.kill("QM2")  # the receiver's member: it holds the DELIVERED ones
            g.start("QM2", lease_ms=LONG_LEASE_MS)
            g.kill("QM1")  # the sender's member: it holds the RECEIVED ones, and is every UOW's home
            observer = g.start("QM1", lease_ms=LONG_LEASE_MS)[0]
        elif scenario == "peer-recovery":
            g.kill("QM1", "QM2")
            wait_for("QM3 recovered QM1 and QM2",
                     lambda: not {"QM1", "QM2"} & set(Admin(cf.client()).members()))
        else:
            notes["pclock_before"] = observer.request("pclock", structure=S)
            cf.kill()  # the CF is lost
            cf.start()
            notes["restore"] = run_restore(cf.client(), S, backup_root=tmp / "backups", log_root=g.logs)
            notes["pclock_at_restore"] = pclock_value(g)  # before any member ticks it
            notes["restore_s"] = time.monotonic() - t0 - notes["built_s"]
            wait_for("the members back on the restored structure",
                     lambda: set(Admin(cf.client()).members()) >= {"QM1", "QM2", "QM3"})
            # restore writes the newest stamp of the statuses it loads as the clock (it left it at 0 until a
            # member's first sweep raised it, and a UOW sent meanwhile counted its lifetime from 0)
            newest = newest_restored_stamp(out)
            wait_for("the pseudo-clock resumed", lambda: pclock_value(g) >= newest, timeout=5)
            notes["pclock_after"] = pclock_value(g)
        notes["event_s"] = time.monotonic() - t0 - notes["built_s"]
        observe_after(g, observer, out)
        notes["observed_s"] = time.monotonic() - t0 - notes["built_s"] - notes["event_s"]
        notes["sweeps"] = {n: m.request("counts") for n, m in g.members.items()}  # which sweeper settled what
        notes["newest_stamp"] = newest_restored_stamp(out)
        return Run(out, notes)
    finally:
        g.stop_all()
        cf.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """Each scenario runs once, on its first use, for every row's test."""
    done: dict[str, Run | BaseException] = {}

    def get(scenario: str) -> Run:
        if scenario not in done:
            try:
                done[scenario] = run_scenario(scenario, tmp_path_factory.mktemp(scenario))
            except Exception as e:  # noqa: BLE001 - every row of the scenario reports it, none runs it again
                done[scenario] = e
        got = done[scenario]
        if isinstance(got, BaseException):
            raise got
        return got
    return get


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_restart_tables_on_real_processes(runs: Callable[[str], Run], scenario: str, row: Row) -> None:
    o = runs(scenario).rows[row.id]
    expected_before = None if (row.before == PROCESSED and not row.pstatus) else row.before
    assert o.before == expected_before, f"{row.id} was {o.before} before the event"
    assert o.after == row.after, f"{row.id}: {o.before} became {o.after}, the restart tables say {row.after}"
    if row.after == ACCEPTED:  # restored: its messages all there, received whole and in order
        assert o.left_before_drain == N
        assert o.received == list(zip(row.bodies(), ["RECV_FIRST", "RECV_MIDDLE", "RECV_LAST"], strict=True))
        before, after = o.control_before, o.control_after
        assert before is not None and after is not None
        # the lifetime is unchanged: it still counts from its creation, as long as it was
        assert (after.created_pc, after.lifetime_ms) == (before.created_pc, before.lifetime_ms)
        assert after.deliveries == before.deliveries + (1 if row.before == DELIVERED else 0)
        assert after.owner == "" and after.until_pc == 0
    else:
        assert o.received == [] and o.left_before_drain == 0, f"{row.id}: messages left behind"
    assert o.left_after_drain == 0


@pytest.mark.slow
def test_a_restored_structure_resumes_its_pseudo_clock_from_the_newest_status(runs: Callable[[str], Run]) -> None:
    """After a CF loss the pseudo-clock comes back at the newest stamp the restored statuses carry: not from zero
    (every lifetime would start over), not ahead (a sudden expiry)."""
    notes = runs("cf-restore").notes
    newest, before, after = notes["newest_stamp"], notes["pclock_before"], notes["pclock_after"]
    assert notes["pclock_at_restore"] >= newest, "restore left the pseudo-clock behind its statuses"
    assert newest > 0
    assert newest <= after <= before + 30_000, (newest, before, after)


# --- what a restart must not settle too early, or twice ------------------------------------------------------

@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    cf = EmbeddedRedis(data_dir=tmp_path / "cf").start()
    g = Group(cf, tmp_path / "logs")
    define_service(cf.url, lifetime_s=3600)
    try:
        yield g
    finally:
        g.stop_all()
        cf.stop()


@pytest.mark.slow
def test_a_uow_is_not_settled_while_its_dead_holders_work_is_still_on_the_cf(group: Group) -> None:
    """A member fenced by its peers whose log cannot be read: its units of work stay in flight, their gets holding
    the UOW's messages. Its DELIVERED UOWs must wait for that work to be backed out: made ACCEPTED before, a receiver
    would find the messages still held (a UOW received in part); discarded before, the backout would put the
    messages back with no status to own them. Once its log is back, the peer recovers it and settles them."""
    g = group
    home, recv = g.start("QM1", "QM2", lease_ms=SHORT_LEASE_MS)
    g.start("QM3", lease_ms=SHORT_LEASE_MS)
    home.conv("snd", "alice", "tok-a")
    kept, gone = Row(DELIVERED, True, True, ACCEPTED), Row(DELIVERED, False, True, DISCARDED)
    uows = {}
    for i, row in enumerate((kept, gone)):
        uows[row.id] = send(home, "snd", row, commit=True)
        recv.conv(f"r{i}", "bob", f"tok-{i}")
        assert recv.call(f"r{i}", "receive", SVC, option="SYNC", wait_ms=5000)["uow"] == uows[row.id]
        recv.call(f"r{i}", "receive", SVC)
    epoch = recv.started["epoch"]
    admin = Admin(g.cf.client())
    g.kill("QM2")
    (g.logs / "QM2").rename(g.logs / "QM2.away")  # its log is not there for the peers
    wait_for("QM2 fenced by a peer", lambda: admin.epoch("QM2") != epoch)
    time.sleep(1.5)  # several sweeps of every member
    assert home.query(uows[kept.id]) == DELIVERED and home.query(uows[gone.id]) == DELIVERED
    assert messages_on_cf(g, uows[kept.id]) == N and messages_on_cf(g, uows[gone.id]) == N
    (g.logs / "QM2.away").rename(g.logs / "QM2")
    wait_for("QM2 recovered", lambda: "QM2" not in admin.members())
    wait_for("both settled", lambda: (home.query(uows[kept.id]), home.query(uows[gone.id])) == (ACCEPTED, DISCARDED))
    assert messages_on_cf(g, uows[gone.id]) == 0
    drained = home.request("drain", service=SVC)
    assert [b for b, _ in drained[uows[kept.id]]] == kept.bodies()


@pytest.mark.slow
def test_postponement_after_a_restart_of_the_home_member_keeps_its_delay(group: Group) -> None:
    """The restart tables apply to a UOW once per restart of the member it was sent through: a persistent UOW
    that lived through one is postponed later like any other, and only the next restart makes it ACCEPTED again
    (Table 1, POSTPONED), its lifetime as it was."""
    g = group
    home, recv = g.start("QM1", "QM2", lease_ms=LONG_LEASE_MS)
    home.conv("snd", "alice", "tok-a")
    row = Row(POSTPONED, True, True, ACCEPTED)
    uow = send(home, "snd", row, commit=True)
    g.kill("QM1")
    home = g.start("QM1", lease_ms=LONG_LEASE_MS)[0]
    assert home.query(uow) == ACCEPTED
    recv.conv("rcv", "bob", "tok-b")
    assert recv.call("rcv", "receive", SVC, option="SYNC", wait_ms=5000)["uow"] == uow
    assert recv.call("rcv", "cancel")["status"] == POSTPONED
    time.sleep(1.5)  # several sweeps: the postponement delay is an hour
    assert home.query(uow) == POSTPONED
    before = control_of(g, uow)
    g.kill("QM1")
    home = g.start("QM1", lease_ms=LONG_LEASE_MS)[0]
    wait_for("ACCEPTED after the restart", lambda: home.query(uow) == ACCEPTED)
    after = control_of(g, uow)
    assert before is not None and after is not None
    assert (after.created_pc, after.lifetime_ms, after.postponements) == (
        before.created_pc, before.lifetime_ms, before.postponements)
    assert [b for b, _ in home.request("drain", service=SVC)[uow]] == row.bodies()


# --- the lifetime's pseudo-clock across downtime -------------------------------------------------------------

@pytest.mark.slow
def test_a_lifetime_counts_up_time_only_across_a_stop_of_the_whole_group(group: Group) -> None:
    """Every member stopped for longer than the UOW's lifetime (and longer than the longest gap the pseudo-clock
    counts as up-time): started again, the UOW is still ACCEPTED, and times out (its status kept) only once its
    lifetime has passed in up-time."""
    g = group
    life_s = 4
    home, _ = g.start("QM1", "QM2", lease_ms=SHORT_LEASE_MS)
    home.conv("snd", "alice", "tok-a")
    row = Row(ACCEPTED, True, True, TIMEOUT)
    uow = send(home, "snd", row, commit=True, lifetime_s=life_s)
    created = control_of(g, uow)
    assert created is not None and created.lifetime_ms == life_s * 1000
    g.kill("QM1")  # one crashes ...
    g.stop_all()  # ... the other is stopped: no member ticks the clock
    at_stop = pclock_value(g)
    lived = at_stop - created.created_pc
    assert 0 <= lived < life_s * 1000 - 1000, "the group must stop well within the lifetime"
    time.sleep(ctl.PCLOCK_GAP_MS / 1000 + 1)  # longer than the lifetime, and than any gap counted as up-time
    home = g.start("QM1", "QM2", lease_ms=SHORT_LEASE_MS)[0]
    restarted = time.monotonic()
    assert home.query(uow) == ACCEPTED
    assert pclock_value(g) - at_stop < 3000, "the downtime counted as up-time"
    while home.query(uow) == ACCEPTED:
        assert time.monotonic() - restarted < life_s + 10, "never timed out"
        time.sleep(0.1)
    up = time.monotonic() - restarted
    assert home.query(uow) == TIMEOUT  # with its persistent status
    assert up >= (life_s * 1000 - lived) / 1000 - 1.0, f"timed out after {up:.1f} s of up-time, {lived} ms before"
    timed_out = control_of(g, uow)
    assert timed_out is not None and timed_out.final_pc >= created.created_pc + created.lifetime_ms
    assert messages_on_cf(g, uow) == 0


@pytest.mark.slow
def test_a_structure_that_is_not_active_times_nothing_out(group: Group) -> None:
    """While the structure is RECOVERING (an operator's restore), its pseudo-clock stands still and no sweeper
    times anything out; ACTIVE again, the sweep resumes."""
    g = group
    home = g.start("QM1", lease_ms=SHORT_LEASE_MS)[0]
    home.conv("snd", "alice", "tok-a")
    uow = send(home, "snd", Row(ACCEPTED, True, True, TIMEOUT), commit=True, lifetime_s=1)
    admin = Admin(g.cf.client())
    admin.set_state(S, "RECOVERING")
    client = g.cf.client()
    accepted = keys.index_set(S, control_queue(SVC), "c", status_letter_hex(ACCEPTED))
    timed_out = keys.index_set(S, control_queue(SVC), "c", status_letter_hex(TIMEOUT))
    still = pclock_value(g)
    time.sleep(2.5)  # well past the lifetime, ten sweeps
    assert pclock_value(g) == still
    assert (client.scard(accepted), client.scard(timed_out)) == (1, 0)
    admin.set_state(S, "ACTIVE")
    wait_for("the timeout once ACTIVE", lambda: home.query(uow) == TIMEOUT)
