"""Exhaustive model check of the fuzzy backup protocol (docs/invariants.md, invariant 4).

Every interleaving (no sampling) of the backup's steps with a few message transitions, run against the real CF
operations on the real redis-server, then the CF is lost and restored with the real fold (restore.plan.plan_local).
The CF runs them twice: as the product's CF does (the server module's commands, cfemu.server_module, for the
operations it has, where the build made it; the scripts for the others), and on a server without the module (every
operation its script): the scripts are the specification, and the module must keep every invariant they keep.

Scope. One structure APP1 with queue Q1 (persistent messages m1, m2) and queue Q2 (one non-persistent message,
which must never come back); two members, QM1 with a true clock and QM2 with a clock 5 s slow (only the CF's
clock merge keeps its LRSNs in order).
  Actors:
  * backup (backup.protocol.STEPS): begin (sets the floor) / step 1 UG / 2 UP / 3 CP / 4 UG / 5 EX / end, each
    step an atomic snapshot of the ids and then, as a step of its own, the fetch of their current copies (a
    step whose snapshot is empty fetches nothing and has no fetch step): 7 to 12 atomic steps;
  * the message actors of each scenario below, whose COMMIT / BACKOUT / PUT-outside-syncpoint records are
    written log-first as steps of their own (a member can stall between its record and its CF update), with
    the refusal rules of sqm/core/manager.py (FloorError: relog above the floor and retry; BackupActiveError on a
    backout: relog with the gets' data and retry with has_data): see tests/backup/model/actors.py.
  Scenarios:
  * lifecycle: QM1 puts m1 in UOW 1, commits (log, apply), gets it in UOW 2, backs out (log, apply) - the get
    can be backed out between steps 3 and 4 (the patent's exception);
  * redelivery: m1 committed before the backup; QM2 (slow clock) gets it, backs out, gets it again, commits;
  * get before the backup (the step-1 case): QM1 got m1 before the backup began and backs the get out;
  * put outside syncpoint: m1 committed before; QM2 (slow clock) puts m2 outside syncpoint (a UOW of its own:
    put, COMMIT record, stall, CF commit), then gets a message in a UOW and commits;
  * fused: m1 committed before; QM2 (slow clock) puts m2 in one CF operation (put_committed: PUT and COMMIT
    records, stall, CF call), gets m1 (get_committed) and logs its commit, gets m2 in a call that carries m1's
    commit, logs m2's commit and applies it (the CF commit: no get comes after it);
  * expiry: m1 and m2 expire; before the backup QM1 got m1 and the expiry task moved m2 to the expired list;
    QM1 backs the get of m1 out while the expiry task runs again (purges m2; moves m1 to the expired list if
    it is available by then).
Checks, after every complete schedule: the restore from the backup plus the merged logs from the backup's floor
equals the CF's committed persistent messages (ids, queues, data, backout counts, per-queue get order): nothing
lost, resurrected or duplicated; the same with the replay started at LRSN 0; the fold run twice, and run over
its own result, gives the same. And in every reachable state after the backup ended (the CF lost right there,
members stalled anywhere): the restore equals what the CF and the logs say must survive (committed messages;
in-commit work completed; in-flight work backed out; logged puts outside syncpoint kept).
Reduction: sleep sets (tests/backup/model/scheduler.py) with one independence: a member's log-only step (it reads the
CF and its clock, and appends to its own log) commutes with a backup snapshot or fetch (which only read the CF):
one schedule per class of equivalent schedules is run, every reachable state is visited. Every interleaving of the
four longer scenarios (about 3,000 each) is the deep tier's (make deep-test); the default suite runs every one of
the two shorter ones and 500 random schedules of each longer one, with the same checks. Also, a put or get
inside a UOW is one step with its log record (CF first, then the record: nothing else reads a log before the CF
is lost, and the restore reads a fetch's pipelined descriptor and data as one atomic read).
The floor refusal (FloorError: relog, retry) is modelled but no schedule here reaches it: with puts outside
syncpoint now UOWs of their own, every log-first record belongs to a UOW that holds entries in the structure, and
the floor is at or below the first LRSN of every such UOW (peer recovery by a member with a slow clock could
still reach it: not in this scope).
Mutations prove that the checker can fail: without the patent's exception (BACKOUT records without the data,
the CF not refusing) the lifecycle loses m1; without step 1 as well the step-1 case loses it. Each mechanism
alone covers the step-1 case: the data rule covers every backout while the backup runs, not only gets taken
during it, so step 1 is a second line of defence here (the test pins that down too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from backup.protocol import STEPS
from cfemu import server_module
from cfemu.embedded import EmbeddedRedis
from restore.reference import plan_local
from tests.backup.model.actors import (
    NP_QUEUE,
    QUEUE,
    STRUCTURE,
    T_EXPIRY,
    T_LATE,
    Group,
    Member,
    Mutation,
    Scenario,
    Steps,
    Violation,
    World,
    backup_actor,
    cf_truth,
    check_after_loss,
    check_complete,
    restored_rows,
    run_to_end,
)
from tests.backup.model.scheduler import Exploration, Stop, explore, sample

MEMBERS = (("QM1", 0), ("QM2", -5_000_000))


def independent(a: str, b: str) -> bool:
    """A member's log-only step and a backup snapshot or fetch commute (see the module docstring)."""
    def kind(label: str) -> str:
        if label.startswith(("log ", "relog ")):
            return "log"
        return "read" if label.startswith("backup step") else "cf"
    return {kind(a), kind(b)} == {"log", "read"}


