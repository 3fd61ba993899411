"""Fault kinds, each a real mechanism against the running group, and the seeded schedule that picks them.

| kind                  | mechanism                                                                           |
|-----------------------|-------------------------------------------------------------------------------------|
| sqm-kill              | kill -9 of an ``sqm run`` process; peers recover it once its lease lapses; restart  |
| sqm-pause             | SIGSTOP past the lease; peers fence and recover it; SIGCONT: it must exit with the  |
|                       | fenced exit code (3); restart                                                       |
| cf-kill               | kill -9 of the CF's redis-server; restart it empty; restore every structure from    |
|                       | its latest backup and the merged logs (run_restore, as the operator would)          |
| cf-kill-during-restore| as cf-kill, and the CF is killed again while the restore is loading; restore again  |
| cf-kill-during-load-  | as cf-kill, and while the restore loads the CF is killed and an empty one started on|
| restart               | the same port at once: the restore must stop, say so and write nothing into it;     |
|                       | every structure is restored again (as the operator would)                           |
| restore-race          | a structure is marked failed; two restores of it overlap, the first held in its plan|
|                       | (a slow Spark plan) or its load, while the second runs and clients work on the     |
|                       | structure once it is ACTIVE; the stale one must refuse and wipe nothing             |
| during-backup         | a backup runs; at one of its steps an SQM is killed -9; the backup completes; the   |
|                       | SQM is recovered and restarted; then the CF is lost and restored from that backup   |
| cf-link-cut/-delay/   | the proxy between one SQM and the CF closes and refuses connections / adds latency  |
| -halfopen             | / stops forwarding without closing; a cut past the lease gets the SQM fenced        |
| client-link-cut/...   | the same on the proxy between the clients and one SQM                               |
| cf-link-reply-loss    | the proxy between one SQM and the CF forwards its requests and drops the CF's       |
|                       | replies, then cuts: calls that ran on the CF with their outcome unknown to the SQM  |
| disk-full             | the SQM whose log is on a small tmpfs: the tmpfs is filled, then freed              |
| clock-skew            | an SQM is restarted with its LRSN clock source skewed by seconds (--clock-skew-ms); |
|                       | sometimes another SQM is then killed -9, so the skewed one may be its recoverer     |
| peer-clock-skew       | the peers of an SQM restart with their clocks skewed behind by more than the lease  |
|                       | (in half the seeds one is idle: clients cut off, the others stopped until it has    |
|                       | recovered); the SQM dies right after a COMMIT is forced (failpoint after-log-force);|
|                       | a skewed peer recovers it; then a CF loss and restore; the SQM restarts             |
| backup                | a fuzzy backup of every structure under load (what the demo scripts before a loss)  |
| client-leaves-waiting-| clients disconnect (close or reset) while their get waits, outside syncpoint and     |
| get                   | under it; the message they waited for is put after they left: it must be there     |
| big-messages          | an SQM restarted with frames smaller than its queues hold; an in-process member puts |
|                       | at and over the queue's limit; puts, gets and browses through that SQM and through a |
|                       | client accepting small frames must refuse cleanly and take nothing; then restored   |
| cf-kill-twice         | an SQM held (SIGSTOP) across a cf-kill, live work, and cf-kill again before any new |
|                       | backup (the scheduler is held): the second restore must start at the first one's   |
|                       | restore point, whatever the held SQM forced after the first restore                 |
| purge-then-cf-kill    | APP1 is failed and purged (the purged messages go in the history), live work, then |
|                       | cf-kill before any new backup: no purged message may come back                      |
| cf-kill-recauto       | RECAUTO turned on for every structure; kill -9 of the CF; nobody acts: the cluster's|
|                       | supervisor restarts it, a member restores each structure (sqm.recauto); the time to|
|                       | every structure ACTIVE; RECAUTO off again                                           |
| cluster-node-kill     | RECAUTO on; kill -9 of the CF node that holds a structure (chosen by the seed): on a |
|                       | Redis Cluster CF (--redis-cluster) the master of its slot, the other masters serve  |
|                       | on; on one redis-server, the CF. The supervisor restarts the node empty, a member   |
|                       | restores what it held; the time to every structure ACTIVE; RECAUTO off again        |
| member-own-log-root   | one more ``sqm run`` with a log root of its own: it must refuse to join (exit 2);   |
|                       | if it joins, two committed puts go through it, then cf-kill (restore cannot see them)|
| pstore-disconnect     | DISCONNECT-PSTORE of a structure (cfemu pstore disconnect) for 2-5 s under load:     |
|                       | persistent work there is refused (FAIL, with the reason); then CONNECT-PSTORE       |
| no-new-uows           | the structure takes no new units of work (cfemu pstore no-new-uows --on) for 2-5 s: |
|                       | every put refused, consuming work goes on; then --off                               |
| cf-kill-duplex-primary| (a duplexed group; not in 'all') the pair's supervisor on, the pair DUPLEX; kill -9 |
|                       | of the primary: the secondary is promoted, nothing restored, nothing lost; the old  |
|                       | primary resyncs as the secondary; the time to the promotion and to DUPLEX again     |

After a fault heals, an SQM that exited (fenced) or no longer serves (its log failed) is restarted, as an
operator would; the report says so. Every CF loss records each queue's get order on the live CF just before the
loss and right after the restore (fault steps with live_order / restored_order): the checker holds them equal. Every fault records its timings: to peer recovery, to restart, the restore,
and to full service (every SQM passes a probe: a persistent put, commit, get, commit).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis

from backup.catalog import OK, list_backups
from backup.run import run_backup
from cfemu import bulk, keys, repository
from cfemu.admin import Admin
from cfemu.cf import CF, PstoreStatus
from cfemu.errors import BackupRunningError, MQError
from cfemu.limits import DESCRIPTOR_ALLOWANCE
from cfemu.progress import Progress, no_progress
from cfemu.settings import CLUSTER_CF
from qsg import cluster_cf
from qsg.chaos.group import EDGE_QUEUE, STRUCTURES, ChaosGroup
from qsg.chaos.history import OK as CALL_OK
from qsg.chaos.history import UNKNOWN as CALL_UNKNOWN
from qsg.chaos.history import History
from qsg.chaos.workload import PutSpec, Runner, make_body, parse_body
from restore.engine import LOAD, READ_BACKUP
from restore.result import RestoreResult
from restore.run import RestoreError, RestoreStoppedError, run_purge, run_restore
from sqm.clock import now_ms
from sqm.failpoints import ENV_VAR as FAILPOINTS_ENV
from sqm.manager import QueueManager, QueueManagerConfig
from sqm.service.client import Client, handshake
from sqm.service.protocol import ENVELOPE, PRE_HELLO_MAX_FRAME, encode_frame
from sqm.service.server import EXIT_CONFIG, EXIT_FENCED

SHORT_KINDS = ("sqm-kill", "cf-kill", "cf-link-cut", "client-link-halfopen", "cf-link-reply-loss")
# Against a Redis Cluster CF (--redis-cluster): no kind that needs a proxy between an SQM and the CF (a cluster client
# follows the cluster's redirections to the nodes themselves), and a node kill instead.
CF_LINK_KINDS = ("cf-link-cut", "cf-link-delay", "cf-link-halfopen", "cf-link-reply-loss")
CLUSTER_SHORT_KINDS = ("sqm-kill", "cf-kill", "cluster-node-kill", "client-link-halfopen")
# Rough seconds each kind takes from injection to full service, to space the schedule.
COST_S = {"sqm-kill": 7.0, "sqm-pause": 8.0, "cf-kill": 6.0, "cf-kill-during-restore": 8.0,
          "during-backup": 12.0, "disk-full": 8.0, "clock-skew": 6.0, "peer-clock-skew": 32.0, "backup": 3.0,
          "client-leaves-waiting-get": 9.0, "big-messages": 12.0,
          "cf-kill-during-load-restart": 8.0, "restore-race": 8.0, "cf-kill-twice": 14.0,
          "purge-then-cf-kill": 10.0, "member-own-log-root": 6.0, "cf-kill-recauto": 6.0,
          "cf-kill-duplex-primary": 5.0, "cluster-node-kill": 6.0, "pstore-disconnect": 2.0, "no-new-uows": 2.0}
# Kinds that need a duplexed group (the runner starts one when a run has them): left out of 'all', which runs the
# group simplex, so that every other kind keeps meeting the CF it was written for.
DUPLEX_KINDS = ("cf-kill-duplex-primary",)
ORDER_LIMIT = 100_000  # messages per queue an order snapshot reads
IDLE_SETTLE_S = 7.0  # peer-clock-skew: longer than the coordinator's longest park before a resolve (6 s)


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
        return tuple(k for k in KINDS if k not in DUPLEX_KINDS)
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
    # A stride coprime with the number of kinds, so that consecutive seeds start at every kind in turn.
    stride = next(k for k in (3, 5, 7, 11, 13, 1) if math.gcd(k, len(kinds)) == 1)
    start = (seed * stride) % len(kinds)
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
        elif kind.endswith("-reply-loss"):
            hold = rnd.choice((0.3, 1.0, 2.0))  # shorter than the lease: the SQM stays, its calls' replies do not
        elif kind.endswith("-delay"):
            hold = rnd.choice((2.0, 3.0))
            params["delay_ms"] = rnd.choice((50, 150, 400))
        elif kind == "sqm-kill":
            hold = rnd.choice((0.0, 1.0, 2.0))  # after peer recovery, before the restart
        elif kind == "disk-full":
            hold = rnd.choice((1.5, 3.0))
        elif kind == "clock-skew":
            params["skew_ms"] = rnd.choice((-1, 1)) * rnd.choice((2000, 5000, 15000))
            if len(managers) > 1 and rnd.random() < 0.5:  # the skewed SQM may then recover a peer
                params["then_kill"] = rnd.choice([m for m in managers if m != target])
        elif kind == "peer-clock-skew":
            params["skew_ms"] = -(lease_ms + rnd.choice((1000, 2000, 4000)))
            if len(managers) > 2 and rnd.random() < 0.5:  # else a busy peer recovers it
                params["idle"] = rnd.choice([m for m in managers if m != target])
            params["commit"] = rnd.randint(2, 12)  # the victim dies right after forcing this many COMMITs
        elif kind == "during-backup":
            params["step"] = rnd.randint(1, 5)
        elif kind in ("cf-kill", "cf-kill-during-restore", "cf-kill-during-load-restart", "cf-kill-recauto"):
            hold = rnd.choice((0.3, 1.0))
        elif kind == "cluster-node-kill":
            hold = rnd.choice((0.3, 1.0))
            params["structure"] = rnd.choice(sorted(STRUCTURES))  # the node that holds it is killed
        elif kind == "restore-race":
            hold = rnd.choice((1.0, 2.0, 3.0))  # the first restore held, while the second runs and clients work
            params["structure"] = rnd.choice(sorted(STRUCTURES))
            params["where"] = rnd.choice(("plan", "load"))
        elif kind in ("pstore-disconnect", "no-new-uows"):
            hold = rnd.choice((2.0, 3.0, 5.0))
            params["structure"] = rnd.choice(("APP1", "APP1", "APP2"))  # APP1 holds the topic too
        elif kind in ("cf-kill-twice", "purge-then-cf-kill"):
            hold = rnd.choice((0.3, 1.0))
            params["live_s"] = rnd.choice((1.0, 2.5, 4.0))  # live work before the (second) loss
        out.append(FaultSpec(len(out) + 1, round(t, 2), kind, target, hold, params))
        t += hold + COST_S.get(kind, 4.0) + rnd.uniform(1.0, 3.0)
        i += 1
    return out


# step(phase, **fields) records a phase of the fault (a history event, with any fields the checker reads);
# returns seconds since inject.
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
        if any(b.state == OK for b in list_backups(g.c.backup_dir, s, backup_keys=g.c.backup_keys())):
            continue
        _backup(g, s)


def _backup(g: ChaosGroup, structure: str, on_step: Callable[[int, str], None] | None = None) -> dict[str, Any]:

    deadline = time.monotonic() + 60
    while True:
        client = g.cf()
        try:
            return run_backup(client, structure, g.c.backup_dir, log_root=g.c.log_root, on_step=on_step,
                              backup_keys=g.c.backup_keys())
        except BackupRunningError:  # the scheduler's backup is running: ours starts after it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            client.close()


_restore_ids = itertools.count(1)


def _cf_id(g: ChaosGroup) -> str | None:
    """The CF's identity (its run id) as a fresh connection finds it; None when it cannot be reached."""
    client = g.cf()
    try:
        return bulk.cf_identity(client)
    except redis.exceptions.RedisError:
        return None
    finally:
        client.close()


