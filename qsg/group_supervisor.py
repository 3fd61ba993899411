"""The local group's supervisor: what keeps a ``cfemu cluster`` serving when one of its processes dies or hangs.

Every interval (0.2 s) it tends:

* **the CF.** A dead redis-server is restarted empty on the same port (members re-join it; RECAUTO structures are
  restored by a member). A live one that does not answer ``PING`` within ``CF_PING_TIMEOUT_S`` in
  ``CF_HUNG_AFTER`` probes in a row, over at least ``CF_HUNG_MIN_S`` (a stopped process, a wedged host), is
  SIGKILLed and restarted the same way. Redis answers nothing while a script runs until the script has run its
  busy-reply-threshold (5 s by default), then ``BUSY``: a CF silent for longer than ``CF_HUNG_MIN_S`` is not
  running a script. A ``BUSY`` answer is an answer, but not for ever: the group's own scripts each hold the CF for
  milliseconds (BENCHMARKS.md, "Bounded CF calls"), so a script still running ``CF_BUSY_KILL_AFTER_S`` after the
  first ``BUSY`` (a loop someone holding a CF password sent, a script's bug) is ended with ``SCRIPT KILL`` (the
  operator's CF user may); one that wrote before it looped cannot be (``UNKILLABLE``), nor one that keeps the CF
  busy ``CF_BUSY_GRACE_S`` after the kill: that CF is SIGKILLed and restarted like a hung one (what it held is
  restored). A duplexed CF's pair is tended by
  its controller (qsg.cfpair: degrade, promote, resync), a Redis Cluster CF's dead nodes are restarted.
* **the members** (when the group was started with member restarts, as ``cfemu cluster up`` does). A member
  whose process is gone (killed, crashed, or exited: 3 when peer recovery fenced it, 4 when its log could not be
  written) is started again on its ports after a delay: ``RESTART_FIRST_DELAY_S``, doubled at each death up to
  ``RESTART_MAX_DELAY_S``, and back to the first once a member has served ``RESTART_RESET_AFTER_S`` in a row. A
  member an operator or a caller holds (``cfemu cluster stop``/``restart``, ``LocalGroup.kill_manager``, which
  its caller restarts itself) is left alone, and ``cfemu cluster down`` stops the supervisor before anything else.
  A member whose process runs but is hung (stopped, wedged: it served once since its start, and has held no lease
  in a CF that answers for ``MEMBER_HUNG_AFTER_S``) is SIGKILLed and restarted the same way: a member that loses
  its lease while it runs is fenced and exits by itself (3) at its next heartbeat, so one still there that long
  after is not running. Its peers have recovered its work meanwhile; the kill frees its ports for the restart.
  (Checked where the supervisor probes the CF: a simplex CF it tends.)

Each restart is a warning line in the supervisor's log (``run/cf-supervisor.log`` of a detached cluster), a line
in the member's own ``run/<member>.log``, and in ``cluster.json``: the member's (or the CF's) ``restarts`` count and
``last_restart`` (when, why), which ``cfemu cluster status`` shows. The reason of a member's death is its exit
status when known: the supervisor's own children's from the kernel, others' from the exit file ``python -m
qsg.member`` writes as it exits (a process killed by a signal writes none).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cfemu import keys
from cfemu.latency import Latency
from cfemu.procs import wait_gone
from cfemu.settings import CLUSTER_CF


class SupervisedGroup(Protocol):
    """What the supervisor uses of the group it tends (qsg.local_group.LocalGroup is one)."""

    state: dict[str, Any]

    @property
    def duplexed(self) -> bool: ...

    def state_lock(self) -> Any: ...
    def refresh(self) -> None: ...
    def save_state(self) -> None: ...
    def cf_alive(self) -> bool: ...
    def cf_url(self, role: str = ...) -> str: ...
    def restart_dead_cf(self, reason: str = ...) -> bool: ...
    def manager(self, name: str) -> dict[str, Any]: ...
    def manager_runs(self, name: str) -> bool: ...
    def set_manager(self, name: str, **values: Any) -> None: ...
    def spawn_manager(self, name: str) -> None: ...
    def exit_reason(self, name: str, pid: int) -> str: ...
    def note_in_member_log(self, name: str, text: str) -> None: ...
    def ready_pid(self, name: str) -> int | None: ...

log = logging.getLogger("qsg.group_supervisor")

SUPERVISE_INTERVAL_S = 0.2
RESTART_FIRST_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
RESTART_RESET_AFTER_S = 60.0  # a member that served this long in a row is restarted after the first delay again
CF_PING_TIMEOUT_S = 1.0
CF_HUNG_AFTER = 3  # probes in a row
CF_HUNG_MIN_S = 6.0  # silent at least this long: longer than Redis's default busy-reply-threshold (5 s)
CF_BUSY_KILL_AFTER_S = 10.0  # BUSY this long (a script then ran 15 s: a thousand times any of the group's own)
CF_BUSY_GRACE_S = 5.0  # after SCRIPT KILL: still BUSY this long, the CF is taken for hung
# A running member that served, with no lease in an answering CF this long, is hung: three times the longest lease a
# member takes by default (sqm run --lease-ms 5000), and longer than a CF restarted empty takes to be re-joined.
MEMBER_HUNG_AFTER_S = 15.0
MEMBER_KILL_WAIT_S = 5.0  # how long an interval waits for a member it SIGKILLed as hung to be gone

# The exit codes of ``sqm run`` (sqm.service.server's EXIT_*; `sqm run --help`), as a restart's reason says them.
MEMBER_EXITS = {0: "stopped (exit 0) outside 'cfemu cluster'", 1: "failed (exit 1)",
                2: "refused its configuration (exit 2)", 3: "was fenced by peer recovery (exit 3)",
                4: "its record log failed (exit 4: it could not write it, or read it at restart)"}
EXIT_FILE_ENV = "CFEMU_MEMBER_EXIT_FILE"  # where ``python -m qsg.member`` records its exit status


def describe_exit(code: int) -> str:
    """A member's exit status as a restart's reason: a negative status is the signal that killed it."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return MEMBER_EXITS.get(code, f"exited {code}")


