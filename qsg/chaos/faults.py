"""Fault kinds, each a real mechanism against the running group, and the seeded schedule that picks them.

| kind                  | mechanism                                                                           |
|-----------------------|-------------------------------------------------------------------------------------|
| sqm-kill              | kill -9 of an ``sqm run`` process; peers recover it once its lease lapses; restart  |
| sqm-pause             | SIGSTOP past the lease; peers fence and recover it; SIGCONT: it must exit with the  |
|                       | fenced exit code (3); restart                                                       |
| cf-kill               | kill -9 of the CF's redis-server; restart it empty; restore every structure from    |
|                       | its latest backup and the merged logs (run_restore, as the operator would)          |
| cf-kill-during-restore| as cf-kill, and the CF is killed again while the restore is loading; restore again  |
| during-backup         | a backup runs; at one of its steps an SQM is killed -9; the backup completes; the   |
|                       | SQM is recovered and restarted; then the CF is lost and restored from that backup   |
| cf-link-cut/-delay/   | the proxy between one SQM and the CF closes and refuses connections / adds latency  |
| -halfopen             | / stops forwarding without closing; a cut past the lease gets the SQM fenced        |
| client-link-cut/...   | the same on the proxy between the clients and one SQM                               |
| disk-full             | the SQM whose log is on a small tmpfs: the tmpfs is filled, then freed              |
| clock-skew            | an SQM is restarted with its LRSN clock source skewed by seconds (--clock-skew-ms)  |
| backup                | a fuzzy backup of every structure under load (what the demo scripts before a loss)  |
| cf-kill-twice         | an SQM held (SIGSTOP) across a cf-kill, live work, and cf-kill again before any new |
|                       | backup (the scheduler is held): the second restore must start at the first one's   |
|                       | restore point, whatever the held SQM forced after the first restore                 |
| purge-then-cf-kill    | APP1 is failed and purged (the purged messages go in the history), live work, then |
|                       | cf-kill before any new backup: no purged message may come back                      |
| member-own-log-root   | one more ``sqm run`` with a log root of its own: it must refuse to join (exit 2);   |
|                       | if it joins, two committed puts go through it, then cf-kill (restore cannot see them)|

After a fault heals, an SQM that exited (fenced) or no longer serves (its log failed) is restarted, as an
operator would; the report says so. Every fault records its timings: to peer recovery, to restart, the restore,
and to full service (every SQM passes a probe: a persistent put, commit, get, commit).
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backup.catalog import OK, list_backups
from backup.run import run_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.errors import BackupRunningError
from qsg.chaos.group import STRUCTURES, ChaosGroup
from qsg.chaos.workload import PutSpec, Runner, parse_body
from restore.engine import LOAD
from restore.run import run_purge, run_restore
from sqm.service.client import Client
from sqm.service.server import EXIT_CONFIG, EXIT_FENCED

SHORT_KINDS = ("sqm-kill", "cf-kill", "cf-link-cut", "client-link-halfopen")
# Rough seconds each kind takes from injection to full service, to space the schedule.
COST_S = {"sqm-kill": 7.0, "sqm-pause": 8.0, "cf-kill": 6.0, "cf-kill-during-restore": 8.0,
          "during-backup": 12.0, "disk-full": 8.0, "clock-skew": 4.0, "backup": 3.0, "cf-kill-twice": 14.0,
          "purge-then-cf-kill": 10.0, "member-own-log-root": 6.0}


class FaultError(RuntimeError):
    """A fault could not be injected or healed as planned (the report shows it; the run goes on)."""


@dataclass(frozen=True)
class FaultSpec:
    n: int
    at: float  # seconds after the workload started
    kind: str
    target: str
    hold: float
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.n, "at": self.at, "kind": self.kind, "target": self.target, "hold": self.hold,
                **self.params}


def parse_kinds(text: str) -> tuple[str, ...]:
    """'all', 'short', 'none' or a comma-separated list of kinds; an unknown kind is a ValueError naming it."""
    if text == "all":
        return KINDS
    if text == "short":
        return SHORT_KINDS
    if text in ("none", ""):
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind {', '.join(unknown)}; known: {', '.join(KINDS)}")
    return kinds


def schedule(seed: int, kinds: tuple[str, ...], duration: float, managers: list[str], *, lease_ms: int,
             warmup: float = 3.0) -> list[FaultSpec]:
    """The fault schedule of a seed: one fault at a time, kinds in a seed-rotated order (so consecutive seeds
    start with different kinds and a soak covers every kind), targets and parameters drawn from the seed."""
    if not kinds:
        return []
    rnd = random.Random(f"faults-{seed}")
    start = (seed * 3) % len(kinds)
    order = kinds[start:] + kinds[:start]
    lease = lease_ms / 1000
    out: list[FaultSpec] = []
    t = warmup + rnd.uniform(0, 1.5)
    i = 0
    while t < duration - 2.0:
        kind = order[i % len(order)]
        target = managers[-1] if kind == "disk-full" else rnd.choice(managers)
        params: dict[str, Any] = {}
        hold = 0.0
        if kind.endswith("-cut") or kind.endswith("-halfopen"):
            # Sometimes past the lease (the SQM is fenced and must restart), sometimes a short blip.
            hold = rnd.choice((1.0, 2.0, round(lease * 1.6 + 1.0, 1)))
        elif kind.endswith("-delay"):
            hold = rnd.choice((2.0, 3.0))
            params["delay_ms"] = rnd.choice((50, 150, 400))
        elif kind == "sqm-kill":
            hold = rnd.choice((0.0, 1.0, 2.0))  # after peer recovery, before the restart
        elif kind == "disk-full":
            hold = rnd.choice((1.5, 3.0))
        elif kind == "clock-skew":
            params["skew_ms"] = rnd.choice((-1, 1)) * rnd.choice((2000, 5000, 15000))
        elif kind == "during-backup":
            params["step"] = rnd.randint(1, 5)
        elif kind in ("cf-kill", "cf-kill-during-restore"):
            hold = rnd.choice((0.3, 1.0))
        elif kind in ("cf-kill-twice", "purge-then-cf-kill"):
            hold = rnd.choice((0.3, 1.0))
            params["live_s"] = rnd.choice((1.0, 2.5, 4.0))  # live work before the (second) loss
        out.append(FaultSpec(len(out) + 1, round(t, 2), kind, target, hold, params))
        t += hold + COST_S.get(kind, 4.0) + rnd.uniform(1.0, 3.0)
        i += 1
    return out


# Records a phase of the fault (a history event, with any extra fields the checker reads); returns seconds since
# the injection.
Step = Callable[..., float]


# --- helpers -------------------------------------------------------------------------------------------------
def _restart(g: ChaosGroup, name: str, step: Step, **kw: Any) -> float:
    t0 = time.monotonic()
    g.c.restart_manager(name, timeout=60.0, **kw)
    step(f"{name} restarted")
    return round(time.monotonic() - t0, 3)


def _peer_recovery(g: ChaosGroup, name: str, step: Step, timeout: float = 60.0) -> float:
    if not g.wait_peer_recovered(name, timeout):
        raise FaultError(f"no peer recovered {name} within {timeout:g}s")
    return step(f"{name} recovered by a peer")


def ensure_backups(g: ChaosGroup) -> None:
    """A CF loss needs a good backup of every structure; take one now if the scheduler has not yet."""

    for s in STRUCTURES:
        if any(b.state == OK for b in list_backups(g.c.backup_dir, s)):
            continue
        _backup(g, s)


def _backup(g: ChaosGroup, structure: str, on_step: Callable[[int, str], None] | None = None) -> dict[str, Any]:

    deadline = time.monotonic() + 60
    while True:
        client = g.cf()
        try:
            return run_backup(client, structure, g.c.backup_dir, log_root=g.c.log_root, on_step=on_step)
        except BackupRunningError:  # the scheduler's backup is running: ours starts after it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            client.close()


def restore_all(g: ChaosGroup, step: Step, kill_during_load: bool = False) -> dict[str, Any]:

    out: dict[str, Any] = {"restore_attempts": 0}
    t0 = time.monotonic()
    killed = threading.Event()

    def progress(phase: str, done: int, total: int | None) -> None:
        if kill_during_load and phase == LOAD and not killed.is_set():
            killed.set()
            step("CF killed during the restore's load")
            g.c.kill_cf()

    for s in STRUCTURES:
        while True:
            out["restore_attempts"] += 1
            client = g.cf()
            try:
                run_restore(client, s, backup_root=g.c.backup_dir, log_root=g.c.log_root, progress=progress)
                break
            except Exception as e:
                if not killed.is_set() or out.get("restore_failed_by_cf_loss"):
                    raise FaultError(f"restore of {s} failed: {type(e).__name__}: {e}") from e
                out["restore_failed_by_cf_loss"] = f"{type(e).__name__}: {str(e)[:120]}"
                g.c.restart_cf()
                step("CF restarted empty again; restore re-run from the start")
                # the structures restored before this one were lost again with the CF: restore them again
                for earlier in STRUCTURES:
                    if earlier == s:
                        break
                    run_restore(g.cf(), earlier, backup_root=g.c.backup_dir, log_root=g.c.log_root)
                    out["restore_attempts"] += 1
            finally:
                client.close()
        step(f"{s} restored")
    out["restore_s"] = round(time.monotonic() - t0, 3)
    return out


def _cf_loss(g: ChaosGroup, f: FaultSpec, step: Step, *, kill_during_load: bool = False) -> dict[str, Any]:
    ensure_backups(g)
    step("backups checked")
    g.c.kill_cf()
    step("CF killed")
    time.sleep(f.hold)
    g.c.restart_cf()
    step("CF restarted empty")
    out = restore_all(g, step, kill_during_load=kill_during_load)
    step("heal")
    return out


# --- the kinds -------------------------------------------------------------------------------------------------
def sqm_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    g.c.kill_manager(f.target, signal.SIGKILL)
    step("killed")
    out: dict[str, Any] = {"peer_recovery_s": _peer_recovery(g, f.target, step)}
    time.sleep(f.hold)
    step("heal")
    out["restart_s"] = _restart(g, f.target, step)
    return out


def sqm_pause(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    g.stop(f.target)
    step("SIGSTOP")
    out: dict[str, Any] = {"peer_recovery_s": _peer_recovery(g, f.target, step)}
    g.cont(f.target)
    step("heal")
    code = g.c.wait_manager_exit(f.target, timeout=30.0)
    out["exit_code"] = code
    out["fenced_exit_s"] = step(f"{f.target} exited with code {code}")
    if code != EXIT_FENCED:
        raise FaultError(f"{f.target} resumed after being fenced and exited with {code}, not {EXIT_FENCED}")
    out["restart_s"] = _restart(g, f.target, step)
    return out


def cf_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return _cf_loss(g, f, step)


def cf_kill_during_restore(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return _cf_loss(g, f, step, kill_during_load=True)


def during_backup(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    target, at_step = f.target, int(f.params.get("step", 3))

    def on_step(n: int, state: str) -> None:
        if n == at_step and g.running(target):
            g.c.kill_manager(target, signal.SIGKILL)
            step(f"{target} killed at backup step {n} ({state})")

    manifest = _backup(g, "APP1", on_step)
    step(f"backup {manifest['id']} done")
    out: dict[str, Any] = {"backup": manifest["id"], "peer_recovery_s": _peer_recovery(g, target, step)}
    out["restart_s"] = _restart(g, target, step)
    out.update(_cf_loss(g, f, step))
    return out


def _link(which: str, mode: str) -> Callable[[ChaosGroup, FaultSpec, Step], dict[str, Any]]:
    def fault(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
        proxy = (g.cf_proxies if which == "cf" else g.client_proxies)[f.target]
        if mode == "cut":
            proxy.cut()
        elif mode == "delay":
            proxy.delay(f.params.get("delay_ms", 100) / 1000)
        else:
            proxy.half_open()
        step(f"{which} link {mode}")
        time.sleep(f.hold)
        proxy.heal()
        step("heal")
        return after_heal(g, f.target, step)
    return fault


def after_heal(g: ChaosGroup, name: str, step: Step, grace: float = 8.0) -> dict[str, Any]:
    """Restart the SQM if it exited (fenced) or stopped serving (e.g. its log failed), as an operator would."""
    out: dict[str, Any] = {}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not g.running(name):
            break
        if g.probe(name, timeout=2.0):
            return out
        time.sleep(0.2)
    if g.running(name):
        out["forced_restart"] = "no service after healing: killed -9 and restarted"
        g.c.kill_manager(name, signal.SIGKILL)
        step(f"{name} not serving: killed")
        out["peer_recovery_s"] = _peer_recovery(g, name, step)
    else:
        out["exit_code"] = g.c.wait_manager_exit(name, timeout=1.0)
        step(f"{name} exited with code {out['exit_code']}")
        with contextlib.suppress(FaultError):
            _peer_recovery(g, name, step, timeout=30.0)
    out["restart_s"] = _restart(g, name, step)
    return out


def disk_full(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    if g.disk is None:
        raise FaultError(f"unavailable on this machine: {g.disk_unavailable or 'no log disk'}")
    written = g.disk.fill()
    step(f"{f.target}'s log disk full ({written} bytes of filler)")
    time.sleep(f.hold)
    g.disk.free()
    step("heal")
    return {"filler_bytes": written, **after_heal(g, f.target, step)}


def backup(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in STRUCTURES:
        manifest = _backup(g, s)
        out[f"{s}_entries"] = manifest["entries"]
        step(f"{s} backed up ({manifest['entries']} messages)")
    return out


def clock_skew(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    skew = int(f.params["skew_ms"])
    g.c.kill_manager(f.target, signal.SIGTERM, timeout=30.0)
    step("stopped")
    out = {"skew_ms": skew, "restart_s": _restart(g, f.target, step, extra_args=["--clock-skew-ms", str(skew)])}
    step("heal")
    return out


def _live_work(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Full service (an SQM that exited, fenced, or stopped serving after the loss is restarted, as an operator
    would), then the workload goes on for the fault's live_s: the work the next loss must keep."""
    restarted = {name: out for name in g.names if (out := after_heal(g, name, step))}
    if g.wait_service(timeout=60.0) is None:
        raise FaultError("no full service within 60s of the restore")
    step("full service: live work")
    time.sleep(float(f.params.get("live_s", 2.0)))
    return restarted