# Admin keys only a restore (or the operator) writes: members write leases, epochs and themselves, never these.
_DEFINITIONS = {k.encode() for k in (keys.group(), keys.structure_defs(), keys.queue_defs())}


def _restore_written(g: ChaosGroup) -> int:
    """Keys in the CF that only a restore writes: any structure's, and the group's definitions. In a CF started
    empty under a restore, before anyone restored anything into it, they can only be that restore's."""
    client = g.cf()
    try:
        return sum(1 for k in client.scan_iter(count=1000) if not k.startswith(b"{ADMIN}:") or k in _DEFINITIONS)
    finally:
        client.close()


# The local engine's options, one drawn from the seed for each restore. With the defaults a chaos structure is
# one partition planned in the restore's own process: the partitions, the worker processes settling them, the
# logs read in slices and the load's batches prepared in a worker never met a fault. A tiny memory limit gives
# many partitions.
RESTORE_ENGINES: tuple[dict[str, int], ...] = ({}, {"workers": 1}, {"memory": 256 << 10, "workers": 2},
                                               {"memory": 64 << 10, "workers": 3})


def restore_engine(seed: int, restore: int) -> dict[str, int]:
    """The engine options of a run's restore number `restore` (the same for a seed run again)."""
    return dict(random.Random(f"restore-{seed}-{restore}").choice(RESTORE_ENGINES))