# --- scenarios ---------------------------------------------------------------------------------------------------
def committed(qm: Member, entry_id: str, body: bytes, expiry: int = 0) -> None:
    uow = qm.new_uow()
    run_to_end(qm.put(uow, qm.entry(entry_id, expiry=expiry), body))
    run_to_end(qm.commit(uow))


def with_nonpersistent(w: World) -> None:
    qm = w.members["QM1"]
    run_to_end(qm.put_nonpersistent(qm.entry("np", persistent=False, queue=NP_QUEUE), b"np"))


def lifecycle(w: World) -> list[tuple[str, Steps]]:
    with_nonpersistent(w)
    qm = w.members["QM1"]

    def actor() -> Steps:
        u1 = qm.new_uow()
        yield from qm.put(u1, qm.entry("m1"), b"one")
        yield from qm.commit(u1)
        u2 = qm.new_uow()
        yield from qm.get(u2)
        yield from qm.backout(u2)
    return [("QM1", actor())]


def redelivery(w: World) -> list[tuple[str, Steps]]:
    with_nonpersistent(w)
    committed(w.members["QM1"], "m1", b"one")
    qm = w.members["QM2"]

    def actor() -> Steps:
        u2 = qm.new_uow()
        yield from qm.get(u2)
        yield from qm.backout(u2)
        u3 = qm.new_uow()
        yield from qm.get(u3)
        yield from qm.commit(u3)
    return [("QM2", actor())]


def get_before_backup(w: World) -> list[tuple[str, Steps]]:
    with_nonpersistent(w)
    qm = w.members["QM1"]
    committed(qm, "m1", b"one")
    uow = qm.new_uow()
    run_to_end(qm.get(uow))
    return [("QM1", qm.backout(uow))]


def put_outside_syncpoint(w: World) -> list[tuple[str, Steps]]:
    with_nonpersistent(w)
    committed(w.members["QM1"], "m1", b"one")
    qm = w.members["QM2"]

    def actor() -> Steps:
        yield from qm.put_outside_syncpoint(qm.entry("m2"), b"two")
        uow = qm.new_uow()
        yield from qm.get(uow)
        yield from qm.commit(uow)
    return [("QM2", actor())]


