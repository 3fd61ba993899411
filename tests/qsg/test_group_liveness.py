"""The local group stays up: its supervisor restarts a member that was killed or fenced and a CF that hangs,
`cfemu cluster restart|stop` for an operator, the CLI's own member keeps its lease, and every `cfemu` verb's
numbers and exit codes (2: usage, 75: retry later). Real processes (a detached `cfemu cluster up` in a temporary
directory), every one of them stopped by pid at the end.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu.errors import BackupRunningError, NoMessageError, StructureFailedError, UnknownObjectError
from cfemu.procs import pid_alive
from qsg import cli, group_supervisor
from qsg.cli_common import EXIT_RETRY_LATER, EXIT_USAGE, exit_code
from qsg.group_supervisor import (
    MEMBER_HUNG_AFTER_S,
    RESTART_FIRST_DELAY_S,
    RESTART_MAX_DELAY_S,
    RESTART_RESET_AFTER_S,
    Supervisor,
)
from qsg.local_group import LocalGroup
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError, QueueManagerUnavailableError
from tests.qsg.test_local_group import ROOT, cfemu


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(every)


class Detached:
    """A detached group (`cfemu cluster up`) and every pid it ever had, all stopped (by pid) at the end."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.pids: set[int] = set()

    def up(self, *args: str) -> dict[str, Any]:
        try:
            doc = json.loads(cfemu("cluster", "up", "--dir", str(self.d), "--json", *args, timeout=120).stdout)
        finally:
            self.note_pids()
        return doc

    def status(self) -> dict[str, Any]:
        doc = json.loads(cfemu("cluster", "status", "--dir", str(self.d), "--json", check=False).stdout)
        self.note_pids()
        return doc

    def row(self, process: str) -> dict[str, Any]:
        return next(p for p in self.status()["processes"] if p["process"] == process)

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.d / "cluster.json").read_text()))

    def note_pids(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            state = self.state()
            for proc in [state["cf"], *state["managers"], state.get("scheduler") or {},
                         state.get("cf_supervisor") or {}]:
                if proc.get("pid"):
                    self.pids.add(int(proc["pid"]))

    def endpoint(self, name: str) -> str:
        m = next(m for m in self.state()["managers"] if m["name"] == name)
        return f"127.0.0.1:{m['port']}"

    def token(self) -> str:
        token = LocalGroup.load(self.d).token
        assert token
        return token

    def serves(self, name: str) -> bool:
        """A put and a get through this member's service."""
        try:
            with Client([self.endpoint(name)], token=self.token(), reconnect_timeout=0) as c:
                c.put("Q1", f"through {name}".encode(), syncpoint=False)
                return c.get("Q1", syncpoint=False).body == f"through {name}".encode()
        except Exception:  # noqa: BLE001 - not serving (yet)
            return False

    def down(self) -> None:
        self.note_pids()
        with contextlib.suppress(Exception):
            cfemu("cluster", "down", "--dir", str(self.d), "--timeout", "5", check=False)
        for pid in self.pids:  # whatever down did not stop (a failed test's leftovers)
            if pid_alive(pid):
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Detached]:
    g = Detached(tmp_path / "cluster")
    try:
        yield g
    finally:
        g.down()
        assert not [pid for pid in g.pids if pid_alive(pid)], "a process of the group survived"