def _restore(g: ChaosGroup, structure: str, step: Step, progress: Progress = no_progress) -> RestoreResult:
    """run_restore, as the operator runs cfrestore, with its span in the history for the checker: 'restore
    began' and 'restore ended' events carrying the restore's number, the structure and its queues, the CF's
    identity at each end, the outcome (ok, refused, stopped, failed) and, when the CF changed under the restore,
    how many keys only a restore writes the new CF held right after it (written_into_new_cf)."""
    rid = next(_restore_ids)
    cf0 = _cf_id(g)
    g.restores += 1
    engine = restore_engine(g.seed, g.restores)
    step("restore began", restore=rid, structure=structure, queues=list(STRUCTURES[structure]), cf=cf0,
         engine=engine)
    client = g.cf()
    outcome, error = "ok", ""
    try:
        return run_restore(client, structure, backup_root=g.c.backup_dir, log_root=g.c.log_root, progress=progress,
                           backup_keys=g.c.backup_keys(), engine_options=engine)
    except RestoreStoppedError as e:
        outcome, error = "stopped", str(e)
        raise
    except RestoreError as e:
        outcome, error = "refused", str(e)
        raise
    except Exception as e:
        outcome, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        client.close()
        cf1 = _cf_id(g)
        extra: dict[str, Any] = {}
        if cf0 is not None and cf1 is not None and cf1 != cf0:
            extra["written_into_new_cf"] = _restore_written(g)
        step(f"restore ended: {outcome}", restore=rid, structure=structure, outcome=outcome, cf=cf1,
             error=error[:300], **extra)


