"""Exhaustive model check of commits and backouts done in bounded steps (commit.lua, backout.lua: the prelude's
"Outcomes in bounded steps"), with the real scripts on the real redis-server (tests/backup/model).

A UOW's outcome is a few CF calls of one entry's work each (step 1). Its owner may die between any two of them;
a peer then finishes the outcome (a peer's recovery decides by the owner's log: the COMMIT or BACKOUT it finds; a
UOW that logged nothing, found in the CF only, it backs out), each call a model step as well. Every interleaving
of those steps with the other actors is run (sleep-set reduction, as in test_model.py):
  * with a consumer (another member getting and committing on the same queue): at every reachable state, the
    UOW's puts are available, or were taken, in put order (a prefix of them), and none is taken twice; at the
    end, every committed message is either on the queue or consumed by the consumer's committed gets, never both,
    and the UOW holds nothing (nothing left locked). The same with the owner's commit never logged (no persistent
    work) and the peer backing the UOW out: its commit had begun, so the backout finishes the commit, and nothing
    the consumer took is undone;
  * with the backup (backup.protocol's steps): at the end the restore from the backup plus the logs equals the
    CF's committed messages in get order, and at every state after the backup ended the CF's loss there restores
    what the CF and the logs say must survive (test_model.py's checks), whether the half-applied commit was seen
    by the backup or not; the same for a backout half applied. (Every interleaving with the backup is the deep
    tier's, make deep-test; the default suite runs 200 random schedules of it.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from sqm.core import records
from tests.backup.model.actors import (
    QUEUE,
    STRUCTURE,
    Group,
    Member,
    Mutation,
    Steps,
    Uow,
    Violation,
    World,
    backup_actor,
    check_after_loss,
    check_complete,
    run_to_end,
)
from tests.backup.model.scheduler import explore, sample
from tests.backup.test_model import committed, independent

STEP = 1
MEMBERS = (("QM1", 0), ("QM2", 0), ("QM3", 0))


@pytest.fixture
def client(redis_url: str, redis_server: Any) -> redis.Redis:
    return redis_server.client()  # the harness user (FLUSHALL, DUMP, RESTORE between runs)


def outcome_calls(m: Member, uow: Uow, commit: bool, *, lrsn: int, at: int, by_recovery: bool,
                  calls: int | None = None) -> Steps:
    """An outcome's CF calls, one model step each; after `calls` of them the member dies. Returns whether done."""
    later, n = False, 0
    while calls is None or n < calls:
        yield f"CF {'commit' if commit else 'backout'} call {uow.id} by {m.name}"
        gen = uow.structures[STRUCTURE]
        if commit:
            r = m.s.commit_step(m.caller, uow.id, gen=gen, lrsn=lrsn, at=at, decided_by_recovery=by_recovery,
                                later=later, step=STEP)
        else:
            r = m.s.backout_step(m.caller, uow.id, gen=gen, lrsn=lrsn, at=at, has_data=True,
                                 decided_by_recovery=by_recovery, later=later, step=STEP)
        n += 1
        if not r.more:
            return True
        later = True
    return False


def owner_then_peer(w: World, uow: Uow, commit: bool, calls: int | None, *, logged: bool = True,
                    peer_commits: bool | None = None) -> Steps:
    """The owner logs its decision (or nothing) and makes `calls` CF calls, then dies; the peer (QM2) finishes:
    it decides by the owner's log, logs a RECOVERY record, and calls until the outcome is done."""
    owner, peer = w.members["QM1"], w.members["QM2"]
    lrsn = 0
    if logged:
        yield f"log {'COMMIT' if commit else 'BACKOUT'} {uow.id}"
        lrsn = owner.clock.now()
        dd = [] if commit else owner._gets_data(uow)
        owner.log.append(records.commit(uow.id, lrsn, uow.structures) if commit
                         else records.backout(uow.id, lrsn, uow.structures, data=dd))
        uow.decided_lrsn = lrsn
    done = yield from outcome_calls(owner, uow, commit, lrsn=lrsn, at=lrsn, by_recovery=False, calls=calls)
    if done:
        return
    decided = commit if peer_commits is None else peer_commits
    rec_lrsn = 0
    if logged:
        yield f"log RECOVERY {uow.id}"
        peer.clock.observe(lrsn)
        rec_lrsn = peer.clock.now()
        dd = [] if decided else owner._gets_data(uow)
        peer.log.append(records.recovery(uow.id, rec_lrsn, uow.structures, commit=decided, of="QM1", by="QM2",
                                         data=dd, at=lrsn))
    yield from outcome_calls(peer, uow, decided, lrsn=rec_lrsn, at=lrsn, by_recovery=True)


# --- with a consumer -----------------------------------------------------------------------------------------------
def consumer(w: World, got: list[str]) -> Steps:
    qm = w.members["QM3"]
    c = qm.new_uow()
    for _ in range(2):
        eid = yield from qm.get(c)
        if eid is not None:
            got.append(eid)
    yield from qm.commit(c)