# --- the supervisor with real processes --------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_or_fenced_member_is_restarted_and_an_operator_stopped_one_is_not(group: Detached) -> None:
    up = group.up("--managers", "2", "--backup-interval", "0", "--lease-ms", "1000")
    assert [p["process"] for p in up["processes"]] == ["CF", "QM1", "QM2", "cf-supervisor"]
    assert "dead or fenced members" in up["processes"][-1]["address"]
    assert group.serves("QM2")

    # kill -9: serving again within a bound, the restart in status (table and JSON) and in the logs
    first = group.row("QM2")
    t0 = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    wait_for("QM2 restarted and serving", lambda: group.row("QM2")["restarts"] == 1 and group.serves("QM2"), 30)
    assert time.monotonic() - t0 < 30
    row = group.row("QM2")
    assert row["pid"] != first["pid"] and row["alive"] and row["ready"]
    assert "killed by a signal" in row["last_restart"]["reason"], row
    table = cfemu("cluster", "status", "--dir", str(group.d)).stdout
    assert "restarts" in table and "killed by a signal" in table
    assert "restarted QM2" in (group.d / "run" / "cf-supervisor.log").read_text()
    assert "QM2 restarted by the supervisor (restart 1)" in (group.d / "run" / "QM2.log").read_text()

    # held past its lease: its peer fences it, it exits 3 when it wakes, and is restarted for that reason
    pid = group.row("QM2")["pid"]
    recoveries = (group.d / "run" / "QM1.log").read_text().count("recovered QM2")  # the kill's
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for("QM1 recovered QM2", lambda: (group.d / "run" / "QM1.log").read_text().count("recovered QM2")
                 > recoveries, 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for("QM2 restarted after it was fenced", lambda: group.row("QM2")["restarts"] == 2, 30)
    assert group.row("QM2")["last_restart"]["reason"] == "was fenced by peer recovery (exit 3)"
    wait_for("QM2 serving again", lambda: group.serves("QM2"), 30)

    # held for good (hung): its process runs, fenced, never wakes to exit; SIGKILLed once it has held no lease for
    # MEMBER_HUNG_AFTER_S, and restarted (it was left alive and not ready for as long as it stayed stopped)
    hung = group.row("QM2")["pid"]
    os.kill(hung, signal.SIGSTOP)
    wait_for("QM2 killed as hung and restarted", lambda: group.row("QM2")["restarts"] == 3,
             MEMBER_HUNG_AFTER_S + 45)
    assert not pid_alive(hung)
    reason = group.row("QM2")["last_restart"]["reason"]
    assert reason.startswith("was hung: no lease in the CF for") and "SIGKILLed" in reason, reason
    wait_for("QM2 serving again after the hang", lambda: group.serves("QM2"), 30)

    # an operator's stop is not undone by the supervisor; the operator's restart brings it back
    stopped = json.loads(cfemu("cluster", "stop", "QM2", "--dir", str(group.d), "--json").stdout)
    assert stopped["stopped_by"] == "SIGTERM"
    time.sleep(RESTART_FIRST_DELAY_S * 8 + 1)  # longer than the delay its next restart would have (fourth: 8 s)
    row = group.row("QM2")
    assert not row["alive"] and row["restarts"] == 3 and row["held"] == "stopped by the operator"
    assert cfemu("cluster", "status", "--dir", str(group.d), check=False).returncode == 1
    again = json.loads(cfemu("cluster", "restart", "QM2", "--dir", str(group.d), "--json").stdout)
    assert again["stopped_by"] == "was not running" and again["pid"] != row["pid"]
    assert group.serves("QM2") and group.row("QM2")["held"] is None

    # down stops the supervisor first: nothing it stops is restarted
    down = json.loads(cfemu("cluster", "down", "--dir", str(group.d), "--json").stdout)
    assert down["still_running"] == {} and down["killed_after_timeout"] == {}
    time.sleep(1.5)
    assert [m.get("restarts") or 0 for m in group.state()["managers"]] == [0, 3]
    assert not any(pid_alive(pid) for pid in group.pids)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_hung_cf_is_killed_and_restarted_and_cluster_restart_end_to_end(group: Detached) -> None:
    group.up("--managers", "2", "--backup-interval", "1", "--lease-ms", "2000")
    with Client([group.endpoint("QM1")], token=group.token()) as c:
        c.put("Q1", b"kept", syncpoint=False)
    wait_for("a backup holding the message", lambda: list((group.d / "backups").glob("APP1/*/manifest.json")), 60)
    time.sleep(1.5)  # one more backup, taken after the put
    wait_for("a newer backup", lambda: len(list((group.d / "backups").glob("APP1/*/manifest.json"))) >= 2, 60)

    # the CF stops answering (SIGSTOP): killed (never resumed) and restarted empty; RECAUTO restores APP1
    cf_pid = group.row("CF")["pid"]
    os.kill(cf_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    row = wait_for("the hung CF restarted", lambda: (r := group.row("CF"))["restarts"] == 1 and r["alive"] and r, 30)
    assert time.monotonic() - t0 < 20
    assert row["pid"] != cf_pid and not pid_alive(cf_pid)
    reason = row["last_restart"]["reason"]
    assert reason.startswith("hung: no answer to PING in ") and reason.endswith("SIGKILLed"), reason
    log = (group.d / "run" / "cf-supervisor.log").read_text()
    assert "did not answer PING" in log and "is hung" in log

    def kept_message_back() -> bool:
        try:
            with Client([group.endpoint("QM2")], token=group.token(), reconnect_timeout=0) as c:
                return c.get("Q1", syncpoint=False).body == b"kept"
        except Exception:  # noqa: BLE001 - the structure is still being restored
            return False

    wait_for("the group serving again, the message restored", kept_message_back, 90, every=0.5)
    assert group.serves("QM1") and group.serves("QM2")

    # an operator's restart: stopped gracefully, started, serving when it returns, with how long it took
    before = group.row("QM1")["pid"]
    r = cfemu("cluster", "restart", "QM1", "--dir", str(group.d))
    assert "QM1 restarted in" in r.stdout and "stopped (SIGTERM)" in r.stdout and f"pid {before} ->" in r.stdout
    doc = json.loads(cfemu("cluster", "restart", "QM1", "--dir", str(group.d), "--json").stdout)
    assert doc["member"] == "QM1" and doc["stopped_by"] == "SIGTERM" and doc["seconds"] > 0
    assert doc["seconds"] >= doc["start_seconds"] and doc["pid"] != doc["old_pid"]
    assert not pid_alive(before)
    row = group.row("QM1")
    assert row["pid"] == doc["pid"] and row["ready"] and row["restarts"] == 0  # an operator's restart is not counted
    assert group.serves("QM1")
    bad = cfemu("cluster", "restart", "QM7", "--dir", str(group.d), check=False)
    assert bad.returncode == EXIT_USAGE and "no queue manager QM7" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_a_cf_busy_with_a_long_script_is_not_taken_for_hung(tmp_path: Path) -> None:
    """Redis answers nothing while a script runs, then BUSY once it has run 5 s: longer than the supervisor's
    three probes, shorter than the silence it takes for hung. The CF is left alone."""
    c = LocalGroup.up(tmp_path / "c", managers=1, backup_interval=None, lease_ms=30000, restart_cf=True)
    try:
        pid = c.state["cf"]["pid"]
        client = redis.Redis.from_url(c.cf_url("operator"), socket_timeout=30)
        spin = ("local t = redis.call('TIME') while true do local n = redis.call('TIME') "
                "if tonumber(n[1]) - tonumber(t[1]) >= 8 then return 1 end end")
        assert client.eval(spin, 0) == 1  # 8 s without an answer to anyone, BUSY from the 5th on
        time.sleep(1.0)
        assert c.state["cf"]["pid"] == pid and c.cf_restarts == 0 and c.cf_alive()
    finally:
        c.down()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_that_keeps_the_cf_busy_is_killed_and_one_that_wrote_gets_the_cf_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone holding a role's CF password (here the member's) sends a script that never ends: every call gets
    BUSY from its 5th second. No role but the operator may SCRIPT KILL, and none may FCALL; the supervisor (as the
    operator) ends the script once the CF has answered BUSY for CF_BUSY_KILL_AFTER_S (shortened here), and the
    CF goes on as it was (same process, same data). A script that wrote before it looped cannot be killed
    (UNKILLABLE): the CF is SIGKILLed and restarted like a hung one."""
    monkeypatch.setattr(group_supervisor, "CF_BUSY_KILL_AFTER_S", 1.0)
    monkeypatch.setattr(group_supervisor, "CF_BUSY_GRACE_S", 2.0)
    caplog.set_level(logging.WARNING, logger="qsg.group_supervisor")
    c = LocalGroup.up(tmp_path / "c", managers=1, backup_interval=None, lease_ms=30000, restart_cf=True)
    try:
        pid = c.state["cf"]["pid"]
        member = redis.Redis.from_url(c.cf_url("member"), socket_timeout=60)
        for refused in (lambda: member.script_kill(), lambda: member.execute_command("FCALL", "f", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        operator = redis.Redis.from_url(c.cf_url("operator"), socket_timeout=5)
        operator.set("kept", b"1")

        def runs_until_stopped(script: str, keys: int) -> tuple[float, str]:
            t0 = time.monotonic()
            try:
                member.eval(script, keys, *(["{probe}:x"] * keys))
                return time.monotonic() - t0, "returned"
            except redis.exceptions.RedisError as e:
                return time.monotonic() - t0, str(e)

        took, why = runs_until_stopped("while true do end", 0)
        assert "killed" in why.lower() and took < 20, (took, why)
        assert c.state["cf"]["pid"] == pid and c.cf_restarts == 0 and operator.get("kept") == b"1"
        # the supervisor says so once SCRIPT KILL has returned to it, which may be after the script's caller heard
        wait_for("the supervisor's line", lambda: "the script running was ended with SCRIPT KILL" in caplog.text, 10)

        took, why = runs_until_stopped("redis.call('SET', KEYS[1], 1) while true do end", 1)
        assert took < 30, (took, why)
        wait_for("the CF restarted", lambda: c.cf_restarts == 1 and c.cf_alive(), 30)
        assert c.state["cf"]["pid"] != pid and not pid_alive(pid)
        reason = c.state["cf"]["last_restart"]["reason"]
        assert reason.startswith("hung: BUSY for") and "UNKILLABLE" in reason and reason.endswith("SIGKILLed")
    finally:
        c.down()


# --- the supervisor's rules, with a group of stubs ---------------------------------------------------------------
class StubGroup:
    """What the supervisor uses of a LocalGroup, over processes that exist only here."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"managers": [{"name": "QM1", "pid": 100}], "member_restart": True,
                                      "cf_restart": False}
        self.alive = True
        self.ready = True
        self.spawned = 0

    @contextlib.contextmanager
    def state_lock(self) -> Iterator[None]:
        yield

    def manager(self, name: str) -> dict[str, Any]:
        return dict(self.state["managers"][0])

    def manager_runs(self, name: str) -> bool:
        return self.alive

    def ready_pid(self, name: str) -> int | None:
        return int(self.state["managers"][0]["pid"]) if self.ready else None

    def exit_reason(self, name: str, pid: int) -> str:
        return "was killed by SIGKILL"

    def note_in_member_log(self, name: str, text: str) -> None:
        pass

    def spawn_manager(self, name: str) -> None:
        self.spawned += 1
        self.state["managers"][0]["pid"] = 100 + self.spawned
        self.alive = True

    def set_manager(self, name: str, **values: Any) -> None:
        self.state["managers"][0].update(values)

    def save_state(self) -> None:
        pass


