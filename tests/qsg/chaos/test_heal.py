"""The runner's final heal (qsg.chaos.runner.heal) restarts dead members: after a peer recovered each while one runs,
at once when none runs (nobody would recover them: a wait for it only held the group down, and the liveness rule
found every member serving 30 s late). A stub group records what the heal did."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from qsg.chaos import runner


class StubCluster:
    def __init__(self, running: set[str]) -> None:
        self.processes = {name: 100 + i for i, name in enumerate(sorted(running))} | {"CF": 1}
        self.calls: list[str] = []

    def running_processes(self) -> dict[str, int]:
        return dict(self.processes)

    def restart_manager(self, name: str, timeout: float) -> None:
        self.calls.append(f"restart {name}")
        self.processes[name] = 200


class StubGroup:
    names = ("QM1", "QM2", "QM3")

    def __init__(self, running: set[str]) -> None:
        self.c = StubCluster(running)
        self.backups_paused = None
        self.disk = None
        self.stopped: set[str] = set()

    def heal_network(self) -> None:
        pass

    def running(self, name: str) -> bool:
        return name in self.c.running_processes()

    def wait_peer_recovered(self, name: str, timeout: float) -> bool:
        self.c.calls.append(f"wait for {name}'s peer recovery")
        return True


@pytest.fixture(autouse=True)
def _no_member_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "reconnect_pstores", lambda group: [])
    monkeypatch.setattr(runner, "after_heal", lambda group, name, step: None)


def history() -> Any:
    return SimpleNamespace(note=lambda **fields: None)


def test_every_member_dead_is_restarted_at_once() -> None:
    g = StubGroup(running=set())
    actions = runner.heal(g, history())  # type: ignore[arg-type]
    # the first restarted without a wait (none ran to recover it); the others then have a peer that does
    assert g.c.calls == ["restart QM1", "wait for QM2's peer recovery", "restart QM2",
                         "wait for QM3's peer recovery", "restart QM3"]
    assert actions == ["QM1 restarted", "QM2 restarted", "QM3 restarted"]


def test_a_dead_member_with_a_peer_running_waits_for_its_recovery() -> None:
    g = StubGroup(running={"QM1", "QM3"})
    runner.heal(g, history())  # type: ignore[arg-type]
    assert g.c.calls == ["wait for QM2's peer recovery", "restart QM2"]
