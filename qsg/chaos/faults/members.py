"""Faults of the members themselves: an SQM killed, paused past its lease, its log disk full, its clock skewed
(or its peers'), a member started with a log root of its own, its log volume missing, and a slow restart on a busy
machine."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cfemu.admin import Admin
from cfemu.errors import NoMessageError
from qsg.chaos.faults.heal import after_heal, peer_recovery, restart
from qsg.chaos.faults.kind import Draw, FaultError, FaultKind, FaultSpec, Step, last_member, register
from qsg.chaos.faults.restores import lose_cf
from qsg.chaos.group import BULK_QUEUE, ChaosGroup
from qsg.chaos.workload import PutSpec, Runner
from qsg.local_group import LocalGroupError
from sqm.core.failpoints import ENV_VAR as FAILPOINTS_ENV
from sqm.service.client import Client
from sqm.service.server import EXIT_CONFIG, EXIT_FENCED

IDLE_SETTLE_S = 7.0  # peer-clock-skew: longer than the coordinator's longest park before a resolve (6 s)


def sqm_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    g.c.kill_manager(f.target, signal.SIGKILL)
    step("killed")
    out: dict[str, Any] = {"peer_recovery_s": peer_recovery(g, f.target, step)}
    time.sleep(f.hold)
    step("heal")
    out["restart_s"] = restart(g, f.target, step)
    return out


def _after_recovery(d: Draw) -> tuple[float, dict[str, Any]]:
    return d.rnd.choice((0.0, 1.0, 2.0)), {}  # after peer recovery, before the restart


register(FaultKind("sqm-kill", sqm_kill, number=1, cost_s=7.0, draw=_after_recovery, short=1, cluster_short=1,
                   doc="`kill -9` of an `sqm run` process; a peer recovers it once its lease lapses; it is restarted"))


def sqm_pause(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    g.stop(f.target)
    step("SIGSTOP")
    out: dict[str, Any] = {"peer_recovery_s": peer_recovery(g, f.target, step)}
    g.cont(f.target)
    step("heal")
    code = g.c.wait_manager_exit(f.target, timeout=30.0)
    out["exit_code"] = code
    out["fenced_exit_s"] = step(f"{f.target} exited with code {code}")
    if code != EXIT_FENCED:
        raise FaultError(f"{f.target} resumed after being fenced and exited with {code}, not {EXIT_FENCED}")
    out["restart_s"] = restart(g, f.target, step)
    return out


register(FaultKind("sqm-pause", sqm_pause, number=2, cost_s=8.0,
                   doc="`SIGSTOP` until a peer has fenced and recovered it (past the lease), then `SIGCONT`: the SQM "
                       "must exit with its fenced exit code (3) — the suite checks the code — and is restarted"))


def disk_full(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    if g.disk is None:
        raise FaultError(f"unavailable on this machine: {g.disk_unavailable or 'no log disk'}")
    written = g.disk.fill()
    step(f"{f.target}'s log disk full ({written} bytes of filler)")
    time.sleep(f.hold)
    g.disk.free()
    step("heal")
    return {"filler_bytes": written, **after_heal(g, f.target, step)}


def _disk_full_hold(d: Draw) -> tuple[float, dict[str, Any]]:
    return d.rnd.choice((1.5, 3.0)), {}


register(FaultKind("disk-full", disk_full, number=13, cost_s=8.0, draw=_disk_full_hold, target=last_member,
                   doc="the last SQM's log directory is a 128 MiB tmpfs mounted by the suite; it is filled to ENOSPC, "
                       "held 1.5-3 s, and freed"))


def _skew(g: ChaosGroup, name: str, skew_ms: int, step: Step) -> float:
    """Restart an SQM with its LRSN clock source skewed by skew_ms (kept for its later restarts)."""
    g.c.kill_manager(name, signal.SIGTERM, timeout=30.0)
    step(f"{name} stopped")
    return restart(g, name, step, extra_args=["--clock-skew-ms", str(skew_ms)])


def clock_skew(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    skew = int(f.params["skew_ms"])
    out: dict[str, Any] = {"skew_ms": skew, "restart_s": _skew(g, f.target, skew, step)}
    victim = f.params.get("then_kill")
    if victim and g.running(victim):  # the skewed SQM is one of the peers that may recover it
        g.c.kill_manager(victim, signal.SIGKILL)
        step(f"{victim} killed")
        out["peer_recovery_s"] = peer_recovery(g, victim, step)
        out["victim_restart_s"] = restart(g, victim, step)
    step("heal")
    return out


def _skew_and_maybe_kill(d: Draw) -> tuple[float, dict[str, Any]]:
    params: dict[str, Any] = {"skew_ms": d.rnd.choice((-1, 1)) * d.rnd.choice((2000, 5000, 15000))}
    if len(d.managers) > 1 and d.rnd.random() < 0.5:  # the skewed SQM may then recover a peer
        params["then_kill"] = d.rnd.choice([m for m in d.managers if m != d.target])
    return 0.0, params


register(FaultKind(
    "clock-skew", clock_skew, number=14, cost_s=6.0, draw=_skew_and_maybe_kill,
    doc="the SQM is stopped (SIGTERM) and restarted with `sqm run --clock-skew-ms` of ±2, 5 or 15 s; it keeps the "
        "skew for the rest of the run. In half the seeds another SQM is then killed -9, so the skewed one may be the "
        "peer that recovers it (the recovering side skewed, not only the restarting one), and restarted"))


def peer_clock_skew(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """The recovering side's clock lags: every peer of the target runs skewed behind by more than the lease; the
    target dies right after forcing a COMMIT, so a peer completes that commit; then the CF is lost and restored.
    With an idle peer (params["idle"]) the recoverer is that peer, serving no clients and left alone long enough
    that nothing moves its clock on (the other peers are stopped until it has recovered the target, and are
    restarted if they were fenced meanwhile): its RECOVERY record once sorted below the dead member's operations
    (entries locked for good: the checker's `stuck`; docs/invariants.md, invariant 3). Without one, a busy peer
    recovers while the others commit: the CF and restore must place the completed commit at the same LRSN (the
    checker's `restore-order`; invariant 7)."""
    skew, idle, victim = int(f.params["skew_ms"]), f.params.get("idle"), f.target
    peers = [n for n in g.names if n != victim]
    stopped = [n for n in peers if idle and n != idle]
    out: dict[str, Any] = {"skew_ms": skew, "idle": idle or "-"}
    for name in peers:
        out[f"{name}_restart_s"] = _skew(g, name, skew, step)
    if idle:
        g.client_proxies[idle].cut()
        step(f"{idle} idle (its clients cut off)")
        time.sleep(IDLE_SETTLE_S)  # the coordinator's resolves of what it prepared end: nothing moves its clock
    try:
        g.c.kill_manager(victim, signal.SIGTERM, timeout=30.0)
        hit = restart_to_die(g, victim, int(f.params.get("commit", 3)), step)
        step(f"{victim} restarted, to die after forcing its COMMIT number {hit}")
        code = g.c.wait_manager_exit(victim, timeout=30.0)
        if code is None:  # too few commits reached it: kill it anyway
            g.c.kill_manager(victim, signal.SIGKILL)
            out["victim"] = "killed -9 (the failpoint was not reached in 30 s)"
        else:
            out["victim"] = f"died at the failpoint (exit code {code})"
        for name in stopped:
            g.stop(name)
        step(f"{victim} dead" + (f"; {', '.join(stopped)} stopped: {idle} recovers it" if stopped else ""))
        try:
            out["peer_recovery_s"] = peer_recovery(g, victim, step)
        finally:
            for name in stopped:
                g.cont(name)
    finally:
        if idle:
            g.client_proxies[idle].heal()
    step("heal")
    for name in stopped:  # stopped past its lease: fenced and recovered too, it exits and is restarted
        out[f"{name}_after_stop"] = after_heal(g, name, step)
    out.update(lose_cf(g, f, step))
    out["restart_s"] = restart(g, victim, step)  # without the failpoint
    return out


DIE_WHILE_STARTING_TRIES = 4


def restart_to_die(g: ChaosGroup, victim: str, hit: int, step: Step) -> int:
    """Restart ``victim`` armed to die right after its ``hit``-th force of COMMITs; returns the ``hit`` it serves
    with. Its restart commits units of work of its own (the conversation service settles what its log left), so it
    may reach a small ``hit`` while starting: it is then restarted with twice the count (its peers recover it
    meanwhile, as after any death), up to DIE_WHILE_STARTING_TRIES times, so that it dies while it serves."""
    for attempt in range(DIE_WHILE_STARTING_TRIES):
        try:
            g.c.restart_manager(victim, timeout=60.0, env={FAILPOINTS_ENV: f"after-log-force={hit}"})
            return hit
        except LocalGroupError as e:
            if "while starting" not in str(e) or attempt == DIE_WHILE_STARTING_TRIES - 1:
                raise
            step(f"{victim} died at the failpoint while starting (its restart's own commits): armed again with "
                 f"{hit * 2}, once a peer has recovered it")
            g.wait_peer_recovered(victim, 30.0)
            hit *= 2
    raise AssertionError("unreachable")


def _peers_behind(d: Draw) -> tuple[float, dict[str, Any]]:
    params: dict[str, Any] = {"skew_ms": -(d.lease_ms + d.rnd.choice((1000, 2000, 4000)))}
    if len(d.managers) > 2 and d.rnd.random() < 0.5:  # else a busy peer recovers it
        params["idle"] = d.rnd.choice([m for m in d.managers if m != d.target])
    params["commit"] = d.rnd.randint(2, 12)  # the victim dies right after this many forces of COMMITs
    return 0.0, params


register(FaultKind(
    "peer-clock-skew", peer_clock_skew, number=15, cost_s=32.0, draw=_peers_behind,
    doc="every peer of the target is restarted with its clock skewed behind by more than the lease (lease + 1, 2 or "
        "4 s); the target is restarted with the failpoint `after-log-force=N` (N from the seed, 2-12) and dies right "
        "after its N-th force of COMMITs (one commit, or a batch of commits under syncpoint); a skewed peer "
        "completes the commit; then the CF is lost and restored (as "
        "`cf-kill`) and the target restarts. In half the seeds the recoverer is an idle peer: its client proxy is "
        "cut 7 s before (longer than the coordinator's longest park, so nothing moves its clock on) and the other "
        "peer is stopped (SIGSTOP) from the target's death until the idle one has recovered it (it may be fenced "
        "meanwhile: it is then restarted); in the others a busy peer recovers while the rest of the group commits. "
        "The recoverer's RECOVERY record must sort above the dead member's operations (else entries stay locked for "
        "good: `stuck`), and the CF and restore must place the completed commit at the same LRSN (`restore-order`)"))


def member_own_log_root(g: ChaosGroup, f: FaultSpec, step: Step, timeout: float = 45.0) -> dict[str, Any]:
    """An operator starts a member with a log root of its own. It must refuse to join (exit 2):
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
        return {"refused": False, **lose_cf(g, f, step)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


register(FaultKind(
    "member-own-log-root", member_own_log_root, number=23, cost_s=6.0,
    doc="one more `sqm run` (QM4) with a log root of its own, as an operator might start it: it must refuse to join "
        "with the configuration exit code (2), as peer recovery, backup and restore read only the group's log root. "
        "Should it join, two persistent puts are committed through it as client `stray-<n>` (in the history) and the "
        "CF is lost: the checker then finds them lost"))


def log_volume_missing(g: ChaosGroup, f: FaultSpec, step: Step, timeout: float = 45.0) -> dict[str, Any]:
    """An SQM is killed -9 and its log volume does not come back: its directory is left as an empty mount point.
    Its peers must decide none of its work (its in-flight units of work may hold forced COMMITs), and its restart
    must refuse with the configuration exit code rather than begin a new, empty log (its restart would back out
    what it committed). The volume then comes back, and it restarts and recovers its work from it."""
    log_dir = g.c.log_root / f.target
    away = g.dir / f"log-volume-{f.n}-{f.target}"
    g.c.kill_manager(f.target, signal.SIGKILL)
    step("killed")
    _empty_into(log_dir, away)
    step(f"{f.target}'s log volume gone, its mount point empty")
    time.sleep(f.hold)  # its lease lapses meanwhile: its peers find no log to recover it from
    ready = g.dir / "run" / f"{f.target}.ready"
    proc = g.start_stray_member(f.target, g.c.log_root, ready)
    out: dict[str, Any] = {}
    try:
        try:
            out["exit_code"] = code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FaultError(f"{f.target} neither refused nor served within {timeout:g}s without its log") from None
        step(f"{f.target} refused to start without its log: exit code {code}")
        if code != EXIT_CONFIG or ready.exists():
            raise FaultError(f"{f.target} started without its log (exit code {code}, not the configuration error "
                             f"{EXIT_CONFIG}); see run/{f.target}.log")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if any(log_dir.iterdir()):  # a log begun without the old one: kept aside for the report
            _empty_into(log_dir, g.dir / f"log-begun-anew-{f.n}-{f.target}")
        _empty_into(away, log_dir)
        away.rmdir()
    step("heal")
    out["restart_s"] = restart(g, f.target, step)
    return out


def _empty_into(directory: Path, into: Path) -> None:
    """Move what `directory` holds into `into` (made if need be), leaving `directory` empty. The directory itself
    stays: it may be a mount point (the disk-full kind's tmpfs), which cannot be renamed."""
    into.mkdir(exist_ok=True)
    for child in list(directory.iterdir()):
        shutil.move(child, into / child.name)


def _volume_gone_for(d: Draw) -> tuple[float, dict[str, Any]]:
    return d.lease_ms / 1000 + d.rnd.choice((0.5, 2.0)), {}  # past its lease: its peers look for its log


register(FaultKind(
    "log-volume-missing", log_volume_missing, number=34, cost_s=9.0, draw=_volume_gone_for,
    doc="`kill -9` of an SQM whose log volume does not come back (its directory left an empty mount point) past its "
        "lease: its peers must decide none of its work, and `sqm run` of it must refuse with the configuration exit "
        "code (2) rather than begin a new log; the volume then comes back and it restarts from its log"))


def _commit_through(g: ChaosGroup, name: str, ready: Path, n: int) -> None:
    """Two persistent puts in one UOW through the stray member, recorded in the history as client "stray-<n>"."""
    if g.history is None:
        raise FaultError("the fault needs the run's history")
    port = int(json.loads(ready.read_text())["port"])
    with Client([(g.c.host, port)], token=g.c.token, client_name=f"stray-{n}") as c:
        runner = Runner(g.history, c, f"stray-{n}", f"stray-{n}.1", coordinator=None)
        for i in range(2):
            runner.put(PutSpec(f"stray-{n}-{i}", "Q1", 0, True, 0, 64), syncpoint=True)
        runner.end(commit=True)


SLOW_RESTART_UOW = 500  # messages a unit of work of the slow restart's fill
BURNERS = 2  # CPU-burning processes while the member restarts: one a core of the two-core machine it was sized on


def _fill(g: ChaosGroup, name: str, n: int, in_flight: int) -> tuple[float, Client]:
    """n persistent messages on BULK through the member (units of work of SLOW_RESTART_UOW), and a unit of work of
    in_flight more left open: what its restart recovery reads, backs out and relogs. Seconds taken, and the client
    that holds the open unit of work."""
    t0 = time.monotonic()
    body = b"." * 200
    with Client([g.direct[name]], token=g.c.token, client_name="slow-restart-fill", request_timeout=30.0) as c:
        for i in range(n):
            c.put(BULK_QUEUE, body)
            if (i + 1) % SLOW_RESTART_UOW == 0:
                c.commit()
        c.commit()
    held = Client([g.direct[name]], token=g.c.token, client_name="slow-restart-open", request_timeout=30.0)
    for _ in range(in_flight):
        held.put(BULK_QUEUE, body)
    return round(time.monotonic() - t0, 3), held


def _empty_bulk(g: ChaosGroup, name: str) -> int:
    """Take every message off BULK through the member again, in units of work of SLOW_RESTART_UOW."""
    taken = 0
    with Client([g.direct[name]], token=g.c.token, client_name="slow-restart-empty", request_timeout=30.0) as c:
        while True:
            try:
                c.get(BULK_QUEUE)
            except NoMessageError:
                break
            taken += 1
            if taken % SLOW_RESTART_UOW == 0:
                c.commit()
        c.commit()
    return taken


def slow_restart(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A member whose restart takes longer than its lease must keep its lease through it: killed -9 while it holds
    many messages (and a unit of work of more in flight), recovered by a peer, and restarted while CPU burners keep
    the machine busy; it must stay up, with its epoch, for twice the lease after it serves."""
    name, n = f.target, int(f.params["messages"])
    out: dict[str, Any] = {"messages": n}
    out["fill_s"], held = _fill(g, name, n, in_flight=SLOW_RESTART_UOW)
    step(f"{name} holds {n} messages on {BULK_QUEUE} and {SLOW_RESTART_UOW} in flight")
    try:
        g.c.kill_manager(name, signal.SIGKILL)
    finally:
        held.close()
    step("killed")
    out["peer_recovery_s"] = peer_recovery(g, name, step)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        step("heal", burners=BURNERS)
        out["restart_s"] = restart(g, name, step, timeout=120.0)
        pid = g.pid(name)
        client = g.cf()
        try:
            epoch = Admin(client).epoch(name)
            stay = 2 * g.lease_ms / 1000
            deadline = time.monotonic() + stay
            while time.monotonic() < deadline and g.running(name):
                time.sleep(0.2)
            fenced = Admin(client).epoch(name) != epoch
        finally:
            client.close()
        out["stayed_s"] = stay
        if not g.running(name) or g.pid(name) != pid or fenced:
            code = g.c.wait_manager_exit(name, timeout=1.0)
            raise FaultError(f"{name} was fenced or died within {stay:g}s of serving after a slow restart "
                             f"({out['restart_s']}s): running {g.running(name)}, exit code {code}, epoch changed "
                             f"{fenced}")
        step(f"{name} stayed up {stay:g}s after serving, its epoch unchanged")
    finally:
        for p in burners:
            p.kill()
            p.wait()
    out["emptied"] = _empty_bulk(g, name)
    return out


def _how_many(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"messages": d.rnd.choice((3000, 5000))}


register(FaultKind(
    "slow-restart", slow_restart, number=31, cost_s=45.0, draw=_how_many, serve_s=30.0,
    doc="3,000 or 5,000 persistent messages put on BULK (a queue of APP1 outside the history) through the SQM in units "
        "of work of 500, and 500 more left in flight; `kill -9`; a peer recovers it; 2 CPU burners run while it "
        "restarts (restart recovery backs the 500 out, its checkpoint relogs the rest); it must stay up, its epoch "
        "unchanged (not fenced), for twice the lease after it serves (else a fault error); burners off; BULK emptied "
        "through it"))


__all__: list[str] = []