def cf_kill_twice(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Issue 10, hole 1: a get appended (not forced) before the first loss reaches the disk after the first
    restore; a second loss before any new backup must not fold it in again. The target SQM is held (SIGSTOP)
    from just before the first loss until that restore is done, so that what it had appended but not forced
    reaches its log only afterwards, at its next force (a busy member forces too often for that to happen by
    chance). It holds no lease meanwhile that a peer could see lapse: the new CF does not know it yet."""
    ensure_backups(g)
    g.pause_backups()
    step("backup scheduler held")
    try:
        g.stop(f.target)
        step(f"{f.target} held (SIGSTOP) across the first loss")
        try:
            out: dict[str, Any] = {"first": _cf_loss(g, f, step)}
        finally:
            g.cont(f.target)
            step(f"{f.target} resumed: its unforced records reach its log after the restore")
        # A CF call it had in flight carries its old epoch into the new CF, where it has re-joined meanwhile:
        # refused as fenced, it exits (code 3), as an operator would see it; _live_work restarts it then.
        out["restarted"] = _live_work(g, f, step)
        out["second"] = _cf_loss(g, f, step)
    finally:
        g.resume_backups()
        step("backup scheduler resumed")
    out["restore_s"] = round(out["first"]["restore_s"] + out["second"]["restore_s"], 3)
    return out


def purged_messages(client: Any, structure: str) -> list[str]:
    """The chaos message ids of every entry the structure holds (the messages a purge now discards)."""
    ids = [keys.text(i) for i in client.hkeys(keys.entries(structure))]
    found = (parse_body(data)[0] for _, _, data in bulk.fetch(client, structure, ids) if data is not None)
    return sorted(m for m in found if m)


def purge_then_cf_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Issue 10, hole 8: RECOVER CFSTRUCT TYPE(PURGE) of APP1, live work, then a CF loss before any new backup:
    the restore must start at the purge, not at the backup before it. The purged messages are named in the
    history (the fault's "purged" step), so that the checker can tell a purged message from a lost one."""
    ensure_backups(g)
    g.pause_backups()
    step("backup scheduler held")
    try:
        client = g.cf()
        try:
            Admin(client).set_state("APP1", "FAILED")  # from here on nothing changes what the purge discards
            discarded = purged_messages(client, "APP1")
            result = run_purge(client, "APP1", backup_root=g.c.backup_dir, log_root=g.c.log_root)
        finally:
            client.close()
        step("purged", structure="APP1", msgs=discarded, restore_point=result.restore_point)
        out: dict[str, Any] = {"purged": len(discarded), "restarted": _live_work(g, f, step)}
        out.update(_cf_loss(g, f, step))
    finally:
        g.resume_backups()
        step("backup scheduler resumed")
    return out


def member_own_log_root(g: ChaosGroup, f: FaultSpec, step: Step, timeout: float = 45.0) -> dict[str, Any]:
    """Issue 10, hole 6: an operator starts a member with a log root of its own. It must refuse to join (exit 2):
    peer recovery, backup and restore read only the group's log root. Should it join, two persistent puts are
    committed through it, as a client of the history, and the CF is lost: the checker then finds them lost."""
    name = f"QM{len(g.names) + 1}"
    elsewhere = g.dir / f"elsewhere-{f.n}"
    ready = g.dir / "run" / f"{name}.ready"
    proc = g.start_stray_member(name, elsewhere, ready)
    step(f"{name} started with its own log root {elsewhere}")
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and not ready.exists():
            if time.monotonic() > deadline:
                raise FaultError(f"{name} neither refused nor joined within {timeout:g}s")
            time.sleep(0.1)
        if proc.returncode is not None:
            step(f"{name} refused to join: exit code {proc.returncode}")
            if proc.returncode != EXIT_CONFIG:
                raise FaultError(f"{name} exited with {proc.returncode}, not the configuration error "
                                 f"{EXIT_CONFIG}; see run/{name}.log")
            return {"refused": True, "exit_code": proc.returncode}
        step(f"{name} joined the group with its own log root")
        _commit_through(g, name, ready, f.n)
        proc.terminate()
        proc.wait(timeout=30)
        step(f"{name} stopped")
        return {"refused": False, **_cf_loss(g, f, step)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _commit_through(g: ChaosGroup, name: str, ready: Path, n: int) -> None:
    """Two persistent puts in one UOW through the stray member, recorded in the history as client "stray-<n>"."""
    if g.history is None:
        raise FaultError("the fault needs the run's history")
    port = int(json.loads(ready.read_text())["port"])
    with Client([(g.c.host, port)], token=g.c.token, client_name=f"stray-{n}") as c:
        runner = Runner(g.history, c, f"stray-{n}", f"stray-{n}.1", coordinator=None)  # type: ignore[arg-type]
        for i in range(2):
            runner.put(PutSpec(f"stray-{n}-{i}", "Q1", 0, True, 0, 64), syncpoint=True)
        runner.end(commit=True)


FAULTS: dict[str, Callable[[ChaosGroup, FaultSpec, Step], dict[str, Any]]] = {
    "sqm-kill": sqm_kill, "sqm-pause": sqm_pause, "cf-kill": cf_kill,
    "cf-kill-during-restore": cf_kill_during_restore, "during-backup": during_backup,
    "cf-link-cut": _link("cf", "cut"), "cf-link-delay": _link("cf", "delay"),
    "cf-link-halfopen": _link("cf", "halfopen"), "client-link-cut": _link("client", "cut"),
    "client-link-delay": _link("client", "delay"), "client-link-halfopen": _link("client", "halfopen"),
    "disk-full": disk_full, "clock-skew": clock_skew, "backup": backup, "cf-kill-twice": cf_kill_twice,
    "purge-then-cf-kill": purge_then_cf_kill, "member-own-log-root": member_own_log_root,
}
KINDS = tuple(FAULTS)  # a new kind is one function, one FAULTS row and one line in the table above

__all__ = ["FAULTS", "FaultError", "FaultSpec", "KINDS", "SHORT_KINDS", "after_heal", "ensure_backups",
           "parse_kinds", "restore_all", "schedule"]
