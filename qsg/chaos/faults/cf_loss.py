"""Faults that lose the CF, or a structure in it, and the restores that follow: the CF killed (alone, during a
restore, twice, after a purge, with RECAUTO, a duplexed pair's primary, one node of a Redis Cluster CF) or hung,
two restores racing, a member killed during a backup, a backup under load, and a backup that dies or stalls."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from backup.catalog import list_backups
from backup.run import run_backup
from cfemu import bulk, keys, repository
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import BackupRunningError
from cfemu.settings import CLUSTER_CF
from qsg import rcluster_cf
from qsg.chaos.bodies import parse_body
from qsg.chaos.faults.heal import peer_recovery, restart
from qsg.chaos.faults.kind import DUPLEX, Draw, FaultError, FaultKind, FaultSpec, Step, register
from qsg.chaos.faults.restores import (
    HeldInThread,
    UowAcrossRestore,
    backup_structure,
    ensure_backups,
    live_work,
    lose_cf,
    order_snapshot,
    restore_all,
    restore_structure,
    structure_state,
)
from qsg.chaos.group import STRUCTURES, ChaosGroup
from qsg.chaos.stalled_backup import StallError, start_stalled_backup
from restore.engine import LOAD, READ_BACKUP
from restore.run import RestoreError, run_purge


def _loss_hold(d: Draw) -> tuple[float, dict[str, Any]]:
    """How long the CF stays down before it restarts empty."""
    return d.rnd.choice((0.3, 1.0)), {}


def _loss_then_live_work(d: Draw) -> tuple[float, dict[str, Any]]:
    hold = d.rnd.choice((0.3, 1.0))
    return hold, {"live_s": d.rnd.choice((1.0, 2.5, 4.0))}  # live work before the (second) loss


def _set_recauto(g: ChaosGroup, on: bool) -> None:
    """RECAUTO on or off for every structure (cfemu alter structure), in the CF and the group repository."""
    client = g.cf()
    try:
        admin = Admin(client)
        repo = repository.open_group_repository(admin, g.c.log_root, who="chaos")
        for s in STRUCTURES:
            repository.alter_structure(admin, repo, s, recauto=on)
    finally:
        client.close()


def _all_active(g: ChaosGroup) -> bool:
    client = g.cf()
    try:
        admin = Admin(client)
        return all(admin.state(s) == "ACTIVE" for s in STRUCTURES)
    except redis.RedisError:
        return False
    finally:
        client.close()


def cf_kill_duplex_primary(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """The duplexed CF's primary lost: its copy is promoted by the pair's controller (the cluster's CF supervisor,
    qsg.cfpair), with nothing restored and nothing lost; the old primary comes back as the secondary."""
    if not g.c.duplexed:
        raise FaultError("cf-kill-duplex-primary needs a duplexed group: the runner starts one when the run's "
                         "kinds name it")
    out: dict[str, Any] = {}
    pair = g.c.pair
    g.c.supervise_cf()
    try:
        t0 = time.monotonic()
        while pair.state["mode"] != "DUPLEX":  # after a cf-kill by hand the pair is simplex until it resyncs
            if time.monotonic() - t0 > 60.0:
                raise FaultError("the pair was not DUPLEX within 60s of its supervisor's start")
            time.sleep(0.05)
        step("pair DUPLEX", generation=pair.state["gen"])
        promotions, restarts = pair.state["promotions"], pair.state["empty_restarts"]
        live = order_snapshot(g)
        pid = g.c.state[CLUSTER_CF]["pid"]
        os.kill(int(pid), signal.SIGKILL)
        t0 = time.monotonic()
        step("primary CF killed", live_order=live)
        while pair.state["promotions"] == promotions:
            if time.monotonic() - t0 > 30.0:
                raise FaultError("the secondary was not promoted within 30s of the primary's loss")
            time.sleep(0.02)
        out["promotion_s"] = round(time.monotonic() - t0, 3)
        step("secondary promoted", generation=pair.state["gen"])
        step("restored order read", restored_order=order_snapshot(g))
        while pair.state["mode"] != "DUPLEX":
            if time.monotonic() - t0 > 60.0:
                raise FaultError("the pair was not DUPLEX again within 60s (the old primary's resync)")
            time.sleep(0.05)
        out["duplex_again_s"] = round(time.monotonic() - t0, 3)
        out["empty_restarts"] = pair.state["empty_restarts"] - restarts  # a restore would follow one: must be 0
        if out["empty_restarts"]:
            raise FaultError("the pair restarted its primary empty instead of promoting the in-sync secondary")
        step("duplexed again")
    finally:
        g.c.supervise_cf(False)
    step("heal")
    return out


register(FaultKind(
    "cf-kill-duplex-primary", cf_kill_duplex_primary, number=25, cost_s=5.0, tags=frozenset({DUPLEX}),
    doc="(runs on a duplexed group, below; not in `all`) the cluster's CF supervisor, the pair's controller, is "
        "turned on and the pair waits to be DUPLEX; the queues' get order is read; `kill -9` of the primary "
        "redis-server; nobody acts: the controller promotes the secondary (`promotion_s` in the timings), the old "
        "primary resyncs as the secondary (`duplex_again_s`); the order read again (the checker holds the two in the "
        "same relative order); a restart of the primary empty (`empty_restarts`) is a fault error, and so is "
        "anything lost: nothing is restored. Then the supervisor is off again"))


def cluster_node_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """One node of the CF killed with RECAUTO on: on a Redis Cluster CF, the master that holds the chosen
    structure's slot (the structures of the other masters are served all along); on one redis-server, the CF
    itself. The supervisor restarts the node, empty; a member restores what it held (sqm.core.recauto)."""
    if not rcluster_cf.is_cluster_cf(g.c.state[CLUSTER_CF]):
        return cf_kill_recauto(g, f, step)
    structure = str(f.params.get("structure", "APP1"))

    def kill() -> dict[str, Any]:
        nodes = g.c._cluster_nodes()
        node = nodes.master_of(structure)
        held = sorted(s for s in STRUCTURES if nodes.master_of(s) == node)
        g.c.kill_cf_node(node)
        return {"node": node, "structures": held, "admin": nodes.master_of("ADMIN") == node}

    return cf_kill_recauto(g, f, step, kill=kill)


def _node_of(d: Draw) -> tuple[float, dict[str, Any]]:
    hold = d.rnd.choice((0.3, 1.0))
    return hold, {"structure": d.rnd.choice(sorted(STRUCTURES))}  # the node that holds it is killed


register(FaultKind(
    "cluster-node-kill", cluster_node_kill, number=26, cost_s=6.0, draw=_node_of, cluster_short=3,
    doc="RECAUTO on; `kill -9` of the CF node that holds a structure (chosen by the seed): on a Redis Cluster CF "
        "(`--redis-cluster`) the master of its slot, while the other masters serve on (only its structures' queues "
        "lose their content: `lost_queues`); on one redis-server, the CF (as `cf-kill-recauto`). The supervisor "
        "restarts the node empty, a member restores what it held; the time to every structure ACTIVE is `recauto_s`; "
        "then RECAUTO off again"))


def cf_kill_recauto(g: ChaosGroup, f: FaultSpec, step: Step,
                    kill: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The CF lost with RECAUTO on: nobody restores by hand. The cluster's supervisor restarts the CF (as
    ``cfemu cluster up`` runs it), the members re-join it and one restores each structure (sqm.core.recauto). The
    other CF kinds keep RECAUTO off: they play the operator, whose restores would race the members'. kill: what
    is killed (default the whole CF: each node of a Redis Cluster CF), returning what to report of it."""
    ensure_backups(g)
    step("backups checked")
    _set_recauto(g, True)
    step("RECAUTO on")
    out: dict[str, Any] = {}
    try:
        live = order_snapshot(g)
        restarts = g.c.cf_restarts
        g.c.supervise_cf()
        if kill is not None:
            out.update(kill())
        elif rcluster_cf.is_cluster_cf(g.c.state[CLUSTER_CF]):
            g.c.kill_cf()  # every node
        else:
            os.kill(int(g.c.state[CLUSTER_CF]["pid"]), signal.SIGKILL)
        t0 = time.monotonic()
        # One node of a Redis Cluster CF: only its structures' queues lost their content (the checker's
        # "resurrected" holds a non-persistent message to the loss only there).
        lost = {"lost_queues": sorted(q for s in out["structures"] for q in STRUCTURES[s])} if "structures" in out else {}
        step("CF killed", live_order=live, **lost)
        deadline = t0 + 120.0
        while not _all_active(g):
            if time.monotonic() > deadline:
                raise FaultError("RECAUTO: not every structure ACTIVE within 120s of the CF loss")
            time.sleep(0.1)
        out["recauto_s"] = round(time.monotonic() - t0, 3)
        out["cf_restarts"] = g.c.cf_restarts - restarts  # by the supervisor: nobody else restarted it
        step("every structure ACTIVE again, restored by a member")
        step("restored order read", restored_order=order_snapshot(g))
    finally:
        g.c.supervise_cf(False)
        with contextlib.suppress(Exception):
            _set_recauto(g, False)
    step("heal")
    return out