def restore_all(g: ChaosGroup, step: Step, kill_during_load: bool = False,
                restart_at_once: bool = False) -> dict[str, Any]:
    """Restore every structure, as the operator would after a CF loss. kill_during_load: the CF is killed when
    the first restore reports its load; restart_at_once: and an empty one started on the same port before the
    restore goes on (it must stop and say that the CF was lost). Either way every structure is restored again."""
    out: dict[str, Any] = {"restore_attempts": 0}
    t0 = time.monotonic()
    killed = threading.Event()

    def progress(phase: str, done: int, total: int | None) -> None:
        if kill_during_load and phase == LOAD and not killed.is_set():
            killed.set()
            step("CF killed during the restore's load")
            g.c.kill_cf()
            if restart_at_once:
                g.c.restart_cf()
                step("CF restarted empty at once, under the restore")

    for s in STRUCTURES:
        while True:
            out["restore_attempts"] += 1
            try:
                _restore(g, s, step, progress)
                break
            except Exception as e:
                if not killed.is_set() or out.get("restore_failed_by_cf_loss"):
                    raise FaultError(f"restore of {s} failed: {type(e).__name__}: {e}") from e
                out["restore_failed_by_cf_loss"] = f"{type(e).__name__}: {str(e)[:160]}"
                if restart_at_once:
                    if not (isinstance(e, RestoreStoppedError) and e.cf_lost):
                        raise FaultError(f"restore of {s} did not say that the CF was lost under it: "
                                         f"{type(e).__name__}: {e}") from e
                else:
                    g.c.restart_cf()
                step("CF restarted empty again; restore re-run from the start")
                # the structures restored before this one were lost again with the CF: restore them again
                for earlier in STRUCTURES:
                    if earlier == s:
                        break
                    _restore(g, earlier, step)
                    out["restore_attempts"] += 1
        step(f"{s} restored")
    out["restore_s"] = round(time.monotonic() - t0, 3)
    return out


def order_snapshot(g: ChaosGroup) -> dict[str, list[str]]:
    """Each workload queue's available messages (chaos message ids) in get order, browsed on the CF directly.
    Taken just before a CF loss and right after its restore: messages in both must keep their relative order
    (invariant 7; the checker's restore-order rule). Empty when the CF does not answer."""
    client = g.cf()
    try:
        cf = CF(client)
        out: dict[str, list[str]] = {}
        for s, queues in STRUCTURES.items():
            for q in queues:
                ids = (parse_body(data)[0] for _, data in cf.structure(s).browse(q, ORDER_LIMIT, now_ms()))
                out[q] = [m for m in ids if m]
        return out
    except (redis.RedisError, OSError):
        return {}
    finally:
        client.close()


def _cf_loss(g: ChaosGroup, f: FaultSpec, step: Step, *, kill_during_load: bool = False,
             restart_at_once: bool = False) -> dict[str, Any]:
    ensure_backups(g)
    step("backups checked")
    live = order_snapshot(g)
    g.c.kill_cf()
    step("CF killed", live_order=live)
    time.sleep(f.hold)
    g.c.restart_cf()
    step("CF restarted empty")
    out = restore_all(g, step, kill_during_load=kill_during_load, restart_at_once=restart_at_once)
    step("restored order read", restored_order=order_snapshot(g))
    step("heal")
    return out


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


