"""The exhaustive model check with selective relogging and log pruning in the model (docs/log-management.md; the
model's world, actors and checks: tests/backup/model; the relog actor and the pruning checks:
tests/backup/model/relogging.py).

Each scenario of test_model (its message actors) runs after a backup and a first relog pass (so the stored CPL makes
the interleaved pass selective: it copies only what the first one left older than its threshold), interleaved in
every order with one more relog pass of QM1. After every step (the CF lost right there) and at the end of every
schedule: the logs pruned below where sqm.core.retention says CF recovery starts (the backup's replay start or the relog
window, as restore chooses) still restore exactly what must survive, and so do the logs alone from the window.
A mutation proves the checks can fail: a window that starts at the pass's end loses a message.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tests.backup.model.actors import (
    Group,
    Mutation,
    Scenario,
    Steps,
    Violation,
    World,
    backup_actor,
    run_to_end,
)
from tests.backup.model.relogging import (
    RelogMutation,
    check_relogged_after_loss,
    check_relogged_complete,
    relog_actor,
)
from tests.backup.model.scheduler import Exploration, Stop, explore
from tests.backup.test_model import (
    MEMBERS,
    expiry,
    get_before_backup,
    lifecycle,
    put_outside_syncpoint,
    redelivery,
)


def check(client: redis.Redis, scenario: Scenario, mutation: RelogMutation | None = None,
          *, stop_at_first: bool = False) -> tuple[Exploration, list[str]]:
    group = Group(client, MEMBERS)
    current: list[World] = []
    findings: list[str] = []

    def start() -> list[tuple[str, Steps]]:
        w = World(group, Mutation())
        current[:] = [w]
        actors = scenario(w)  # its setup runs now: the messages committed before the backup
        run_to_end(backup_actor(w))
        run_to_end(relog_actor(w, "QM1", mutation))
        return [("relog", relog_actor(w, "QM1", mutation)), *actors]

    def run_check(fn: Any, where: str, trace: list[str]) -> None:
        try:
            fn(current[0])
        except Violation as v:
            findings.append(f"{where}: {v}\n    " + "\n    ".join(trace))
            if stop_at_first:
                raise Stop from None

    t0 = time.monotonic()
    ex = explore(start, on_leaf=lambda t: run_check(check_relogged_complete, "end", t),
                 on_node=lambda t: run_check(check_relogged_after_loss, "loss", t))
    print(f"{scenario.__name__} with relogging and pruning: {ex.interleavings} interleavings, {ex.nodes} "
          f"intermediate states checked, {time.monotonic() - t0:.1f}s, {len(findings)} findings")
    return ex, findings


@pytest.fixture
def client(redis_url: str, redis_server: Any) -> redis.Redis:
    return redis_server.client()


# redelivery and put_outside_syncpoint take 60-80 s each on 2 cores (about 2000 schedules, 5000 states): soak.
@pytest.mark.slow
@pytest.mark.parametrize("scenario", [lifecycle, pytest.param(redelivery, marks=pytest.mark.soak), get_before_backup,
                                      pytest.param(put_outside_syncpoint, marks=pytest.mark.soak), expiry],
                         ids=lambda s: s.__name__)
def test_relogging_and_pruning_lose_nothing_under_any_interleaving(client: redis.Redis, scenario: Scenario) -> None:
    ex, findings = check(client, scenario)
    assert not findings, "\n".join(findings[:3])
    assert ex.interleavings > 10 and ex.nodes > ex.interleavings


def test_checker_catches_a_window_that_starts_too_late(client: redis.Redis) -> None:
    ex, findings = check(client, lifecycle, RelogMutation(window_at_end=True), stop_at_first=True)
    assert findings and "lost" in findings[0], findings[:1]