register(FaultKind(
    "cf-kill-recauto", cf_kill_recauto, number=24, cost_s=6.0, draw=_loss_hold,
    doc="RECAUTO is turned on for every structure (`alter_structure`, CF and repository); the cluster's CF supervisor "
        "is turned on; `kill -9` of the CF's redis-server; nobody acts: the supervisor restarts it empty on the same "
        "port, the members re-join it, one member restores each structure (sqm.core.recauto, CSQE messages in its log); "
        "the time from the kill to every structure ACTIVE is `recauto_s` in the timings (`cf_restarts`: by the "
        "supervisor, 1); then the supervisor and RECAUTO are off again. Every other kind defines the structures with "
        "RECAUTO off: they play the operator, whose restores (and the checker's restore rules, which read their "
        "spans) would otherwise race the members'"))


def cf_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return lose_cf(g, f, step)


register(FaultKind(
    "cf-kill", cf_kill, number=3, cost_s=6.0, draw=_loss_hold, short=2, cluster_short=2,
    doc="`kill -9` of the CF's redis-server; it restarts empty; every structure is restored with "
        "`restore.run.run_restore` from its latest good backup and the merged logs, as the operator would run "
        "`cfrestore`; the SQMs carry on (they re-join)"))


def cf_kill_during_restore(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return lose_cf(g, f, step, kill_during_load=True)


register(FaultKind(
    "cf-kill-during-restore", cf_kill_during_restore, number=4, cost_s=8.0, draw=_loss_hold,
    doc="as `cf-kill`, and the CF is killed again when the restore reports its load phase; the CF restarts empty and "
        "the restore runs again from the start (idempotent resume)"))


def cf_kill_during_load_restart(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return lose_cf(g, f, step, kill_during_load=True, restart_at_once=True)


register(FaultKind(
    "cf-kill-during-load-restart", cf_kill_during_load_restart, number=19, cost_s=8.0, draw=_loss_hold,
    doc="as `cf-kill`, and when the restore reports its load phase the CF is killed and an empty one started on the "
        "same port at once, before the restore goes on: the restore must stop with `RestoreStoppedError` (cf_lost) "
        "and write nothing into the new CF (the checker's `restore-foreign-cf`); then every structure is restored "
        "again, as the operator would"))


def restore_race(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Two restores of one structure overlap (the checker's `restore-wiped`). The structure is marked failed (cfrestore
    mark-failed); the first restore is held in its plan (where=plan: a slow Spark plan) or at the start of its
    load (where=load); meanwhile a second restore of it runs, and the workload's clients work on the structure
    once it is ACTIVE again, for `hold` seconds; then the first goes on. Exactly one of them may restore it:
    the one that planned while the other restored refuses, and one that finds the other loading is refused by
    its lock. The checker reads both spans from the history (restore-wiped), and the get order before the
    structure failed and after it was restored (restore-order). A unit of work opened on the structure before it
    failed is committed while the first restore is held (restores.UowAcrossRestore): held at its load, that restore
    read the logs before the COMMIT and backs it out, so the application must not be told it committed."""
    structure, where = str(f.params.get("structure", "APP1")), str(f.params.get("where", "plan"))
    ensure_backups(g)
    across = UowAcrossRestore(g, f, structure, step)
    live = order_snapshot(g)
    client = g.cf()
    try:
        Admin(client).set_state(structure, "FAILED")
    finally:
        client.close()
    step(f"{structure} marked failed", live_order=live)
    hold_at = READ_BACKUP if where == "plan" else LOAD
    first = HeldInThread("restore-race-first", lambda hold: restore_structure(
        g, structure, step, lambda phase, done, total: hold() if phase == hold_at else None))
    out: dict[str, Any] = {"structure": structure, "where": where}
    try:
        if not first.held.wait(60):
            raise FaultError(f"the first restore of {structure} never reached its {where}: {first.outcome()}")
        step(f"first restore held in its {where}")
        out["commit_while_held"] = across.commit()
        step(f"{across.name}: its commit while the first restore is held answered {out['commit_while_held']}")
        try:
            restore_structure(g, structure, step)
            out["second"] = "ok"
        except RestoreError as e:
            out["second"] = f"refused: {str(e)[:160]}"
        time.sleep(f.hold)  # clients work on the structure, if the second restore made it ACTIVE
    finally:
        first.release()
        across.close()
    out["first"] = first.outcome()
    step("restored order read", restored_order=order_snapshot(g))
    step("heal")
    if (out["first"] == "ok") == (out["second"] == "ok"):
        # both restored it (the checker counts the stale one), or neither did: restore it now, as an operator
        # would, so that the run goes on
        state = structure_state(g, structure)
        if state != "ACTIVE":
            restore_structure(g, structure, step)
            out["restored_after"] = True
        if out["first"] == "ok":
            raise FaultError(f"both overlapping restores of {structure} completed")
    return out


def _race(d: Draw) -> tuple[float, dict[str, Any]]:
    hold = d.rnd.choice((1.0, 2.0, 3.0))  # the first restore held, while the second runs and clients work
    structure = d.rnd.choice(sorted(STRUCTURES))
    return hold, {"structure": structure, "where": d.rnd.choice(("plan", "load"))}


register(FaultKind(
    "restore-race", restore_race, number=20, cost_s=8.0, draw=_race,
    doc="a structure (from the seed) is marked failed (`cfrestore mark-failed`); a first restore of it is held in its "
        "plan (a slow Spark plan) or at the start of its load; meanwhile a second restore of it runs, and the "
        "workload works on the structure once it is ACTIVE, for 1-3 s; then the first goes on. Exactly one may "
        "restore it: the one that planned while the other restored refuses, and one that finds the other loading is "
        "refused by restore's log lock (the checker's `restore-wiped`). A unit of work of the fault's own (a put, and "
        "a get of a message put for it, on EDGE or Q3), open before the structure failed, is committed while the "
        "first restore is held: held at its load, that restore read the logs before the COMMIT and backs it out, so "
        "the commit must answer that its outcome is pending (`unknown`): told committed, its put is `lost` and its "
        "get `duplicated`"))


def backup_under_restore(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A fuzzy backup of a structure runs across an operator's restore of it (`cfrestore run --mark-failed`): the
    backup is held at one of its copy steps (from the seed) until the restore has claimed the structure and begun
    its load, then goes on to its end; the CF is killed then, before the restore's load ends, restarted empty, and
    every structure restored again from its newest good backup, as the operator would. The backup's copy after the
    claim is of what the restore's wipe left: it must not end ok (the claim takes its mark away). Kept as the
    newest good backup, the restores run again would load what it copied, without the messages it missed (the
    checker's `lost`)."""
    structure, at_step = str(f.params.get("structure", "APP1")), int(f.params.get("step", 3))
    ensure_backups(g)
    killed = threading.Event()
    # With the restore's claim it must not end ok (judged below).
    backup = HeldInThread("backup-under-restore", lambda hold: backup_structure(
        g, structure, lambda n, state: hold() if n == at_step else None))
    out: dict[str, Any] = {"structure": structure, "step": at_step}

    def at_load(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and not killed.is_set():
            killed.set()
            backup.release()
            step(f"the backup of {structure} ended across the restore's claim: {backup.outcome('ok')}")
            g.c.kill_cf()
            step("CF killed during the restore's load")

    try:
        if not backup.held.wait(60):
            raise FaultError(f"the backup of {structure} never reached its step {at_step}: {backup.outcome()}")
        step(f"backup of {structure} held at its step {at_step}", live_order=order_snapshot(g))
        try:
            restore_structure(g, structure, step, at_load, mark_failed=True)
            raise FaultError(f"the restore of {structure} completed though the CF was killed during its load")
        except FaultError:
            raise
        except Exception as e:
            if not killed.is_set():
                raise FaultError(f"the restore of {structure} failed before its load: {type(e).__name__}: {e}") from e
            out["first_restore"] = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        backup.release()
    out["backup"] = backup.result["id"] if backup.finished else backup.outcome()
    g.c.restart_cf()
    step("CF restarted empty")
    out.update(restore_all(g, step))
    step("restored order read", restored_order=order_snapshot(g))
    step("heal")
    if backup.finished:
        raise FaultError(f"backup {backup.result['id']} of {structure} ended ok across a restore's claim: it "
                         "copied what the restore's wipe left")
    return out


def _backup_under_restore(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"structure": d.rnd.choice(sorted(STRUCTURES)), "step": d.rnd.randint(1, 5)}


register(FaultKind(
    "backup-under-restore", backup_under_restore, number=36, cost_s=10.0, draw=_backup_under_restore,
    doc="a fuzzy backup of a structure (from the seed) is held at one of its five copy steps; the operator restores "
        "the live structure (`cfrestore run --mark-failed`); when the restore begins its load the backup goes on to "
        "its end, and then the CF is killed, restarted empty, and every structure restored again, as the operator "
        "would. The backup ran across the restore's claim and copied what its wipe left: ending ok it would be the "
        "newest good backup, and the restores run again would load its copy (the checker's `lost`); it must fail "
        "(the claim takes its mark away), else a fault error"))


def during_backup(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    target, at_step = f.target, int(f.params.get("step", 3))

    def on_step(n: int, state: str) -> None:
        if n == at_step and g.running(target):
            g.c.kill_manager(target, signal.SIGKILL)
            step(f"{target} killed at backup step {n} ({state})")

    manifest = backup_structure(g, "APP1", on_step)
    step(f"backup {manifest['id']} done")
    out: dict[str, Any] = {"backup": manifest["id"], "peer_recovery_s": peer_recovery(g, target, step)}
    out["restart_s"] = restart(g, target, step)
    out.update(lose_cf(g, f, step))
    return out


def _backup_step(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"step": d.rnd.randint(1, 5)}


register(FaultKind(
    "during-backup", during_backup, number=5, cost_s=12.0, draw=_backup_step,
    doc="a backup of APP1 runs; at one of its five copy steps (from the seed) an SQM is killed -9; the backup "
        "completes; the SQM is recovered and restarted; then the CF is lost and restored from that backup"))


def backup(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in STRUCTURES:
        manifest = backup_structure(g, s)
        out[f"{s}_entries"] = manifest["entries"]
        step(f"{s} backed up ({manifest['entries']} messages)")
    return out


register(FaultKind("backup", backup, number=16, cost_s=3.0, doc="a fuzzy backup of every structure under load"))


def cf_kill_twice(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A get appended (not forced) before the first loss reaches the disk after the first restore; a second
    loss before any new backup must not fold it in again (docs/invariants.md, invariant 5). The target SQM is held (SIGSTOP)
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
            out: dict[str, Any] = {"first": lose_cf(g, f, step)}
        finally:
            g.cont(f.target)
            step(f"{f.target} resumed: its unforced records reach its log after the restore")
        # A CF call it had in flight carries its old epoch into the new CF, where it has re-joined meanwhile:
        # refused as fenced, it exits (code 3), as an operator would see it; live_work restarts it then.
        out["restarted"] = live_work(g, f, step)
        out["second"] = lose_cf(g, f, step)
    finally:
        g.resume_backups()
        step("backup scheduler resumed")
    out["restore_s"] = round(out["first"]["restore_s"] + out["second"]["restore_s"], 3)
    return out


register(FaultKind(
    "cf-kill-twice", cf_kill_twice, number=21, cost_s=14.0, draw=_loss_then_live_work,
    doc="the backup scheduler is held (SIGSTOP, and any backup it started runs out); the target SQM is held (SIGSTOP) "
        "from just before a `cf-kill` until its restore is done, so what it appended but had not forced reaches its "
        "log only after that restore; full service (an SQM that exited fenced or stopped serving after the loss is "
        "restarted, as an operator would: `restarted` in the timings) and 1, 2.5 or 4 s of live work; `cf-kill` "
        "again, before any new backup: the second restore must start at the first one's restore point (a get "
        "appended before the first loss and forced after it must not come back into play: docs/invariants.md, "
        "invariant 5)"))


def purged_messages(client: Any, structure: str) -> list[str]:
    """The chaos message ids of every entry the structure holds (the messages a purge now discards)."""
    ids = [keys.text(i) for i in client.hkeys(keys.entries(structure))]
    found = (parse_body(data)[0] for _, _, data in bulk.fetch(client, structure, ids) if data is not None)
    return sorted(m for m in found if m)


def purge_then_cf_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """RECOVER CFSTRUCT TYPE(PURGE) of APP1, live work, then a CF loss before any new backup:
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
            result = run_purge(client, "APP1", backup_root=g.c.backup_dir, log_root=g.c.log_root,
                               backup_keys=g.c.backup_keys())
        finally:
            client.close()
        step("purged", structure="APP1", msgs=discarded, restore_point=result.restore_point)
        out: dict[str, Any] = {"purged": len(discarded), "restarted": live_work(g, f, step)}
        out.update(lose_cf(g, f, step))
    finally:
        g.resume_backups()
        step("backup scheduler resumed")
    return out


register(FaultKind(
    "purge-then-cf-kill", purge_then_cf_kill, number=22, cost_s=10.0, draw=_loss_then_live_work,
    doc="scheduler held; APP1 marked failed, the chaos ids of every message it holds written to the history (the "
        "fault's `purged` step), `cfrestore purge` (run_purge); live work; `cf-kill` before any new backup: no "
        "purged message may come back (the checker's `purge-undone`)"))


def cf_hang(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """The CF hangs: its redis-server is stopped (SIGSTOP), alive but silent. Nobody acts but the group's supervisor
    (turned on for the fault): it must find the CF hung (no PING answered in 3 probes over at least 6 s), SIGKILL
    it and restart it empty. Then RECAUTO restores every structure (recauto) or the fault does, as the operator
    would after a CF loss; the get order is read before the hang and after the restore."""
    recauto = bool(f.params.get("recauto"))
    ensure_backups(g)
    step("backups checked")
    if recauto:
        _set_recauto(g, True)
        step("RECAUTO on")
    out: dict[str, Any] = {"recauto": recauto}
    pid = int(g.c.state[CLUSTER_CF]["pid"])
    try:
        live = order_snapshot(g)
        restarts = g.c.cf_restarts
        g.c.supervise_cf()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        step("CF stopped (SIGSTOP): hung", live_order=live)
        while g.c.cf_restarts == restarts:
            if time.monotonic() - t0 > HANG_DETECT_LIMIT_S:
                raise FaultError(f"the supervisor did not restart the hung CF within {HANG_DETECT_LIMIT_S:g}s")
            time.sleep(0.1)
        out["hang_restart_s"] = round(time.monotonic() - t0, 3)
        step("the supervisor killed the hung CF and restarted it empty")
        g.c.supervise_cf(False)
        if recauto:
            deadline = t0 + 120.0
            while not _all_active(g):
                if time.monotonic() > deadline:
                    raise FaultError("RECAUTO: not every structure ACTIVE within 120s of the CF's hang")
                time.sleep(0.1)
            out["recauto_s"] = round(time.monotonic() - t0, 3)
            step("every structure ACTIVE again, restored by a member")
        else:
            out.update(restore_all(g, step))
        out["cf_restarts"] = g.c.cf_restarts - restarts
        step("restored order read", restored_order=order_snapshot(g))
    finally:
        g.c.supervise_cf(False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped CF the supervisor did not kill goes on (healing restores it)
        if recauto:
            with contextlib.suppress(Exception):
                _set_recauto(g, False)
    step("heal")
    return out


HANG_DETECT_LIMIT_S = 30.0  # the supervisor finds a hung CF after 3 probes over >= 6 s: far less


def _hang_how(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"recauto": d.rnd.random() < 0.5}


register(FaultKind(
    "cf-hang", cf_hang, number=32, cost_s=14.0, draw=_hang_how,
    doc="the CF's redis-server is stopped (`SIGSTOP`): alive, silent; the group's supervisor (turned on for the fault) "
        "must find it hung (no `PING` answered in 3 probes of 1 s over at least 6 s), `SIGKILL` it and restart it empty "
        "(`hang_restart_s` in the timings); then, in half the seeds, RECAUTO (turned on before the hang) has a member "
        "restore every structure (`recauto_s`), in the others the fault restores them as `cf-kill` does; the get order "
        "read before the hang and after the restore (`restore-order`); the supervisor and RECAUTO off again"))


BACKUP_START_S = 60.0  # for the stuck backup to reach its step 2
LEASE_SLACK_S = 2.0  # past the stuck backup's lease (its last renewal, the CF's clock) a new backup must not be refused


def _backup_mark(g: ChaosGroup, structure: str) -> str:
    """The id of the backup whose mark the structure holds ('' none), whether its lease runs or not."""
    client = g.cf()
    try:
        found = CF(client).structure(structure).backup_mark()
        return found.backup if found is not None else ""
    finally:
        client.close()


def _stuck_backup(g: ChaosGroup, structure: str, lease_s: float, slow_s: float) -> subprocess.Popen[str]:
    """`cfbackup run STRUCTURE --lease LEASE_S` stalled before its step 2 (qsg.chaos.stalled_backup), once it says
    so; with the scheduler held meanwhile, so that its backup does not hold the mark first."""
    g.pause_backups()
    try:
        return start_stalled_backup(["run", structure, "--lease", str(lease_s)], g.c.child_env(), slow_s,
                                    BACKUP_START_S)
    except StallError as e:
        raise FaultError(str(e)) from None
    finally:
        g.resume_backups()


def _backup_after(g: ChaosGroup, structure: str, stuck: str, since: float, lease_s: float,
                  step: Step) -> dict[str, Any]:
    """A backup of the structure, as the operator's next one: refused while a live backup holds the mark (the
    scheduler's: tried again), a fault error when the stuck backup's mark still refuses it past its lease."""
    deadline = since + lease_s + LEASE_SLACK_S
    tries = 0
    while True:
        tries += 1
        client = g.cf()
        try:
            manifest = run_backup(client, structure, g.c.backup_dir, log_root=g.c.log_root,
                                  backup_keys=g.c.backup_keys())
            step(f"backup {manifest['id']} of {structure} done" + (
                f", taking over the stale mark of {manifest['took_over']}" if manifest.get("took_over") else ""))
            return {"backup_after_s": round(time.monotonic() - since, 3), "took_over": manifest.get("took_over") or "",
                    "tries": tries}
        except BackupRunningError as e:
            holder = _backup_mark(g, structure)
            if holder == stuck and time.monotonic() > deadline:
                raise FaultError(f"a backup of {structure} was refused {time.monotonic() - since:.1f}s after backup "
                                 f"{stuck} got stuck, past its lease of {lease_s:g}s: {e}") from None
            if time.monotonic() > since + 120.0:
                raise FaultError(f"no backup of {structure} within 120s of the stuck one: {e}") from None
        finally:
            client.close()
        time.sleep(0.2)


def stuck_backup(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """A backup that dies or stalls mid-run must not block the next one beyond its lease. `cfbackup run --lease`
    is held at its step 2, then: SIGKILLed (kill: the next backup is refused while its lease runs and takes over
    its stale mark after it), SIGSTOPped past its lease and cancelled by the operator (stop-cancel: `cfbackup
    cancel`, then a backup at once), or SIGSTOPped past its lease and taken over (stop-takeover); a stopped one,
    resumed, must fail and keep nothing."""
    structure, how, lease_s = str(f.params["structure"]), str(f.params["how"]), float(f.params["lease_s"])
    proc = _stuck_backup(g, structure, lease_s, slow_s=600.0 if how == "kill" else lease_s + 1.0)
    out: dict[str, Any] = {"structure": structure, "how": how, "lease_s": lease_s}
    try:
        stuck = _backup_mark(g, structure)
        if not stuck:
            raise FaultError(f"the backup to get stuck holds no mark on {structure}")
        step(f"backup {stuck} of {structure} at its step 2")
        if how == "kill":
            proc.kill()
            proc.wait(30)
            since = time.monotonic()
            step(f"backup {stuck} killed (SIGKILL)")
            client = g.cf()
            try:
                run_backup(client, structure, g.c.backup_dir, log_root=g.c.log_root, backup_keys=g.c.backup_keys())
                raise FaultError(f"a backup of {structure} ran while the killed backup {stuck}'s lease still ran")
            except BackupRunningError:
                out["refused_in_lease"] = True
            finally:
                client.close()
            step("heal")
            out.update(_backup_after(g, structure, stuck, since, lease_s, step))
            return out
        proc.send_signal(signal.SIGSTOP)
        since = time.monotonic()
        step(f"backup {stuck} stopped (SIGSTOP)")
        time.sleep(lease_s + 0.5)
        step("heal")
        if how == "stop-cancel":
            cancel = subprocess.run([sys.executable, "-m", "backup.cli", "cancel", "--structure", structure, "--json"],
                                    env=g.c.child_env(), capture_output=True, text=True, timeout=60)
            if cancel.returncode != 0:
                raise FaultError(f"cfbackup cancel failed ({cancel.returncode}): {cancel.stderr[-300:]}")
            cancelled = json.loads(cancel.stdout)["cancelled"]
            step(f"cfbackup cancel: {cancelled}")
            if stuck not in {c["backup"] for c in cancelled} and _backup_mark(g, structure) == stuck:
                raise FaultError(f"cfbackup cancel left the stopped backup {stuck}'s mark: {cancelled}")
            out["cancelled"] = [c["backup"] for c in cancelled]
            since = time.monotonic()  # cancelled: the next backup must not wait for any lease
            out.update(_backup_after(g, structure, stuck, since, 0.0, step))
        else:
            out.update(_backup_after(g, structure, stuck, since, lease_s, step))
        proc.send_signal(signal.SIGCONT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise FaultError(f"the resumed backup {stuck} did not end within 60s") from None
        out["resumed_exit"] = proc.returncode
        step(f"the resumed backup {stuck} exited with {proc.returncode}")
        kept = [b.id for b in list_backups(g.c.backup_dir, structure, backup_keys=g.c.backup_keys()) if b.id == stuck]
        if proc.returncode == 0 or kept:
            raise FaultError(f"the backup {stuck}, resumed after its mark was {how.split('-')[1]}ed, "
                             f"{'ended well' if proc.returncode == 0 else 'kept ' + str(kept)}: {err[-300:]}")
        return out
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(30)


def _stuck_how(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {"structure": d.rnd.choice(sorted(STRUCTURES)), "how": d.rnd.choice(("kill", "stop-cancel",
                                                                                      "stop-takeover")),
                 "lease_s": d.rnd.choice((2.0, 3.0))}


register(FaultKind(
    "stuck-backup", stuck_backup, number=30, cost_s=10.0, draw=_stuck_how,
    doc="`cfbackup run --lease 2` (or 3) of a structure is held at its step 2, its mark set, then (from the seed): "
        "`SIGKILL` (a backup at once must be refused, and one must succeed, taking over the stale mark, within the "
        "lease + 2 s), or `SIGSTOP` past its lease and then `cfbackup cancel` (a backup must succeed at once) or no "
        "cancel (one must succeed within the lease + 2 s, taking over); the stopped one, resumed (`SIGCONT`), must fail "
        "and keep nothing. The scheduler is held only until the stuck backup has its mark, and competes for the mark "
        "after; a backup refused by the stuck one's mark past its lease is a fault error"))


__all__: list[str] = []