def cluster_node_kill(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """One node of the CF killed with RECAUTO on: on a Redis Cluster CF, the master that holds the chosen
    structure's slot (the structures of the other masters are served all along); on one redis-server, the CF
    itself. The supervisor restarts the node, empty; a member restores what it held (sqm.recauto)."""
    if not cluster_cf.is_cluster_cf(g.c.state[CLUSTER_CF]):
        return cf_kill_recauto(g, f, step)
    structure = str(f.params.get("structure", "APP1"))

    def kill() -> dict[str, Any]:
        nodes = g.c._cluster_nodes()
        node = nodes.master_of(structure)
        held = sorted(s for s in STRUCTURES if nodes.master_of(s) == node)
        g.c.kill_cf_node(node)
        return {"node": node, "structures": held, "admin": nodes.master_of("ADMIN") == node}

    return cf_kill_recauto(g, f, step, kill=kill)


def cf_kill_recauto(g: ChaosGroup, f: FaultSpec, step: Step,
                    kill: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The CF lost with RECAUTO on: nobody restores by hand. The cluster's supervisor restarts the CF (as
    ``cfemu cluster up`` runs it), the members re-join it and one restores each structure (sqm.recauto). The
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
        elif cluster_cf.is_cluster_cf(g.c.state[CLUSTER_CF]):
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


def cf_kill_during_load_restart(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    return _cf_loss(g, f, step, kill_during_load=True, restart_at_once=True)


def restore_race(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Two restores of one structure overlap (issue 10, hole 5). The structure is marked failed (cfrestore
    mark-failed); the first restore is held in its plan (where=plan: a slow Spark plan) or at the start of its
    load (where=load); meanwhile a second restore of it runs, and the workload's clients work on the structure
    once it is ACTIVE again, for `hold` seconds; then the first goes on. Exactly one of them may restore it:
    the one that planned while the other restored refuses, and one that finds the other loading is refused by
    its lock. The checker reads both spans from the history (restore-wiped), and the get order before the
    structure failed and after it was restored (restore-order)."""
    structure, where = str(f.params.get("structure", "APP1")), str(f.params.get("where", "plan"))
    ensure_backups(g)
    live = order_snapshot(g)
    client = g.cf()
    try:
        Admin(client).set_state(structure, "FAILED")
    finally:
        client.close()
    step(f"{structure} marked failed", live_order=live)
    held, release = threading.Event(), threading.Event()
    hold_at = READ_BACKUP if where == "plan" else LOAD

    def hold(phase: str, done: int, total: int | None) -> None:
        if phase == hold_at and not held.is_set():
            held.set()
            release.wait(120)

    first: dict[str, Any] = {}

    def run_first() -> None:
        try:
            first["result"] = _restore(g, structure, step, hold)
        except Exception as e:  # judged below
            first["error"] = e

    thread = threading.Thread(target=run_first, name="restore-race-first", daemon=True)
    thread.start()
    out: dict[str, Any] = {"structure": structure, "where": where}
    try:
        if not held.wait(60):
            raise FaultError(f"the first restore of {structure} never reached its {where}: {first}")
        step(f"first restore held in its {where}")
        try:
            _restore(g, structure, step)
            out["second"] = "ok"
        except RestoreError as e:
            out["second"] = f"refused: {str(e)[:160]}"
        time.sleep(f.hold)  # clients work on the structure, if the second restore made it ACTIVE
    finally:
        release.set()
        thread.join(120)
    out["first"] = "ok" if "result" in first else f"{type(first.get('error')).__name__}: " \
                                                     f"{str(first.get('error'))[:160]}"
    step("restored order read", restored_order=order_snapshot(g))
    step("heal")
    if (out["first"] == "ok") == (out["second"] == "ok"):
        # both restored it (the checker counts the stale one), or neither did: restore it now, as an operator
        # would, so that the run goes on
        state = _state(g, structure)
        if state != "ACTIVE":
            _restore(g, structure, step)
            out["restored_after"] = True
        if out["first"] == "ok":
            raise FaultError(f"both overlapping restores of {structure} completed")
    return out


def _state(g: ChaosGroup, structure: str) -> str:
    client = g.cf()
    try:
        return Admin(client).state(structure)
    finally:
        client.close()


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
        elif mode == "reply-loss":
            proxy.lose_replies()
        elif mode == "delay":
            proxy.delay(f.params.get("delay_ms", 100) / 1000)
        else:
            proxy.half_open()
        step(f"{which} link {mode}")
        time.sleep(f.hold)
        if mode == "reply-loss":
            proxy.cut()  # the SQM's calls waiting for a reply learn that it is lost (a reset)
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


def _skew(g: ChaosGroup, name: str, skew_ms: int, step: Step) -> float:
    """Restart an SQM with its LRSN clock source skewed by skew_ms (kept for its later restarts)."""
    g.c.kill_manager(name, signal.SIGTERM, timeout=30.0)
    step(f"{name} stopped")
    return _restart(g, name, step, extra_args=["--clock-skew-ms", str(skew_ms)])


def clock_skew(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    skew = int(f.params["skew_ms"])
    out: dict[str, Any] = {"skew_ms": skew, "restart_s": _skew(g, f.target, skew, step)}
    victim = f.params.get("then_kill")
    if victim and g.running(victim):  # the skewed SQM is one of the peers that may recover it
        g.c.kill_manager(victim, signal.SIGKILL)
        step(f"{victim} killed")
        out["peer_recovery_s"] = _peer_recovery(g, victim, step)
        out["victim_restart_s"] = _restart(g, victim, step)
    step("heal")
    return out


# --- the edges of the service: clients that leave, messages near and over the size limits ------------------------
LEAVE_WAIT_MS = 20_000  # the waiting get's wait: far longer than the client stays
EDGE_FRAME = 2**20  # the frame big-messages gives its target SQM: less than EDGE holds (4 MiB by default)
BIG_MEMBER = "QMBIG"  # the in-process member big-messages puts through (its log is in the group's log root)


def _history(g: ChaosGroup) -> History:
    if g.history is None:
        raise FaultError("this fault acts as a client and records its calls: the group has no history")
    return g.history


def _client_ep(g: ChaosGroup, name: str) -> tuple[str, int]:
    """The SQM's address as clients see it: through its client proxy."""
    return "127.0.0.1", g.client_proxies[name].port


def _sized(msg: str, length: int) -> int:
    """The payload size (PutSpec.size) that makes the chaos body of ``msg`` exactly ``length`` bytes long."""
    return length - len(make_body(msg, 0))


def _leave_during_get(g: ChaosGroup, ep: tuple[str, int], correlid: bytes, syncpoint: bool, stay_s: float,
                      reset: bool) -> None:
    """A raw client: hello, a get by correlation id with a long wait, then gone (a close, or a reset) while the
    get waits. Raw, because the client library always reads its reply."""
    sock = socket.create_connection(ep, timeout=5.0)
    try:
        try:
            handshake(sock, token=g.c.token, client_name="leaver", max_frame=PRE_HELLO_MAX_FRAME)
        except MQError as e:
            raise FaultError(f"the leaving client's handshake was refused: {e}") from None
        sock.sendall(encode_frame({"id": 1, "op": "get", "args": {
            "queue": EDGE_QUEUE, "wait_ms": LEAVE_WAIT_MS, "syncpoint": syncpoint, "correlid": correlid}}))
        time.sleep(stay_s)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def client_leaves_waiting_get(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Issue 10, hole 9: a waiting get must end with its connection and take nothing. Each round a client sends
    a get by correlation id with a 20 s wait and leaves; only then is a message with that correlation id put; a
    second client must find it there (a get that outlived its client would have consumed it for nobody: the
    checker's ``undelivered``)."""
    h = _history(g)
    rnd = random.Random(f"leave-{f.n}-{f.at}-{f.target}")
    ep = _client_ep(g, f.target)
    out: dict[str, Any] = {"found_after_leave": 0, "backout_counts": []}
    for i, syncpoint in enumerate((False, True, rnd.random() < 0.5)):
        name, correlid = f"leaver{f.n}.{i}", f"L{f.n}.{i}".encode()
        stay_s, reset = rnd.choice((0.2, 0.5, 1.0)), rnd.random() < 0.5
        op = h.invoke(name, "get", uow=f"{name}.get" if syncpoint else None, queue=EDGE_QUEUE,
                      syncpoint=syncpoint, wait_ms=LEAVE_WAIT_MS, correlid=correlid.hex())
        _leave_during_get(g, ep, correlid, syncpoint, stay_s, reset)
        h.complete(op, CALL_UNKNOWN, reason="client left", left=True)
        step(f"{name} left its waiting get after {stay_s}s ({'reset' if reset else 'close'}, "
             f"syncpoint {syncpoint})")
        time.sleep(0.5)
        msg = f"leave{f.n}-{i}"
        with Client([ep], token=g.c.token, client_name=f"{name}-after", request_timeout=10.0) as c:
            putter = Runner(h, c, f"{name}-putter", f"{name}.put")
            put = partial(c.put, EDGE_QUEUE, make_body(msg, 64), syncpoint=False, correlid=correlid)
            outcome, _ = putter.call("put", put, uow=None, msg=msg, queue=EDGE_QUEUE, priority=0, persistent=True,
                                     syncpoint=False, expiry_ms=0, correlid=correlid.hex())
            if outcome != CALL_OK:
                continue
            time.sleep(1.5)  # a get that outlived its client would have taken it by now
            taker = Runner(h, c, f"{name}-taker", f"{name}.take")
            outcome, got = taker.get(EDGE_QUEUE, wait_ms=2000, correlid=correlid)
            if outcome == CALL_OK:
                out["found_after_leave"] += 1
                out["backout_counts"].append(got[0].backout_count)
            taker.end(outcome == CALL_OK)
    step("heal")
    return out


def big_messages(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Issue 10, hole 10: messages near and over the size limits, in process and through the service. The target
    SQM serves with frames smaller than EDGE holds; an in-process member puts at the queue's limit (and over it:
    refused); through the target a put over its frame is refused at the client (2218), a get of a message its
    reply cannot carry fails (2080) and takes nothing, a browse says so instead of losing its connection; a client
    that accepts small frames is never sent more; healed, the target delivers the longest message whole. A broken
    expectation is a FaultError (the run fails); a message consumed for nobody is the checker's."""
    h = _history(g)
    target = f.target
    other = next((n for n in g.names if n != target), target)
    client = g.cf()
    try:
        limit = Admin(client).queue_def(EDGE_QUEUE).max_msg_length
    finally:
        client.close()
    problems: list[str] = []

    def expect(what: str, outcome: str, res: Any, reason: int | None) -> None:
        got = getattr(res, "reason", None) if outcome != CALL_OK else None
        if got != reason:
            problems.append(f"{what}: expected {reason or 'success'}, got {outcome} {res!r:.160}")

    def body(name: str, length: int, priority: int) -> PutSpec:
        msg = f"big{f.n}-{name}"
        return PutSpec(msg, EDGE_QUEUE, priority, True, 0, _sized(msg, length))

    base = [a for a in g.c.manager(target).get("extra_args", [])]
    if "--max-frame" in base:
        k = base.index("--max-frame")
        del base[k:k + 2]
    g.c.kill_manager(target, signal.SIGTERM, timeout=30.0)
    step("stopped")
    out: dict[str, Any] = {"limit": limit, "frame": EDGE_FRAME}
    longest = body("limit", limit, 9)
    longest_msgid = b""
    try:
        out["restart_s"] = _restart(g, target, step, extra_args=[*base, "--max-frame", str(EDGE_FRAME)])
        qm = QueueManager(QueueManagerConfig(name=BIG_MEMBER, log_root=g.c.log_root, redis_url=g.c.cf_url("member"),
                                             lease_ms=g.lease_ms))
        qm.start()
        try:
            conn = qm.connect()
            inproc = Runner(h, conn, "big-inproc", f"big{f.n}.in")
            for spec in (longest, body("between", (EDGE_FRAME + limit) // 2, 9)):
                outcome, res = inproc.put(spec, syncpoint=True)
                expect(f"in-process put of {spec.msg}", outcome, res, None)
                if spec is longest and outcome == CALL_OK:
                    longest_msgid = res.msgid
            inproc.end(True)
            outcome, res = Runner(h, conn, "big-inproc", f"big{f.n}.over").put(body("over", limit + 1, 0), False)
            expect("in-process put over the queue's limit", outcome, res, 2030)
        finally:
            qm.stop()
        step(f"in-process member put {limit} bytes and {limit + 1} (refused)")
        with Client([_client_ep(g, target)], token=g.c.token, client_name="big-svc", request_timeout=30.0) as c:
            svc = Runner(h, c, "big-svc", f"big{f.n}.svc")
            outcome, res = svc.put(body("wide", EDGE_FRAME + 1024, 0), syncpoint=False)
            expect("put over the target's frame", outcome, res, 2218)
            outcome, res = svc.put(body("fits", EDGE_FRAME - 64 * 1024, 0), syncpoint=True)
            expect("put within the target's frame", outcome, res, None)
            svc.end(True)
            outcome, res = svc.get(EDGE_QUEUE, syncpoint=False)  # the head: one of the p9 messages, > the frame
            expect("get outside syncpoint of a message longer than the target's frame", outcome, res, 2080)
            held = Runner(h, c, "big-svc", f"big{f.n}.svc2")
            outcome, res = held.get(EDGE_QUEUE)
            expect("syncpoint get of a message longer than the target's frame", outcome, res, 2080)
            held.end(False)
            try:
                c.browse(EDGE_QUEUE, limit=50)
                problems.append("browse through the target: its head message fits no reply, yet no refusal")
            except Exception as e:  # noqa: BLE001 (any other failure is what the fault looks for)
                if getattr(e, "reason", None) != 2080:
                    problems.append(f"browse through the target: expected 2080, got {e!r:.160}")
        step("through the target: refusals checked")
        with Client([_client_ep(g, other)], token=g.c.token, client_name="big-narrow", max_frame=EDGE_FRAME,
                    request_timeout=30.0) as c:
            outcome, res = Runner(h, c, "big-narrow", f"big{f.n}.narrow").get(EDGE_QUEUE, syncpoint=False)
            expect("get by a client accepting small frames", outcome, res, 2080)
        one = limit + DESCRIPTOR_ALLOWANCE + 2 * ENVELOPE  # one message at the limit fits; two never
        with Client([_client_ep(g, other)], token=g.c.token, client_name="big-browse", max_frame=one,
                    request_timeout=30.0) as c:
            seen = c.browse(EDGE_QUEUE, limit=50)
            if not (seen and getattr(seen, "more", False)):
                problems.append(f"browse of a queue two of whose messages do not fit one reply: {len(seen)} "
                                f"messages, more={getattr(seen, 'more', None)}")
    finally:
        if g.running(target):
            g.c.kill_manager(target, signal.SIGTERM, timeout=30.0)
        out["heal_restart_s"] = _restart(g, target, step, extra_args=base)
    step("heal")
    if longest_msgid:  # the limits agree: the longest message a queue holds goes through a healed SQM
        with Client([_client_ep(g, target)], token=g.c.token, client_name="big-wide", request_timeout=30.0) as c:
            taker = Runner(h, c, "big-wide", f"big{f.n}.wide")
            outcome, res = taker.get(EDGE_QUEUE, msgid=longest_msgid, wait_ms=2000)
            expect(f"get of {longest.msg} ({limit} bytes) through the healed target", outcome, res, None)
            taker.end(outcome == CALL_OK)
    if problems:
        raise FaultError("; ".join(problems))
    return out


def peer_clock_skew(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """The recovering side's clock lags: every peer of the target runs skewed behind by more than the lease; the
    target dies right after forcing a COMMIT, so a peer completes that commit; then the CF is lost and restored.
    With an idle peer (params["idle"]) the recoverer is that peer, serving no clients and left alone long enough
    that nothing moves its clock on (the other peers are stopped until it has recovered the target, and are
    restarted if they were fenced meanwhile): its RECOVERY record once sorted below the dead member's operations
    (issue 10, hole 2: entries locked for good, the checker's `stuck`). Without one, a busy peer recovers while
    the others commit: the CF once stamped the completed commit where restore did not place it (hole 3: the
    checker's `restore-order`)."""
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
        hit = int(f.params.get("commit", 3))
        g.c.restart_manager(victim, timeout=60.0, env={FAILPOINTS_ENV: f"after-log-force={hit}"})
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
            out["peer_recovery_s"] = _peer_recovery(g, victim, step)
        finally:
            for name in stopped:
                g.cont(name)
    finally:
        if idle:
            g.client_proxies[idle].heal()
    step("heal")
    for name in stopped:  # stopped past its lease: fenced and recovered too, it exits and is restarted
        out[f"{name}_after_stop"] = after_heal(g, name, step)
    out.update(_cf_loss(g, f, step))
    out["restart_s"] = _restart(g, victim, step)  # without the failpoint
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
            result = run_purge(client, "APP1", backup_root=g.c.backup_dir, log_root=g.c.log_root,
                               backup_keys=g.c.backup_keys())
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
        runner = Runner(g.history, c, f"stray-{n}", f"stray-{n}.1", coordinator=None)
        for i in range(2):
            runner.put(PutSpec(f"stray-{n}-{i}", "Q1", 0, True, 0, 64), syncpoint=True)
        runner.end(commit=True)


# --- the persistent store's availability (docs/pstore.md) ------------------------------------------------------
def _pstore(g: ChaosGroup, structure: str, action: str) -> PstoreStatus:
    client = g.cf()
    try:
        return CF(client).structure(structure).pstore(action)
    finally:
        client.close()


def _pstore_off(on: str, off: str, what: str) -> Callable[[ChaosGroup, FaultSpec, Step], dict[str, Any]]:
    """A structure's persistent store disconnected (or its new units of work refused) for the fault's hold, under
    load, then back: what the members refused meanwhile are FAIL outcomes, and nothing may be lost or twice."""
    def fault(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
        structure = str(f.params["structure"])
        _pstore(g, structure, on)
        t = step(f"{structure}: {what}")
        try:
            time.sleep(f.hold)
        finally:
            after = _pstore(g, structure, off)
        out = {"structure": structure, "off_s": round(step("heal") - t, 3)}
        if not after.connected or after.no_new_uows:
            raise FaultError(f"{structure} still unavailable after {off}: connected={after.connected}, "
                             f"no new UOWs={after.no_new_uows or 'no'}")
        return out
    return fault


def reconnect_pstores(g: ChaosGroup) -> list[str]:
    """The safety net of healing: every structure's persistent store connected and taking new units of work (a
    fault that failed midway may have left one off). A structure the CF does not hold is skipped."""
    done = []
    for s in STRUCTURES:
        try:
            st = _pstore(g, s, "status")
            if not st.connected and st.started != "WARM":
                _pstore(g, s, "connect")
                done.append(f"{s} persistent store connected")
            if st.no_new_uows == "OPERATOR":
                _pstore(g, s, "nonew-off")
                done.append(f"{s} takes new units of work")
        except (MQError, redis.RedisError):
            continue
    return done


FAULTS: dict[str, Callable[[ChaosGroup, FaultSpec, Step], dict[str, Any]]] = {
    "sqm-kill": sqm_kill, "sqm-pause": sqm_pause, "cf-kill": cf_kill,
    "cf-kill-during-restore": cf_kill_during_restore, "during-backup": during_backup,
    "cf-link-cut": _link("cf", "cut"), "cf-link-delay": _link("cf", "delay"),
    "cf-link-halfopen": _link("cf", "halfopen"), "cf-link-reply-loss": _link("cf", "reply-loss"),
    "client-link-cut": _link("client", "cut"),
    "client-link-delay": _link("client", "delay"), "client-link-halfopen": _link("client", "halfopen"),
    "disk-full": disk_full, "clock-skew": clock_skew, "peer-clock-skew": peer_clock_skew, "backup": backup,
    "client-leaves-waiting-get": client_leaves_waiting_get, "big-messages": big_messages,
    "cf-kill-during-load-restart": cf_kill_during_load_restart, "restore-race": restore_race,
    "cf-kill-twice": cf_kill_twice, "purge-then-cf-kill": purge_then_cf_kill, "member-own-log-root": member_own_log_root,
    "cf-kill-recauto": cf_kill_recauto,
    "cf-kill-duplex-primary": cf_kill_duplex_primary,
    "cluster-node-kill": cluster_node_kill,
    "pstore-disconnect": _pstore_off("disconnect", "connect", "persistent store disconnected"),
    "no-new-uows": _pstore_off("nonew-on", "nonew-off", "no new units of work"),
}
KINDS = tuple(FAULTS)  # a new kind is one function, one FAULTS row and one line in the table above

__all__ = ["CF_LINK_KINDS", "CLUSTER_SHORT_KINDS", "DUPLEX_KINDS", "FAULTS", "FaultError", "FaultSpec", "KINDS",
           "SHORT_KINDS", "after_heal", "ensure_backups",
           "order_snapshot", "parse_kinds", "reconnect_pstores", "restore_all", "schedule"]
