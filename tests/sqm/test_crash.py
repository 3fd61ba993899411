"""kill -9 of a queue manager process mid-UOW, peer recovery, restart recovery, and fencing of a paused member.

Each case runs tests/support/sqm_child.py as a real process with one failpoint armed (sqm.core.failpoints: a real SIGKILL at
that line), then checks, against the real redis-server, that a live peer recovers the dead member within a
bounded time, that the UOW took effect all or nothing (the log decides: once its COMMIT is forced it is
committed), that nothing committed was lost and nothing consumed twice, and that the dead member's own restart
afterwards changes nothing and leaves a working queue manager.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cfemu.errors import NoMessageError
from sqm.core.failpoints import parse_failpoints
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm
from tests.support.waits import sigstop

REPO = Path(__file__).resolve().parents[2]
COUNT = 6  # messages per UOW
LEASE_MS = 1000
RECOVERY_BOUND_S = 5.0  # lease 1 s + the peer's 0.2 s housekeeping period + the recovery itself, with slack
CHILD_TIMEOUT_S = 60.0
DEAD = "QM2"


def define_two_structures(url: str) -> None:
    """Q1 on APP1 and Q2 on APP2: one UOW spans two structures, so a crash can fall between them."""
    define_group(url, structure="APP1", queues=("Q1",))
    define_group(url, structure="APP2", queues=("Q2",))


class Child:
    """tests/support/sqm_child.py in its own process; its stdout lines are collected by a reader thread."""

    def __init__(self, url: str, log_root: Path, scenario: str, failpoints: str = "", stdin: bool = False,
                 logload: int = 10_000, count: int = COUNT) -> None:
        env = dict(os.environ)
        env.pop("SQM_FAILPOINTS", None)
        if failpoints:
            env["SQM_FAILPOINTS"] = failpoints
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.sqm_child", "--redis-url", url, "--log-root", str(log_root),
             "--name", DEAD, "--scenario", scenario, "--count", str(count), "--lease-ms", str(LEASE_MS),
             "--logload", str(logload)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 20.0) -> str:
        """Wait for the next stdout line that starts with prefix."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"child never printed {prefix!r}; it printed {self.seen}; {self.stderr_tail()}")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def wait(self, timeout: float = CHILD_TIMEOUT_S) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return rc

    def stderr_tail(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(child still running)"
        return "stderr: " + self.proc.stderr.read()[-2000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a stopped process
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@dataclass(frozen=True)
class Case:
    scenario: str
    failpoint: str  # SQM_FAILPOINTS value
    committed: bool  # the outcome the log decides
    last_line: str  # what the child printed last before it died (proves where it died)
    logload: int = 10_000


CASES = [
    Case("put", "before-log-force", False, "committing"),
    Case("put", "after-log-force", True, "committing"),
    Case("put", "during-apply", True, "committing"),
    # The COMMIT record is the LOGLOAD-th record since the start checkpoint: a checkpoint taken right after it
    # must not record the UOW as in flight (restart reads only from that checkpoint on).
    Case("put", "after-log-force", True, "committing", logload=COUNT + 1),
    Case("put", "put-after-cf=3", False, "put 1"),
    Case("put-backout", "backout-after-log", False, "backing out"),
    Case("get", "before-log-force", False, "committing"),
    Case("get", "after-log-force", True, "committing"),
    Case("get", "during-apply", True, "committing"),
    Case("get", "put-after-cf=2", False, "got seed-1 backout_count=0"),
    Case("get-backout", "backout-after-log", False, "backing out"),
]


def visible(qm: QueueManager) -> dict[str, list[tuple[str, int]]]:
    """The committed messages of each queue as sorted (body, backout count) pairs."""
    conn = qm.connect()
    return {q: sorted((m.body.decode(), m.backout_count) for m in conn.browse(q, limit=1000)) for q in ("Q1", "Q2")}


def locked(qm: QueueManager) -> int:
    """Entries still held by some UOW (uncommitted puts and gets) on either structure."""
    return sum(d["UP"] + d["UG"] for s in ("APP1", "APP2") for d in qm.structure(s).depths().values())


def expected(case: Case, got: list[str]) -> dict[str, list[tuple[str, int]]]:
    """What the queues must hold after recovery. got: the seed messages the child's UOW had got."""
    if case.scenario.startswith("put"):
        if not case.committed:
            return {"Q1": [], "Q2": []}
        return {"Q1": sorted((f"put-{i}", 0) for i in range(0, COUNT, 2)),
                "Q2": sorted((f"put-{i}", 0) for i in range(1, COUNT, 2))}
    seeds = [f"seed-{i}" for i in range(COUNT)]
    if case.committed:
        assert sorted(got) == seeds
        return {"Q1": [], "Q2": sorted((f"reply-{s}", 0) for s in seeds)}
    return {"Q1": sorted((s, 1 if s in got else 0) for s in seeds), "Q2": []}


def wait_recovered(peer: QueueManager, since: float) -> float:
    """Seconds from `since` until the peer has recovered the dead member (it is no longer a live member)."""
    deadline = since + RECOVERY_BOUND_S
    while time.monotonic() < deadline:
        if DEAD not in peer.admin.members():
            return time.monotonic() - since
        time.sleep(0.02)
    pytest.fail(f"{peer.name} did not recover {DEAD} within {RECOVERY_BOUND_S}s; status {peer.status()}")


def drain(qm: QueueManager) -> Counter[str]:
    conn = qm.connect()
    bodies: Counter[str] = Counter()
    for q in ("Q1", "Q2"):
        while True:
            try:
                bodies[conn.get(q).body.decode()] += 1
            except NoMessageError:
                break
    conn.commit()
    return bodies


@pytest.fixture
def peer_factory(redis_url: str, tmp_path: Path) -> Iterator[tuple[Path, list[QueueManager]]]:
    """The log root, and the in-process queue managers a test starts (stopped afterwards)."""
    define_two_structures(redis_url)
    started: list[QueueManager] = []
    yield tmp_path / "logs", started
    for qm in started:
        if qm.running:
            qm.stop(checkpoint=not qm.fenced)


def seed(qm: QueueManager) -> None:
    conn = qm.connect()
    for i in range(COUNT):
        conn.put("Q1", f"seed-{i}".encode())
    conn.commit()


@pytest.mark.parametrize("recovered_by", ["peer", "restart"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.scenario}-{c.failpoint}-logload{c.logload}")
def test_kill_9_mid_uow(case: Case, recovered_by: str, redis_url: str,
                        peer_factory: tuple[Path, list[QueueManager]]) -> None:
    log_root, started = peer_factory
    by_peer = recovered_by == "peer"
    # Without peer recovery the peer needs no background work, and a long lease so the child leaves it alone.
    peer = start_qm(redis_url, log_root, "QM1", lease_ms=LEASE_MS if by_peer else 60_000, background=by_peer)
    started.append(peer)
    if case.scenario.startswith("get"):
        seed(peer)
    child = Child(redis_url, log_root, case.scenario, case.failpoint, logload=case.logload)
    try:
        rc = child.wait()
        died = time.monotonic()
        assert rc == -signal.SIGKILL, f"child exited {rc}, printed {child.seen}; {child.stderr_tail()}"
        assert child.seen[-1] == case.last_line
        got = [line.split()[1] for line in child.seen if line.startswith("got ")]
        want = expected(case, got)

        if case.failpoint == "during-apply" and not by_peer:
            # It died between the two structures: APP1 (Q1) has its outcome, APP2 (Q2) still waits for it.
            assert sorted(visible(peer)["Q1"]) == want["Q1"]
            assert sum(d["UP"] for d in peer.structure("APP2").depths().values()) == COUNT // 2 * (
                1 if case.scenario == "put" else 2)
        if by_peer:
            assert wait_recovered(peer, died) < RECOVERY_BOUND_S
            assert peer.counters["peer_recoveries"] == 1
            assert locked(peer) == 0
            assert visible(peer) == want

        # Restart the dead member with its own log (after peer recovery: nothing left to do).
        qm2 = start_qm(redis_url, log_root, DEAD, lease_ms=60_000, background=False)
        started.append(qm2)
        rep = qm2.last_restart
        assert rep.in_doubt == 0 and rep.waiting_for_cf == 0
        assert [name for name, _ in rep.phases] == ["current status rebuild", "forward recovery",
                                                    "backward recovery", "restart cleanup"]
        log_decided = case.failpoint in ("after-log-force", "during-apply", "backout-after-log")
        assert rep.in_commit == (1 if log_decided and case.committed else 0)
        assert rep.in_backout == (1 if log_decided and not case.committed else 0)
        if by_peer or log_decided:
            assert rep.in_flight <= 1  # its unforced PUT/GET records may or may not have reached the disk
        else:
            assert rep.in_flight == 1  # the CF still holds its entries
        assert locked(qm2) == 0
        assert visible(qm2) == want

        # The restarted member works, and a put and get through it leave the queues as they were.
        conn = qm2.connect()
        m = conn.put("Q2", b"after-restart")
        conn.commit()
        assert conn.get("Q2", msgid=m.msgid).body == b"after-restart"
        conn.commit()
        assert visible(peer) == want

        # Nothing committed lost, nothing consumed twice: every message is got exactly once.
        bodies = drain(peer)
        assert all(n == 1 for n in bodies.values()), bodies
        assert sorted(bodies) == sorted(b for q in ("Q1", "Q2") for b, _ in want[q])
    finally:
        child.kill()


def test_paused_member_is_fenced_when_it_wakes(redis_url: str,
                                                peer_factory: tuple[Path, list[QueueManager]]) -> None:
    log_root, started = peer_factory
    peer = start_qm(redis_url, log_root, "QM1", lease_ms=LEASE_MS, background=True)
    started.append(peer)
    child = Child(redis_url, log_root, "pause", stdin=True)
    try:
        child.expect("ready")
        sigstop(child.proc.pid)
        paused = time.monotonic()
        assert wait_recovered(peer, paused) < RECOVERY_BOUND_S
        assert locked(peer) == 0  # its uncommitted put was backed out
        assert visible(peer) == {"Q1": [], "Q2": []}

        os.kill(child.proc.pid, signal.SIGCONT)
        assert child.proc.stdin is not None
        child.proc.stdin.write("go\n")
        child.proc.stdin.flush()
        assert "FencedError" in child.expect("cf-call:")
        assert "FencedError" in child.expect("commit:")
        assert child.expect("fenced=") == "fenced=True"
        assert child.wait() == 0
        assert visible(peer) == {"Q1": [], "Q2": []}  # neither its late CF call nor its commit landed

        qm2 = start_qm(redis_url, log_root, DEAD, lease_ms=60_000, background=False)
        started.append(qm2)
        conn = qm2.connect()
        conn.put("Q1", b"after-restart")
        conn.commit()
        assert [m.body for m in peer.connect().browse("Q1")] == [b"after-restart"]
    finally:
        child.kill()


def test_failpoint_spec_parsing() -> None:
    assert parse_failpoints(" a, b=3 ,") == {"a": 1, "b": 3}
    for bad in ("a=0", "a=x", "=2", "a="):
        with pytest.raises(ValueError, match="SQM_FAILPOINTS: bad failpoint"):
            parse_failpoints(bad)