def test_restart_delays_double_up_to_the_maximum_and_start_again_after_a_member_served() -> None:
    g = StubGroup()
    now = [1000.0]
    sup = Supervisor(g, reload=False, clock=lambda: now[0])  # type: ignore[arg-type]

    def die_and_restart() -> float:
        """The member dies; the delay until the supervisor starts it again."""
        sup.tick()  # seen alive
        g.alive = False
        sup.tick()  # seen dead: the restart is due after the delay
        start, spawned = now[0], g.spawned
        while g.spawned == spawned:
            now[0] += 0.25
            sup.tick()
        return now[0] - start

    delays = [die_and_restart() for _ in range(7)]
    assert delays == [RESTART_FIRST_DELAY_S * 2**i for i in range(5)] + [RESTART_MAX_DELAY_S] * 2
    assert g.state["managers"][0]["restarts"] == 7
    assert g.state["managers"][0]["last_restart"]["reason"] == "was killed by SIGKILL"
    sup.tick()  # serving (its ready file names its pid) ...
    now[0] += RESTART_RESET_AFTER_S
    sup.tick()  # ... long enough: the next death is restarted after the first delay again
    assert die_and_restart() == RESTART_FIRST_DELAY_S
    g.state["managers"][0]["held"] = "stopped by the operator"  # held: never restarted
    g.alive = False
    for _ in range(200):
        now[0] += 1
        sup.tick()
    assert g.spawned == 8