def fused(w: World) -> list[tuple[str, Steps]]:
    """The fused operations: QM2 (slow clock) puts m2 in one CF operation (records first), gets m1 and logs its
    commit, then gets m2 in a call that carries m1's commit, logs m2's commit, and applies it (no get after it)."""
    with_nonpersistent(w)
    committed(w.members["QM1"], "m1", b"one")
    qm = w.members["QM2"]

    def actor() -> Steps:
        yield from qm.put_committed(qm.entry("m2"), b"two")
        u1 = qm.new_uow()
        yield from qm.get_committed(u1)
        yield from qm.decide(u1, True)
        u2 = qm.new_uow()
        left = yield from qm.get_committed(u2, [u1])
        for u in left:  # refused there (below a floor set meanwhile): the CF commit finishes it
            yield from qm.apply(u, True)
        yield from qm.decide(u2, True)
        yield from qm.apply(u2, True)
    return [("QM2", actor())]


def expiry(w: World) -> list[tuple[str, Steps]]:
    with_nonpersistent(w)
    qm, task = w.members["QM1"], w.members["QM2"]
    committed(qm, "m1", b"one", expiry=T_EXPIRY)
    committed(qm, "m2", b"two", expiry=T_EXPIRY)
    uow = qm.new_uow()
    run_to_end(qm.get(uow))
    run_to_end(task.expire(T_LATE))  # m2 moves to the expired list; m1 is held by the get: looked at later
    return [("QM1", qm.backout(uow)), ("expiry", task.expire(T_LATE + 10_000))]


# --- the checker -------------------------------------------------------------------------------------------------
@dataclass
class Finding:
    where: str  # "end" (a complete schedule) or "loss" (the CF lost in an intermediate state)
    trace: list[str]
    problem: str

    def __str__(self) -> str:
        steps = "\n    ".join(self.trace)
        return f"{self.where}: {self.problem}\n  schedule:\n    {steps}"


@dataclass
class Result:
    exploration: Exploration
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    schedules: list[list[str]] = field(default_factory=list)  # every complete schedule run, in order


def check(client: redis.Redis, scenario: Scenario, mutation: Mutation | None = None, *,
          stop_at_first: bool = False, samples: int | None = None) -> Result:
    """Every interleaving (one per equivalence class); with `samples`, that many random schedules instead."""
    group = Group(client, MEMBERS)
    mutation = mutation or Mutation()
    current: list[World] = []
    findings: list[Finding] = []
    schedules: list[list[str]] = []

    def start() -> list[tuple[str, Steps]]:
        w = World(group, mutation)
        current[:] = [w]
        return [("backup", backup_actor(w)), *scenario(w)]

    def run_check(fn: Callable[[World], None], where: str, trace: list[str]) -> None:
        try:
            fn(current[0])
        except Violation as v:
            findings.append(Finding(where, list(trace), str(v)))
            if stop_at_first:
                raise Stop from None

    def on_node(trace: list[str]) -> None:
        if current[0].backup.ended:
            run_check(check_after_loss, "loss", trace)

    def on_leaf(trace: list[str]) -> None:
        schedules.append(list(trace))
        run_check(check_complete, "end", trace)

    t0 = time.monotonic()
    if samples is None:
        ex = explore(start, on_leaf=on_leaf, on_node=on_node, independent=independent)
        how = f"one per equivalence class; {ex.sleep_blocked} redundant branches cut"
    else:
        ex = sample(start, schedules=samples, seed=SAMPLE_SEED, on_leaf=on_leaf, on_node=on_node)
        how = f"distinct, of {samples} drawn at random"
    result = Result(ex, findings, time.monotonic() - t0, schedules)
    print(f"{scenario.__name__}: {ex.interleavings} interleavings ({how}), {ex.nodes} intermediate states checked, "
          f"longest schedule {ex.longest} steps, {result.seconds:.1f}s, {len(findings)} findings")
    return result


@pytest.fixture
def client(redis_url: str, redis_server: Any) -> redis.Redis:
    """The harness user: the model checker resets the CF between runs with FLUSHALL, KEYS, DUMP and RESTORE,
    which no role of the product may run."""
    return redis_server.client()


@pytest.fixture(scope="module")
def scripts_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A CF that runs every operation's script: a server started without the module."""
    srv = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("model-scripts"), module=False)
    srv.start()
    try:
        yield srv.client()
    finally:
        srv.stop()