def record_exit(path: str | os.PathLike[str], code: int) -> None:
    """Write a member's exit file (``python -m qsg.member`` as it exits): its pid and exit status."""
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"pid": os.getpid(), "code": code, "at": time.time()}))


def cause_of(reason: str) -> str:
    """A member's restart reason (describe_exit, exit_reason) as a metric's bounded cause label."""
    for word, cause in (("fenced", "fenced"), ("record log", "log_failed"), ("killed", "killed")):
        if word in reason:
            return cause
    return "exited"


class SupervisorCounts:
    """What the supervisor did, for its metrics (qsg.supervisor_metrics): restarts by process and cause, failed
    restarts, the CF's PING times, each tended member's liveness, its own intervals."""

    def __init__(self) -> None:
        self.restarts: Counter[tuple[str, str]] = Counter()  # (process: "CF" or a member, cause)
        self.last_restart: dict[str, float] = {}  # process -> when (epoch seconds)
        self.restart_failures: Counter[str] = Counter()
        self.member_up: dict[str, bool] = {}  # the members it tends (a group started with member restarts)
        self.ping_seconds = Latency()  # the CF's answers to the hang probe (BUSY included)
        self.script_kills = 0  # scripts ended with SCRIPT KILL after CF_BUSY_KILL_AFTER_S of BUSY
        self.tick_seconds = Latency()
        self.tick_failures = 0

    def restarted(self, process: str, cause: str) -> None:
        self.restarts[(process, cause)] += 1
        self.last_restart[process] = time.time()


@dataclass
class _Member:
    """What the supervisor knows of one member between intervals."""

    pid: int | None = None
    serving_since: float | None = None  # monotonic, once its ready file named this pid
    delay: float = RESTART_FIRST_DELAY_S  # before the next restart
    due: float | None = None  # monotonic: when the pending restart runs
    reason: str = ""
    leaseless_since: float | None = None  # monotonic: since when its process runs with no lease in the CF