def test_the_restart_reasons_are_sqm_runs_exit_codes() -> None:
    from sqm.service import server

    assert group_supervisor.describe_exit(server.EXIT_FENCED) == "was fenced by peer recovery (exit 3)"
    assert group_supervisor.describe_exit(server.EXIT_LOG_FAILED) == ("its record log failed (exit 4: it could not "
                                                                       "write it, or read it at restart)")
    assert group_supervisor.describe_exit(server.EXIT_CONFIG) == "refused its configuration (exit 2)"
    assert group_supervisor.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert group_supervisor.describe_exit(9) == "exited 9"


def test_a_member_under_a_group_records_its_exit_status(tmp_path: Path) -> None:
    exit_file = tmp_path / "QM1.exit"
    env = {**os.environ, group_supervisor.EXIT_FILE_ENV: str(exit_file)}
    r = subprocess.run([sys.executable, "-m", "qsg.member", "run", "--name", "QM1", "--lease-ms", "10"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 2
    doc = json.loads(exit_file.read_text())
    assert doc["code"] == 2 and doc["pid"] > 0


# --- the CLI's in-process member ----------------------------------------------------------------------------------
@pytest.mark.timed
@pytest.mark.slow
def test_a_put_longer_than_the_lease_keeps_its_lease_and_a_later_get_is_fast(tmp_path: Path) -> None:
    c = LocalGroup.up(tmp_path / "c", managers=1, backup_interval=None, lease_ms=1500)  # the peer that would fence
    try:
        where = ("--cluster-dir", str(c.dir), "--lease-ms", "1500")
        t0 = time.monotonic()
        r = cfemu("put", "Q1", "x", "--count", "50000", "--per-commit", "10000", *where, check=False, timeout=300)
        took = time.monotonic() - t0
        assert r.returncode == 0 and "put 50000 message(s) on Q1 (committed)" in r.stdout, (r.stdout, r.stderr)
        assert took > 3 * 1.5, f"the put took {took:.1f}s: not longer than the lease, nothing shown"
        peer_log = (c.dir / "run" / "QM1.log").read_text()
        assert "recovered OPS" not in peer_log and "OPS holds a lease again" not in peer_log, peer_log[-2000:]
        assert "stale" not in r.stderr
        t0 = time.monotonic()
        got = json.loads(cfemu("get", "Q1", "--json", *where).stdout)
        assert got["count"] == 1 and time.monotonic() - t0 < 5.0
        assert "recovered OPS" not in (c.dir / "run" / "QM1.log").read_text()
    finally:
        c.down()


# --- numbers and exit codes of every verb -------------------------------------------------------------------------
BAD_NUMBERS = [
    (["put", "Q1", "x", "--count", "-5"], "--count: must be a whole number from 1 to 10000000, not -5"),
    (["put", "Q1", "x", "--count", "0"], "--count"),
    (["put", "Q1", "x", "--count", "many"], "--count: must be a whole number from 1 to 10000000, not 'many'"),
    (["put", "Q1", "x", "--priority", "10"], "--priority: must be a whole number from 0 to 9"),
    (["put", "Q1", "x", "--lease-ms", "100"], "--lease-ms"),
    (["get", "Q1", "--count", "0"], "--count"),
    (["get", "Q1", "--wait-ms", "-1"], "--wait-ms"),
    (["browse", "Q1", "--limit", "0"], "--limit"),
    (["cluster", "up", "--managers", "0"], "--managers: must be a whole number from 1 to 32"),
    (["cluster", "up", "--managers", "33"], "--managers"),
    (["cluster", "up", "--backup-interval", "-1"], "--backup-interval"),
    (["cluster", "up", "--lease-ms", "0"], "--lease-ms"),
    (["cluster", "up", "--spark", "-1"], "--spark"),
    (["cluster", "up", "--spark-cores", "0"], "--spark-cores"),
    (["cluster", "up", "--redis-cluster", "17"], "--redis-cluster"),
    (["cluster", "down", "--timeout", "-1"], "--timeout"),
    (["cluster", "restart", "QM1", "--start-timeout", "0"], "--start-timeout"),
    (["cluster", "up", "--backup-interval", "nan"], "--backup-interval"),
    (["define", "structure", "A", "--max-entries", "-1"], "--max-entries"),
    (["define", "structure", "A", "--max-bytes", "-1"], "--max-bytes"),
    (["alter", "structure", "A", "--max-entries", "-1"], "--max-entries"),
    (["alter", "structure", "A", "--max-bytes", "-1"], "--max-bytes"),
    (["define", "queue", "Q", "--structure", "A", "--backout-threshold", "-1"], "--backout-threshold"),
    (["define", "queue", "Q", "--structure", "A", "--max-msg-length", "0"], "--max-msg-length"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--max-uows", "-1"], "--max-uows"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--max-messages", "0"], "--max-messages"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--uow-lifetime", "0"], "--uow-lifetime"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--status-lifetime", "255"], "--status-lifetime"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--postpone-attempts", "-1"], "--postpone-attempts"),
    (["define", "queue", "Q", "--structure", "A", "--uow", "--postpone-delay", "-1"], "--postpone-delay"),
    (["cf", "start", "--port", "70000"], "--port"),
    (["secrets", "init", "--dir", "d", "--acl-owner", "-1"], "--acl-owner"),
    (["migrate", "load", "A", "--batch", "0"], "--batch"),
    (["demo", "--seconds", "0"], "--seconds: must be a number > 0, not 0"),
    (["demo", "--managers", "0"], "--managers"),
    (["demo", "--clients", "0"], "--clients"),
    (["demo", "--redis-cluster", "-1"], "--redis-cluster"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_NUMBERS, ids=[" ".join(a) for a, _ in BAD_NUMBERS])
def test_a_bad_number_is_a_one_line_usage_error(argv: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cfemu ") and "error: argument " in err and needle in err, err


def test_usage_errors_and_retry_later_have_their_own_exit_codes(redis_url: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    dead = "redis://127.0.0.1:1/0"  # nothing listens there
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    assert cli.main(["status", "--redis-url", dead]) == EXIT_RETRY_LATER
    assert cli.main(["put", "Q1", "x", "--redis-url", dead, "--log-root", str(tmp_path / "logs")]) == EXIT_RETRY_LATER
    assert cli.main(["put", "NOQ", "x", *where]) == EXIT_USAGE  # the same command meets it again: fix it
    errs = capsys.readouterr().err.splitlines()
    assert len(errs) == 3 and all(e.startswith("cfemu: error: ") for e in errs), errs
    # what each kind of error is
    assert exit_code(BackupRunningError("structure APP1: backup running")) == EXIT_RETRY_LATER
    assert exit_code(StructureFailedError("the CF is unavailable")) == EXIT_RETRY_LATER
    unknown = StructureFailedError("the reply was lost")
    unknown.maybe_applied = True  # it may have been applied: look before trying again
    assert exit_code(unknown) == EXIT_USAGE
    assert exit_code(QueueManagerUnavailableError("no queue manager answered")) == EXIT_RETRY_LATER
    assert exit_code(NotAuthorizedError("no token")) == EXIT_USAGE
    assert exit_code(UnknownObjectError("queue NOQ")) == EXIT_USAGE
    assert exit_code(NoMessageError("empty")) == EXIT_USAGE
    assert exit_code(ValueError("bad name")) == EXIT_USAGE


def test_no_server_answering_is_retry_later(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through --server, the client tries every endpoint for its reconnect timeout (15 s; 1 s here: the outcome is
    what is checked) first."""
    monkeypatch.setattr(Client, "__init__", functools.partialmethod(Client.__init__, reconnect_timeout=1.0))
    t0 = time.monotonic()
    assert cli.main(["put", "Q1", "x", "--server", "127.0.0.1:1", "--token", "t"]) == EXIT_RETRY_LATER
    assert time.monotonic() - t0 >= 1.0  # it tried for its reconnect timeout
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MQRC_Q_MGR_NOT_AVAILABLE" in err, err