# Interleavings explored per scenario (equivalence classes under the sleep-set reduction). Pinned: a change in
# the protocol, the scripts or the actors that changes the search space shows here.
EXPECTED = {"lifecycle": 3376, "redelivery": 3283, "get_before_backup": 130, "put_outside_syncpoint": 1009,
            "fused": 3070, "expiry": 2710}


# Random schedules drawn per scenario where the default suite samples instead of running every interleaving (the
# deep tier runs every one), and the generator's seed (the same schedules every run). 500 draws run about 450
# distinct schedules of each scenario in 5-15 s, against 40-90 s for all of them; the mutation test below shows
# they find the lost message the lifecycle's every-interleaving check finds.
SAMPLES = 500
SAMPLE_SEED = 1

# The explorations (no mutation) this process ran, by scenario and sample count (None: every interleaving): a
# test that looks at the schedules of one that a test before it checked takes them from here rather than
# running them again.
_EXPLORED: dict[tuple[str, int | None], Result] = {}


def explored(client: redis.Redis, scenario: Scenario, samples: int | None = None) -> Result:
    key = (scenario.__name__, samples)
    if key not in _EXPLORED:
        _EXPLORED[key] = check(client, scenario, samples=samples)
    return _EXPLORED[key]


# The tests that look at the fused scenario's schedules run on one worker, after its check (collection order).
FUSED_SCHEDULES = pytest.mark.xdist_group("backup-model-fused")
# Every interleaving of the longer scenarios (3,000 and more each, 40-90 s a scenario): the deep tier's; the
# default suite runs SAMPLES random ones of each (below) and every interleaving of the two shorter ones.
EVERY_INTERLEAVING_IS_DEEP = pytest.mark.deep


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [pytest.param(lifecycle, marks=EVERY_INTERLEAVING_IS_DEEP),
                                      pytest.param(redelivery, marks=EVERY_INTERLEAVING_IS_DEEP),
                                      get_before_backup, put_outside_syncpoint,
                                      pytest.param(fused, marks=EVERY_INTERLEAVING_IS_DEEP),
                                      pytest.param(expiry, marks=EVERY_INTERLEAVING_IS_DEEP)],
                         ids=lambda s: s.__name__)
def test_backup_loses_nothing_under_any_interleaving(client: redis.Redis, scenario: Scenario) -> None:
    # The product's CF: the module's commands where the build made the module.
    assert server_module.path() is None or server_module.loaded_ops(client) == server_module.COMMANDS
    result = explored(client, scenario)
    assert not result.findings, "\n".join(str(f) for f in result.findings[:3])
    assert result.exploration.interleavings == EXPECTED[scenario.__name__]
    assert result.exploration.nodes > result.exploration.interleavings


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [lifecycle, redelivery, pytest.param(fused, marks=FUSED_SCHEDULES), expiry],
                         ids=lambda s: s.__name__)
def test_backup_loses_nothing_under_random_interleavings(client: redis.Redis, scenario: Scenario) -> None:
    """The same checks on SAMPLES random schedules of each longer scenario (every interleaving: deep tier)."""
    assert server_module.path() is None or server_module.loaded_ops(client) == server_module.COMMANDS
    result = explored(client, scenario, SAMPLES)
    assert not result.findings, "\n".join(str(f) for f in result.findings[:3])
    assert result.exploration.interleavings > SAMPLES // 2  # not the same few schedules drawn again and again
    assert result.exploration.nodes > result.exploration.interleavings


@pytest.mark.slow
def test_random_interleavings_find_the_message_lost_without_the_patents_exception(client: redis.Redis) -> None:
    """The sample is not blind: without the patent's exception the lifecycle's random schedules lose m1, as its
    every-interleaving check (test_checker_catches_backout_without_data) finds."""
    result = check(client, lifecycle, Mutation(no_backout_data=True), stop_at_first=True, samples=SAMPLES)
    assert result.findings, "the random schedules missed the lost message"
    assert "lost ['m1']" in result.findings[0].problem, str(result.findings[0])


@pytest.mark.deep  # the default suite checks the product's CF (the module where built: above)
@pytest.mark.parametrize("scenario", [lifecycle, redelivery, get_before_backup, put_outside_syncpoint, fused, expiry],
                         ids=lambda s: s.__name__)
