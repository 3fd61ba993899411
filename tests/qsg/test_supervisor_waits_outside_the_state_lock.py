"""The supervisor SIGKILLs a hung member (served, then no lease in the CF for MEMBER_HUNG_AFTER_S while its process
runs) under the group's state lock, and waits for it to be gone only once the lock is released: a status, an
operator's stop or another member's restart, which all take the lock, answer meanwhile. The member is then restarted
once, after its delay. A real CF (the leases are read there), a real member process, the supervisor's rules over the
stub group of tests.qsg.test_group_liveness with a real lock.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cfemu.settings import CLUSTER_CF
from qsg import group_supervisor
from qsg.group_supervisor import MEMBER_HUNG_AFTER_S, RESTART_FIRST_DELAY_S, Supervisor
from tests.qsg.test_group_liveness import StubGroup
from tests.support.started_procs import started

PROMPT_S = 0.5  # what a caller of the state lock may wait while the supervisor waits for a killed member


class LockedGroup(StubGroup):
    """The stub group with a real state lock, over a real CF and a real member process (QM1)."""

    duplexed = False

    def __init__(self, cf_url: str, cf_pid: int, member: subprocess.Popen[bytes]) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.url = cf_url
        self.member = member
        self.state["managers"][0]["pid"] = member.pid
        self.state["cf_restart"] = True
        self.state[CLUSTER_CF] = {"pid": cf_pid}

    @contextlib.contextmanager
    def state_lock(self) -> Iterator[None]:
        with self.lock:
            yield

    def manager_runs(self, name: str) -> bool:
        if self.state["managers"][0]["pid"] == self.member.pid:
            return self.member.poll() is None
        return self.alive  # one the supervisor restarted (StubGroup.spawn_manager)

    def cf_alive(self) -> bool:
        return True

    def cf_url(self, role: str = "operator") -> str:
        return self.url

    def restart_dead_cf(self, reason: str = "died") -> bool:
        return False


def test_a_hung_member_is_waited_for_outside_the_state_lock_and_restarted_once(
        redis_server: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cf = redis_server.client()
    try:
        cf_pid = int(cf.info("server")["process_id"])
    finally:
        cf.close()
    member = started(subprocess.Popen(["sleep", "120"]))
    g = LockedGroup(redis_url, cf_pid, member)

    answered: list[bool] = []  # for each wait: whether a status query took the state lock within PROMPT_S
    real_wait_gone = group_supervisor.wait_gone

    def wait_gone_meeting_a_status_query(pid: int, timeout: float) -> bool:
        def status_query() -> None:  # another thread, as `cfemu cluster status` or an operator's stop would be
            took = g.lock.acquire(timeout=PROMPT_S)
            if took:
                g.lock.release()
            answered.append(took)

        asker = threading.Thread(target=status_query)
        asker.start()
        asker.join()
        return real_wait_gone(pid, timeout)

    monkeypatch.setattr(group_supervisor, "wait_gone", wait_gone_meeting_a_status_query)
    now = [1000.0]
    sup = Supervisor(g, reload=False, clock=lambda: now[0])  # type: ignore[arg-type]
    try:
        sup.tick()  # QM1 is tended from now on: its lease is read at the next interval
        sup.tick()  # serving, with no lease in the CF: leaseless from now
        assert sup.leases == set() and answered == []
        now[0] += MEMBER_HUNG_AFTER_S
        sup.tick()  # hung: SIGKILLed, and waited for with the state lock free
        assert answered == [True]
        assert member.wait(timeout=5) == -signal.SIGKILL
        for _ in range(int(4 * RESTART_FIRST_DELAY_S) + 8):  # restarted after its first delay, and once only
            now[0] += 0.25
            sup.tick()
        assert g.spawned == 1
        assert g.state["managers"][0]["restarts"] == 1
        assert g.state["managers"][0]["last_restart"]["reason"].startswith("was hung: no lease in the CF for 15s")
        assert answered == [True]
    finally:
        sup._close_ping()
