"""peer-clock-skew's victim is armed to die after its N-th force of COMMITs; its restart commits units of work of
its own, so with a small N it died while starting and the fault failed, its peer recovery and CF loss never run.
It is now armed again with twice the count, after a peer recovered it (qsg.chaos.faults.members.restart_to_die).
A stub group records the restarts."""

from __future__ import annotations

from typing import Any

import pytest

from qsg.chaos.faults.members import DIE_WHILE_STARTING_TRIES, restart_to_die
from qsg.local_group import LocalGroupError


class StubGroup:
    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.calls: list[str] = []
        self.c = self

    def restart_manager(self, name: str, timeout: float, env: dict[str, str]) -> None:
        self.calls.append(f"restart {name} {env['SQM_FAILPOINTS']}")
        if self.deaths:
            self.deaths -= 1
            raise LocalGroupError(f"{name} exited with status -9 while starting; tail of its log: ...")

    def wait_peer_recovered(self, name: str, timeout: float) -> bool:
        self.calls.append(f"wait for {name}'s peer recovery")
        return True


def steps() -> tuple[list[str], Any]:
    said: list[str] = []
    return said, lambda what, **fields: said.append(what) or 0.0


def test_a_victim_that_dies_while_starting_is_armed_again_with_twice_the_count() -> None:
    g = StubGroup(deaths=2)
    said, step = steps()
    assert restart_to_die(g, "QM1", 3, step) == 12  # type: ignore[arg-type]
    assert g.calls == ["restart QM1 after-log-force=3", "wait for QM1's peer recovery",
                       "restart QM1 after-log-force=6", "wait for QM1's peer recovery",
                       "restart QM1 after-log-force=12"]
    assert len(said) == 2 and "died at the failpoint while starting" in said[0]


def test_a_victim_that_keeps_dying_while_starting_fails_the_fault() -> None:
    g = StubGroup(deaths=DIE_WHILE_STARTING_TRIES)
    with pytest.raises(LocalGroupError, match="while starting"):
        restart_to_die(g, "QM1", 3, steps()[1])  # type: ignore[arg-type]
    assert len([c for c in g.calls if c.startswith("restart")]) == DIE_WHILE_STARTING_TRIES