def test_backup_loses_nothing_under_any_interleaving_on_the_scripts(scripts_client: redis.Redis,
                                                                     scenario: Scenario) -> None:
    assert server_module.loaded_ops(scripts_client) == {}
    result = check(scripts_client, scenario)
    assert not result.findings, "\n".join(str(f) for f in result.findings[:3])
    assert result.exploration.interleavings == EXPECTED[scenario.__name__]


@pytest.mark.slow
def test_checker_catches_backout_without_data(client: redis.Redis) -> None:
    """Without the patent's exception a get backed out between steps 3 and 4 is in neither the backup nor the
    log: the checker must find the lost message."""
    result = check(client, lifecycle, Mutation(no_backout_data=True), stop_at_first=True)
    assert result.findings, "the checker missed the lost message"
    assert "lost ['m1']" in result.findings[0].problem, str(result.findings[0])


def fused_commit_before_its_record(w: World) -> list[tuple[str, Steps]]:
    """A wrong member: its get's commit carried to the CF before the COMMIT record is forced."""
    committed(w.members["QM1"], "m1", b"one")
    committed(w.members["QM1"], "m2", b"two")
    qm = w.members["QM2"]

    def actor() -> Steps:
        u1 = qm.new_uow()
        yield from qm.get_committed(u1)
        u1.decided_lrsn = qm.clock.now()  # the LRSN its COMMIT will have
        yield from qm.get_committed(qm.new_uow(), [u1])
        yield from qm.decide(u1, True)
    return [("QM2", actor())]


def test_checker_catches_a_carried_commit_applied_before_its_record(client: redis.Redis) -> None:
    """Why get_committed applies only the commits of earlier gets: a get's commit applied on the CF before its
    COMMIT record is on disk deletes a message that a restore (the CF lost before the record) brings back."""
    result = check(client, fused_commit_before_its_record, stop_at_first=True)
    assert result.findings, "the checker missed the message consumed without a record"
    assert "resurrected ['m1']" in result.findings[0].problem, str(result.findings[0])


@pytest.mark.slow
@FUSED_SCHEDULES
def test_fused_puts_below_the_floor_are_made_again_above_it(client: redis.Redis) -> None:
    """The slow-clocked member's put_committed meets the floor of the backup begun before it (some schedules): it is
    logged backed out and made again as a new UOW above the floor, and nothing is lost or doubled (the scenario's
    check); the exploration reaches that path."""
    traces = explored(client, fused, SAMPLES).schedules
    assert any(any("put_committed below the floor" in step for step in t) for t in traces)
    assert any(not any("below the floor" in step for step in t) for t in traces)


def test_checker_catches_step1_removed_without_data_rule(client: redis.Redis) -> None:
    """A get taken before the backup and backed out after step 3: without step 1 and without the data rule
    nothing holds the message."""
    result = check(client, get_before_backup, Mutation(steps=STEPS[1:], no_backout_data=True), stop_at_first=True)
    assert result.findings, "the checker missed the lost message"
    assert "lost ['m1']" in result.findings[0].problem, str(result.findings[0])


@pytest.mark.parametrize("mutation", [Mutation(steps=STEPS[1:]), Mutation(no_backout_data=True)],
                         ids=["without step 1", "without the data rule"])
def test_step1_case_is_covered_by_either_mechanism(client: redis.Redis, mutation: Mutation) -> None:
    result = check(client, get_before_backup, mutation)
    assert not result.findings, "\n".join(str(f) for f in result.findings[:3])


# --- the scheduler itself ----------------------------------------------------------------------------------------
def counting_actor(name: str, steps: int) -> Steps:
    for i in range(steps):
        yield f"{name} {i}"


@pytest.mark.parametrize(("a", "b", "expected"), [(1, 1, 2), (3, 2, 10), (4, 4, 70)])
def test_scheduler_runs_every_interleaving(a: int, b: int, expected: int) -> None:
    """Without an independence relation: C(a + b, a) schedules, each one distinct."""
    leaves: list[tuple[str, ...]] = []
    ex = explore(lambda: [("A", counting_actor("a", a)), ("B", counting_actor("b", b))],
                 on_leaf=lambda trace: leaves.append(tuple(trace)))
    assert ex.interleavings == len(set(leaves)) == expected