def run_with_consumer(client: redis.Redis, calls: int | None, *, persistent: bool, peer_commits: bool | None
                      ) -> tuple[int, list[str]]:
    group = Group(client, MEMBERS)
    findings: list[str] = []
    current: list[Any] = []
    puts = ["m1", "m2", "m3"]

    def start() -> list[tuple[str, Steps]]:
        w = World(group, Mutation())
        qm = w.members["QM1"]
        committed(qm, "m0", b"zero")
        u = qm.new_uow()
        run_to_end(qm.get(u))  # takes m0
        for eid in puts:
            run_to_end(qm.put(u, qm.entry(eid, persistent=persistent), eid.encode()))
        got: list[str] = []
        current[:] = [w, got]
        return [("QM1", owner_then_peer(w, u, True, calls, logged=persistent, peer_commits=peer_commits)),
                ("QM3", consumer(w, got))]

    def state() -> tuple[list[str], list[str]]:
        w, got = current
        available = [e.id for e, _ in w.structure.browse(QUEUE, 100, w.now_ms)]
        return available, list(got)

    def on_node(trace: list[str]) -> None:
        available, got = state()
        seen = got + [i for i in available if i not in got]
        mine = [i for i in seen if i in puts]
        if mine != puts[:len(mine)] or len(set(got)) != len(got):
            findings.append(f"{trace}: taken {got}, available {available}: not in put order")

    def on_leaf(trace: list[str]) -> None:
        on_node(trace)
        w, got = current
        available, _ = state()
        taken = [i for i in got if i in puts]
        if sorted(available + taken) != puts or set(available) & set(taken) or "m0" in available + got:
            findings.append(f"{trace}: available {available}, consumed {got}: lost or consumed twice")
        if client.hlen(f"{{{STRUCTURE}}}:uows") or client.keys(f"{{{STRUCTURE}}}:uow*"):
            findings.append(f"{trace}: a UOW still holds entries")

    t0 = time.monotonic()
    ex = explore(start, on_leaf=on_leaf, on_node=on_node)
    print(f"consumer, owner dies after {calls} calls: {ex.interleavings} interleavings, {ex.nodes} states, "
          f"{time.monotonic() - t0:.1f}s")
    return ex.interleavings, findings


@pytest.mark.parametrize("calls", [1, 2, 3, None], ids=lambda c: f"owner-dies-after-{c}")
def test_a_stepped_commit_makes_puts_available_in_put_order_and_recovery_finishes_it(client: redis.Redis,
                                                                                     calls: int | None) -> None:
    runs, findings = run_with_consumer(client, calls, persistent=True, peer_commits=None)
    assert not findings, findings[:3]
    assert runs > 10


@pytest.mark.parametrize("calls", [2, 3], ids=lambda c: f"owner-dies-after-{c}")
def test_a_backout_of_a_uow_whose_commit_began_finishes_the_commit(client: redis.Redis, calls: int) -> None:
    """Nothing logged (non-persistent puts): the peer finds the UOW in the CF only and backs it out; the commit had
    begun, so the CF finishes it, and what the consumer took stays taken."""
    runs, findings = run_with_consumer(client, calls, persistent=False, peer_commits=False)
    assert not findings, findings[:3]
    assert runs > 10


# --- with the backup ---------------------------------------------------------------------------------------------
def run_with_backup(client: redis.Redis, commit: bool, calls: int, samples: int | None = None
                    ) -> tuple[int, list[str]]:
    """Every interleaving of the owner (then its peer) with the backup; with `samples`, that many random ones."""
    group = Group(client, MEMBERS)
    findings: list[str] = []
    current: list[World] = []

    def start() -> list[tuple[str, Steps]]:
        w = World(group, Mutation())
        qm = w.members["QM1"]
        committed(qm, "m0", b"zero")
        u = qm.new_uow()
        run_to_end(qm.get(u))  # takes m0
        for eid in ("m1", "m2"):
            run_to_end(qm.put(u, qm.entry(eid), eid.encode()))
        current[:] = [w]
        return [("QM1", owner_then_peer(w, u, commit, calls)), ("backup", backup_actor(w))]

    def check(fn: Any, trace: list[str]) -> None:
        try:
            fn(current[0])
        except Violation as v:
            findings.append(f"{trace}: {v}")

    def on_node(trace: list[str]) -> None:
        if current[0].backup.ended:
            check(check_after_loss, trace)

    t0 = time.monotonic()
    if samples is None:
        ex = explore(start, on_leaf=lambda trace: check(check_complete, trace), on_node=on_node,
                     independent=independent)
    else:
        ex = sample(start, schedules=samples, seed=SAMPLE_SEED, on_leaf=lambda trace: check(check_complete, trace),
                    on_node=on_node)
    print(f"backup, {'commit' if commit else 'backout'}, owner dies after {calls} calls: {ex.interleavings} "
          f"interleavings, {ex.nodes} states, {time.monotonic() - t0:.1f}s")
    return ex.interleavings, findings


# The default suite runs SAMPLES random schedules of the backup beside the half-applied outcome (every one: 40-60 s
# on a loaded machine), the deep twin every interleaving.
SAMPLES, SAMPLE_SEED = 200, 1


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "backout"])
def test_the_backup_and_the_restore_are_right_about_a_half_applied_outcome(client: redis.Redis,
                                                                           commit: bool) -> None:
    """The owner dies after its second call (the UOW marked and its work listed; one entry done): the backup may
    copy the UOW half applied, and the restore decides by the log."""
    runs, findings = run_with_backup(client, commit, 2, SAMPLES)
    assert not findings, findings[:3]
    assert runs > 10


@pytest.mark.deep
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "backout"])
def test_the_backup_and_the_restore_are_right_about_a_half_applied_outcome_under_any_interleaving(
        client: redis.Redis, commit: bool) -> None:
    runs, findings = run_with_backup(client, commit, 2)
    assert not findings, findings[:3]
    assert runs > 10
