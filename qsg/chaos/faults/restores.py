"""What every CF loss shares: backups checked first, the restores an operator runs (each a span in the history for
the checker's restore rules), and each queue's get order read on the live CF before the loss and after the restore
(docs/invariants.md, invariant 7)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from backup.catalog import OK, list_backups
from backup.run import run_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import BackupRunningError
from cfemu.progress import Progress, no_progress
from qsg.chaos.bodies import parse_body
from qsg.chaos.faults.heal import after_heal, client_ep, history_of
from qsg.chaos.faults.kind import FaultError, FaultSpec, Step
from qsg.chaos.group import EDGE_QUEUE, STRUCTURES, ChaosGroup
from qsg.chaos.history import OK as CALL_OK
from qsg.chaos.workload import PutSpec, Runner, make_body
from restore.engine import LOAD
from restore.result import RestoreResult
from restore.run import RestoreError, RestoreStoppedError, run_restore
from sqm.core.clock import now_ms
from sqm.service.client import Client

ORDER_LIMIT = 100_000  # messages per queue an order snapshot reads


def ensure_backups(g: ChaosGroup) -> None:
    """A CF loss needs a good backup of every structure; take one now if the scheduler has not yet."""

    for s in STRUCTURES:
        if any(b.state == OK for b in list_backups(g.c.backup_dir, s, backup_keys=g.c.backup_keys())):
            continue
        backup_structure(g, s)


def backup_structure(g: ChaosGroup, structure: str,
                     on_step: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """A backup of the structure, as cfbackup runs it; after the scheduler's, when that one is running."""
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


class HeldInThread:
    """A step (a restore, a backup) run in a thread of its own and held where it calls `hold` (once: its first
    call), until `release`; what it returned, or what it raised, for the fault to judge. `hold` is handed to `run`."""

    def __init__(self, name: str, run: Callable[[Callable[[], None]], Any]) -> None:
        self.held, self._released = threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False  # run returned
        self.thread = threading.Thread(target=self._run, args=(run,), name=name, daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[Callable[[], None]], Any]) -> None:
        try:
            self.result = run(self.hold)
            self.finished = True
        except Exception as e:  # judged by the fault
            self.error = e

    def hold(self) -> None:
        if not self.held.is_set():
            self.held.set()
            self._released.wait(120)

    def release(self) -> None:
        """Let it go on, and wait for its end."""
        self._released.set()
        self.thread.join(120)

    def outcome(self, ok: str = "ok") -> str:
        return ok if self.finished else f"{type(self.error).__name__}: {str(self.error)[:160]}"


def restore_engine(seed: int, restore: int) -> dict[str, int]:
    """The engine options of a run's restore number `restore` (the same for a seed run again)."""
    return dict(random.Random(f"restore-{seed}-{restore}").choice(RESTORE_ENGINES))


def restore_structure(g: ChaosGroup, structure: str, step: Step,
                      progress: Progress = no_progress, mark_failed: bool = False) -> RestoreResult:
    """run_restore, as the operator runs cfrestore, with its span in the history for the checker: 'restore
    began' and 'restore ended' events carrying the restore's number, the structure and its queues, the CF's
    identity at each end, the outcome (ok, refused, stopped, failed) and, when the CF changed under the restore,
    how many keys only a restore writes the new CF held right after it (written_into_new_cf). mark_failed: of a
    live structure, as `cfrestore run --mark-failed`."""
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
                           backup_keys=g.c.backup_keys(), engine_options=engine, mark_failed=mark_failed)
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
                restore_structure(g, s, step, progress)
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
                    restore_structure(g, earlier, step)
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


class UowAcrossRestore:
    """A unit of work the fault opens on a structure before the structure fails, and commits while its restore runs
    (held in its plan, or at the start of its load, after it read the logs): a put and a get by correlation id
    (of a message put for it outside syncpoint just before), all through the target SQM and in the history. The
    member forces the COMMIT and the structure cannot take it: the application must hear that the outcome is
    pending (the history's `unknown`), never that it committed, since a restore that read the logs before the
    COMMIT backs the unit of work out (a put acknowledged then is `lost`, a get acknowledged then `duplicated`).
    On APP1 it works on EDGE; on APP2 on Q3, the workload's (its get may then find its message taken: the put
    alone is at stake)."""

    def __init__(self, g: ChaosGroup, f: FaultSpec, structure: str, step: Step) -> None:
        h = history_of(g)
        self.name = f"race{f.n}"
        queue = EDGE_QUEUE if structure == "APP1" else STRUCTURES[structure][0]
        correlid = f"R{f.n}".encode()
        self.client = Client([client_ep(g, f.target)], token=g.c.token, client_name=self.name,
                             request_timeout=10.0)
        self.runner = Runner(h, self.client, self.name, f"{self.name}.uow")
        taken = f"{self.name}-take"
        putter = Runner(h, self.client, f"{self.name}-putter", f"{self.name}.put1")
        putter.call("put", partial(self.client.put, queue, make_body(taken, 64), syncpoint=False, correlid=correlid),
                    uow=None, msg=taken, queue=queue, priority=0, persistent=True, syncpoint=False, expiry_ms=0,
                    correlid=correlid.hex())
        outcome, _ = self.runner.put(PutSpec(f"{self.name}-put", queue, 0, True, 0, 64), syncpoint=True)
        self.open = outcome == CALL_OK
        if self.open:
            self.runner.get(queue, wait_ms=1000, correlid=correlid)
        step(f"{self.name}: a unit of work open on {queue}" if self.open else f"{self.name}: its put failed")

    def commit(self) -> str:
        """Commit it now: the outcome the history recorded (ok, fail, unknown), or "none" when it never opened."""
        if not self.open:
            return "none"
        outcome, _ = self.runner.call("commit", self.client.commit, uow=self.runner.uow)
        return str(outcome)

    def close(self) -> None:
        self.client.close()


def lose_cf(g: ChaosGroup, f: FaultSpec, step: Step, *, kill_during_load: bool = False,
            restart_at_once: bool = False) -> dict[str, Any]:
    """The CF killed -9, held down for the fault's hold, restarted empty, and every structure restored."""
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


def structure_state(g: ChaosGroup, structure: str) -> str:
    """The structure's state as the CF holds it (ACTIVE, FAILED, ...)."""
    client = g.cf()
    try:
        return Admin(client).state(structure)
    finally:
        client.close()


def failed_structures(g: ChaosGroup) -> list[str]:
    """The structures the CF holds FAILED (lost with a CF whose restore failed): nothing in a run brings one back
    once its fault has ended. None listed when the CF does not answer (a restart of the CF heals that)."""
    client = g.cf()
    try:
        admin = Admin(client)
        return [s for s in STRUCTURES if admin.state(s) == "FAILED"]
    except redis.RedisError:
        return []
    finally:
        client.close()


def live_work(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
    """Full service (an SQM that exited, fenced, or stopped serving after the loss is restarted, as an operator
    would), then the workload goes on for the fault's live_s: the work the next loss must keep."""
    restarted = {name: out for name in g.names if (out := after_heal(g, name, step))}
    if g.wait_service(timeout=60.0) is None:
        raise FaultError("no full service within 60s of the restore")
    step("full service: live work")
    time.sleep(float(f.params.get("live_s", 2.0)))
    return restarted


__all__ = ["ORDER_LIMIT", "RESTORE_ENGINES", "HeldInThread", "UowAcrossRestore", "backup_structure", "ensure_backups",
           "failed_structures", "live_work",
           "lose_cf", "order_snapshot", "restore_all", "restore_engine", "restore_structure", "structure_state"]