def test_sleep_sets_run_one_schedule_per_equivalence_class() -> None:
    """When A's steps all commute with B's there is one class. When only 'a 0' and 'b 0' commute, the 6 orders
    of a0 a1 / b0 b1 fall into 4 classes ('a0 b0 ...' = 'b0 a0 ...' twice): the search runs one schedule of
    each class, as the normal forms of all 6 orders show."""
    ex = explore(lambda: [("A", counting_actor("a", 3)), ("B", counting_actor("b", 3))],
                 on_leaf=lambda trace: None, independent=lambda x, y: True)
    assert ex.interleavings == 1

    def indep(x: str, y: str) -> bool:
        return {x, y} == {"a 0", "b 0"}
    classes: set[tuple[str, ...]] = set()
    run = explore(lambda: [("A", counting_actor("a", 2)), ("B", counting_actor("b", 2))],
                  on_leaf=lambda trace: classes.add(canonical(trace, indep)), independent=indep)
    everything: set[tuple[str, ...]] = set()
    explore(lambda: [("A", counting_actor("a", 2)), ("B", counting_actor("b", 2))],
            on_leaf=lambda trace: everything.add(canonical(trace, indep)))
    assert run.interleavings == len(classes) == len(everything) == 4


def canonical(trace: list[str], indep: Callable[[str, str], bool]) -> tuple[str, ...]:
    """The lexicographically least reordering of adjacent independent steps (a trace's normal form)."""
    steps = [t.split(": ", 1)[1] for t in trace]
    changed = True
    while changed:
        changed = False
        for i in range(len(steps) - 1):
            if indep(steps[i], steps[i + 1]) and steps[i + 1] < steps[i]:
                steps[i], steps[i + 1] = steps[i + 1], steps[i]
                changed = True
    return tuple(steps)


# --- get order: the live CF and the restore agree (invariant 7) ----------------------------------------------
def restored_order(w: World) -> list[str]:
    plan = plan_local(STRUCTURE, [], w.records(0), now_ms=w.now_ms)
    return [row[0] for row in restored_rows(plan).get(QUEUE, [])]


TRUE_CLOCKS = (("QM1", 0), ("QM2", 0))  # the log order is then the real-time order of the records


def test_gets_backed_out_in_another_order_return_to_their_places(client: redis.Redis) -> None:
    w = World(Group(client, TRUE_CLOCKS), Mutation())
    q1, q2 = w.members["QM1"], w.members["QM2"]
    committed(q1, "m1", b"one")
    committed(q1, "m2", b"two")
    first, second = q1.new_uow(), q2.new_uow()
    run_to_end(q1.get(first))
    run_to_end(q2.get(second))
    run_to_end(q1.backout(first))
    run_to_end(q2.backout(second))  # m2 must not jump ahead of m1
    assert [row[0] for row in cf_truth(w)[QUEUE]] == restored_order(w) == ["m1", "m2"]


def test_commits_applied_out_of_log_order_keep_the_log_order(client: redis.Redis) -> None:
    w = World(Group(client, TRUE_CLOCKS), Mutation())
    q1, q2 = w.members["QM1"], w.members["QM2"]
    ua, ub = q1.new_uow(), q2.new_uow()
    run_to_end(q1.put(ua, q1.entry("mA"), b"A"))
    run_to_end(q2.put(ub, q2.entry("mB"), b"B"))
    commit_a, commit_b = q1.commit(ua), q2.commit(ub)
    for stalled in (commit_a, commit_b):  # each writes its COMMIT record, A's first, and stalls before the CF
        assert next(stalled).startswith("log COMMIT")
        assert next(stalled).startswith("CF commit")
    run_to_end(commit_b)
    run_to_end(commit_a)
    assert [row[0] for row in cf_truth(w)[QUEUE]] == restored_order(w) == ["mA", "mB"]