class Supervisor:
    """Tends one LocalGroup. ``reload``: read cluster.json at every interval (a detached group's supervisor
    process: commands beside it change the file); otherwise the group object is the only truth (a thread). ``cf``:
    tend the CF (None: as the group was started, its ``cf_restart``); members as it was started (``member_restart``).
    """

    def __init__(self, group: SupervisedGroup, *, reload: bool, cf: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.c = group
        self.clock = clock
        self.reload = reload
        self.cf = cf
        self.members: dict[str, _Member] = {}
        self._ping: redis.Redis | None = None
        self._ping_pid: int | None = None
        self.cf_misses = 0
        self.cf_silent_since: float | None = None  # monotonic: the first probe of the misses in a row
        self.cf_busy_since: float | None = None  # monotonic: the first BUSY answer of those in a row
        self.script_killed_at: float | None = None  # monotonic: when SCRIPT KILL was sent in this BUSY spell
        self.counts = SupervisorCounts()
        self.leases: set[str] | None = None  # the tended members holding a lease at this interval (None: unknown)
        self.killed: list[int] = []  # the pids of members SIGKILLed as hung in this interval, not yet waited for

    # --- one interval ------------------------------------------------------------------------------------------
    @property
    def tends_cf(self) -> bool:
        return self.cf if self.cf is not None else bool(self.c.state.get("cf_restart", True))

    def tick(self) -> None:
        hung = self._cf_hung() if self.tends_cf else None  # outside the state lock: a hung CF's probe takes long
        self.leases = self._leases_held() if hung is None else None
        # The state lock when others write cluster.json (a detached group) or when members are tended (the calls
        # that hold one take it); a thread tending only the CF keeps out of their way.
        shared = self.reload or bool(self.c.state.get("member_restart"))
        try:
            with self.c.state_lock() if shared else contextlib.nullcontext():
                if self.reload:
                    self.c.refresh()
                if self.tends_cf:
                    self.tend_cf(hung)
                if self.c.state.get("member_restart"):
                    self.tend_members()
        finally:
            self._wait_for_killed_members()

    # --- the CF ----------------------------------------------------------------------------------------------
    def _cf_hung(self) -> str | None:
        """Why the CF counts as hung now (None: it answers, or it is dead, duplexed or a Redis Cluster)."""
        from qsg import rcluster_cf

        cf = self.c.state.get(CLUSTER_CF) or {}
        if self.c.duplexed or rcluster_cf.is_cluster_cf(cf) or not self.c.cf_alive():
            self._close_ping()
            return None
        pid = int(cf["pid"])
        try:
            if self._ping is None or self._ping_pid != pid:
                self._close_ping()
                self._ping = redis.Redis.from_url(self.c.cf_url("operator"), socket_timeout=CF_PING_TIMEOUT_S,
                                                  socket_connect_timeout=CF_PING_TIMEOUT_S,
                                                  retry=Retry(NoBackoff(), 0))  # one probe, one timeout
                self._ping_pid = pid
            sent = self.clock()
            with self.counts.ping_seconds.time():
                self._ping.ping()
        except redis.exceptions.ResponseError as e:
            self.cf_misses = 0
            self.cf_silent_since = None
            if str(e).startswith("BUSY"):
                return self._cf_busy(pid, sent)
            log.debug("the CF answered PING with %s", e)  # it answers: not hung
            return None
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            self.cf_misses += 1
            if self.cf_silent_since is None:
                self.cf_silent_since = sent
            silent = self.clock() - self.cf_silent_since
            self._close_ping()  # a fresh connection for the next probe: this one may hold a late reply
            log.warning("the CF (pid %s) did not answer PING within %gs (%d in a row, silent %.1fs): %s", pid,
                        CF_PING_TIMEOUT_S, self.cf_misses, silent, e)
            if self.cf_misses >= CF_HUNG_AFTER and silent >= CF_HUNG_MIN_S:
                return (f"hung: no answer to PING in {self.cf_misses} probes of {CF_PING_TIMEOUT_S:g}s in a row "
                        f"({silent:.0f}s); SIGKILLed")
            return None
        self.cf_misses = 0
        self.cf_silent_since = None
        if self.cf_busy_since is not None:
            log.warning("the CF (pid %s) answers again after %.1fs of BUSY", pid, self.clock() - self.cf_busy_since)
        self.cf_busy_since = None
        self.script_killed_at = None
        return None

    def _cf_busy(self, pid: int, sent: float) -> str | None:
        """The CF answered BUSY (a script past its busy-reply-threshold): after CF_BUSY_KILL_AFTER_S of it, the
        script is ended with SCRIPT KILL; a script that cannot be ended (UNKILLABLE: it wrote), or a CF still BUSY
        CF_BUSY_GRACE_S after a kill it did not answer OK (NOTBUSY: a script that ended as it was sent, or a
        function, which SCRIPT KILL cannot end), makes the CF hung (the reason returned)."""
        if self.cf_busy_since is None:
            self.cf_busy_since = sent
            log.warning("the CF (pid %s) answers BUSY: a script has run past its busy-reply-threshold; it is ended "
                        "if it still runs in %gs", pid, CF_BUSY_KILL_AFTER_S)
        busy = self.clock() - self.cf_busy_since
        if busy < CF_BUSY_KILL_AFTER_S:
            return None
        if self.script_killed_at is None:
            self.script_killed_at = self.clock()
            assert self._ping is not None
            try:
                self._ping.script_kill()
            except redis.exceptions.ResponseError as e:
                if str(e).startswith("NOTBUSY"):  # it ended by itself meanwhile
                    return None
                return f"hung: BUSY for {busy:.0f}s, a script SCRIPT KILL cannot end ({e}); SIGKILLed"
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                log.warning("SCRIPT KILL to the CF (pid %s) got no answer: %s", pid, e)
                return None
            self.counts.script_kills += 1
            log.error("the CF (pid %s) was BUSY for %.0fs: the script running was ended with SCRIPT KILL", pid, busy)
            self.cf_busy_since = self.script_killed_at = None  # a BUSY from now on is another script's
            return None
        if self.clock() - self.script_killed_at >= CF_BUSY_GRACE_S:
            return (f"hung: BUSY for {busy:.0f}s, still BUSY {CF_BUSY_GRACE_S:g}s after SCRIPT KILL; "
                    "SIGKILLed")
        return None

    def _leases_held(self) -> set[str] | None:
        """The tended members that hold a lease in the CF now (None: not known: no probe of a CF that answered)."""
        if self._ping is None or self.cf_misses or not self.members:
            return None
        names = sorted(self.members)
        try:
            pipe = self._ping.pipeline(transaction=False)
            for name in names:
                pipe.exists(keys.lease(name))
            found = pipe.execute()
        except redis.exceptions.RedisError as e:
            log.debug("the members' leases could not be read: %s", e)
            return None
        return {name for name, n in zip(names, found, strict=True) if n}

    def _close_ping(self) -> None:
        if self._ping is not None:
            with contextlib.suppress(Exception):
                self._ping.close()
        self._ping = None
        self._ping_pid = None

    def tend_cf(self, hung: str | None = None) -> None:
        if hung is not None:
            pid = (self.c.state.get(CLUSTER_CF) or {}).get("pid")
            if pid and self.c.cf_alive():
                log.error("the CF (pid %s) is %s; it is restarted empty like a CF that died", pid, hung)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
                wait_gone(int(pid), 10.0)  # a child of ours is gone once it is a zombie: restart_dead_cf reaps it
            self.cf_misses = 0
            self.cf_silent_since = None
            self.cf_busy_since = None
            self.script_killed_at = None
            self._close_ping()
        try:
            if self.c.restart_dead_cf(reason=hung or "died"):
                self.counts.restarted("CF", "hung" if hung else "died")
        except Exception as e:  # noqa: BLE001 - e.g. the port is briefly taken: try again at the next interval
            self.counts.restart_failures["CF"] += 1
            log.error("restarting the CF failed (will retry): %s", e)

    # --- the members -----------------------------------------------------------------------------------------
    def tend_members(self) -> None:
        now = self.clock()
        for m in self.c.state["managers"]:
            name = m["name"]
            t = self.members.setdefault(name, _Member())
            if m.get("held"):  # an operator's stop or restart, a caller's kill: not ours to restart
                t.due = None
                t.pid = None
                continue
            pid = m.get("pid")
            if not pid:
                continue
            if self.c.manager_runs(name):
                self.counts.member_up[name] = True
                self._watch_serving(name, t, int(pid), now)
                if not self._hung(name, t, int(pid), now):
                    continue
            self.counts.member_up[name] = False
            if t.due is None:  # just found dead
                t.reason = self.c.exit_reason(name, int(pid))
                t.due = now + t.delay
                log.warning("%s (pid %s) %s; restarting it in %gs", name, pid, t.reason, t.delay)
                t.delay = min(t.delay * 2, RESTART_MAX_DELAY_S)
            if now >= t.due:
                self._restart(m, t)

    def _watch_serving(self, name: str, t: _Member, pid: int, now: float) -> None:
        t.due = None
        if t.pid != pid:
            t.pid, t.serving_since = pid, None
        if t.serving_since is None:
            if self.c.ready_pid(name) == pid:
                t.serving_since = now
        elif now - t.serving_since >= RESTART_RESET_AFTER_S:
            t.delay = RESTART_FIRST_DELAY_S

    def _hung(self, name: str, t: _Member, pid: int, now: float) -> bool:
        """SIGKILL a member that served and has held no lease for MEMBER_HUNG_AFTER_S while its process runs (its
        restart then follows as for a member that died); True when it was killed."""
        if self.leases is None or t.serving_since is None or name in self.leases:
            t.leaseless_since = None
            return False
        if t.leaseless_since is None:
            t.leaseless_since = now
            return False
        silent = now - t.leaseless_since
        if silent < MEMBER_HUNG_AFTER_S:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.killed.append(pid)  # waited for once the state lock is released (tick)
        self.counts.member_up[name] = False
        t.leaseless_since = None
        t.reason = (f"was hung: no lease in the CF for {silent:.0f}s while its process ran (a stopped or wedged "
                    "process); SIGKILLed")
        t.due = now + t.delay
        log.warning("%s (pid %s) %s; restarting it in %gs", name, pid, t.reason, t.delay)
        t.delay = min(t.delay * 2, RESTART_MAX_DELAY_S)
        return True

    def _wait_for_killed_members(self) -> None:
        """Wait for the members SIGKILLed as hung in this interval to be gone (each up to MEMBER_KILL_WAIT_S), so
        that the next interval finds them dead and restarts them after their delay. Outside the state lock: a
        status, an operator's stop or another member's restart must not wait for a dying process."""
        while self.killed:
            wait_gone(self.killed.pop(), MEMBER_KILL_WAIT_S)

    def _restart(self, m: dict[str, Any], t: _Member) -> None:
        name = m["name"]
        count = int(m.get("restarts") or 0) + 1
        when = time.time()
        self.c.note_in_member_log(name, f"restarted by the supervisor (restart {count}): it {t.reason}")
        try:
            self.c.spawn_manager(name)
        except Exception as e:  # noqa: BLE001 - try again after the next delay
            self.counts.restart_failures[name] += 1
            log.error("restarting %s failed (will retry in %gs): %s", name, t.delay, e)
            t.due = self.clock() + t.delay
            t.delay = min(t.delay * 2, RESTART_MAX_DELAY_S)
            return
        self.c.set_manager(name, restarts=count, last_restart={"at": when, "reason": t.reason})
        self.counts.restarted(name, cause_of(t.reason))
        self.c.save_state()
        new_pid = self.c.manager(name)["pid"]
        log.warning("restarted %s (pid %s, restart %d): it %s", name, new_pid, count, t.reason)
        t.due, t.pid, t.serving_since = None, new_pid, None


def run(group: SupervisedGroup, stop: threading.Event, *, reload: bool, cf: bool | None = None,
        interval: float = SUPERVISE_INTERVAL_S, supervisor: Supervisor | None = None) -> None:
    """Tend the group every interval until stop is set (Supervisor's reload and cf; ``supervisor``: one made
    beforehand, e.g. to export its counts)."""
    sup = supervisor or Supervisor(group, reload=reload, cf=cf)
    while not stop.wait(interval):
        try:
            with sup.counts.tick_seconds.time():
                sup.tick()
        except Exception as e:  # noqa: BLE001 - try again at the next interval
            sup.counts.tick_failures += 1
            log.error("supervising the group failed (will retry): %s", e)
    sup._close_ping()
