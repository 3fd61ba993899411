"""One chaos run, and a soak of many: start the group, drive the workload, inject the seed's faults, heal,
resolve what is in doubt, drain, check, report.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cfemu.cf import CF
from cfemu.errors import MQError, NoMessageError, OutcomeUnknownError
from qsg.chaos import report
from qsg.chaos.bodies import delivery_fields, pending_delivery
from qsg.chaos.checker import MUST_BE_ZERO, check
from qsg.chaos.conversations import drain_service, service_queues
from qsg.chaos.faults import (
    DUPLEX_KINDS,
    FAULTS,
    ROWS,
    FaultError,
    FaultSpec,
    after_heal,
    failed_structures,
    reconnect_pstores,
    restore_all,
    schedule,
)
from qsg.chaos.group import DRAINED, QUEUES, STRUCTURES, ChaosGroup
from qsg.chaos.history import FAIL, OK, UNKNOWN, History, load_history
from qsg.chaos.options import ChaosOptions
from qsg.chaos.pubsub_actions import drain_subscribers, topic_queues
from qsg.chaos.workload import Coordinator, Workload
from sqm.service.client import Client

log = logging.getLogger("qsg.chaos")

# A member serves again within this many seconds of a fault's heal, beyond twice the lease (a peer's recovery of
# it, then its restart: a process start, restart recovery and its checkpoint on a loaded two-core machine), plus
# the kind's own allowance (FaultKind.serve_s); ChaosOptions.serve_within_s replaces the sum for every kind.
SERVE_MARGIN_S = 20.0
WATCH_EVERY_S = 0.25  # how often the serving watch probes the members not yet seen serving again


def serve_bound(opts: ChaosOptions, kind: str) -> float:
    """Seconds within which every member must serve again after a fault of this kind has healed."""
    if opts.serve_within_s:
        return opts.serve_within_s
    row = ROWS.get(kind)
    return round(2 * opts.lease_ms / 1000 + SERVE_MARGIN_S + (row.serve_s if row else 0.0), 1)


class ServingWatch:
    """From a fault's heal on, probe every member not yet seen serving (with its current process) until each has
    passed once: when each served again (ChaosGroup.serving), however long the fault's own steps after its heal
    take. A member restarted later is probed again."""

    def __init__(self, group: ChaosGroup) -> None:
        self.g = group
        self.healed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def heal(self) -> None:
        """The fault healed (again): every member must be seen serving from now on."""
        self.healed_at = time.monotonic()
        self.g.forget_serving()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chaos-serving-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            pids = self.g.pids()
            for name, pid in pids.items():
                seen = self.g.serving.get(name)
                if pid is not None and (seen is None or seen[0] != pid) and not self._stop.is_set():
                    self.g.probe(name, timeout=2.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)


@dataclass
class FaultRecord:
    spec: FaultSpec
    started: float = 0.0  # history time
    recovered: float | None = None
    service_s: float | None = None  # injection to full service
    timings: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    unavailable: str = ""
    serving: dict[str, float | None] = field(default_factory=dict)  # member -> seconds from heal to serving again
    serve_bound_s: float | None = None
    failed_structures: list[str] = field(default_factory=list)  # left FAILED by the fault (its restore failed)

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "started": self.started, "recovered": self.recovered,
                "service_s": self.service_s, "timings": self.timings, "error": self.error,
                "unavailable": self.unavailable, "serving": self.serving, "serve_bound_s": self.serve_bound_s,
                "failed_structures": self.failed_structures}


def _execute(group: ChaosGroup, history: History, spec: FaultSpec, bound_s: float) -> FaultRecord:
    rec = FaultRecord(spec, started=history.now(), serve_bound_s=bound_s)
    t0 = time.monotonic()
    # The members' processes as the fault begins (the checker's liveness rule: a member whose process changed
    # since the previous fault's recovery stopped serving between the faults).
    history.fault("inject", **spec.to_json(), pids=group.pids(), serve_bound_s=bound_s)
    watch = ServingWatch(group)
    healed = False

    def step(phase: str, **fields: Any) -> float:
        nonlocal healed
        el = round(time.monotonic() - t0, 3)
        history.fault(phase, fault=spec.n, kind=spec.kind, target=spec.target, elapsed_s=el, **fields)
        if phase == "heal":
            healed = True
            watch.heal()
        return el

    try:
        try:
            rec.timings = FAULTS[spec.kind](group, spec, step)
        finally:
            if not healed:  # a fault with no heal step of its own has healed when it returns
                history.fault("healed", fault=spec.n, kind=spec.kind, elapsed_s=round(time.monotonic() - t0, 3))
                watch.heal()
    except FaultError as e:
        if str(e).startswith("unavailable"):
            rec.unavailable = str(e)
        else:
            rec.error = str(e)
        history.fault("error", fault=spec.n, kind=spec.kind, error=str(e))
    except Exception as e:  # the report shows it; healing below still runs
        log.exception("fault %d (%s) failed", spec.n, spec.kind)
        rec.error = f"{type(e).__name__}: {e}"
        history.fault("error", fault=spec.n, kind=spec.kind, error=rec.error)
    # A fault that failed may have left a structure FAILED (its restore failed): nothing brings it back, no member
    # serves its queues, so the run waits for no service that cannot come; it ends after this fault (run_chaos).
    rec.failed_structures = failed_structures(group) if rec.error else []
    if rec.failed_structures:
        rec.error += f" (structures left FAILED: {', '.join(rec.failed_structures)}; the run stops here)"
        history.fault("error", fault=spec.n, kind=spec.kind, error=rec.error,
                      failed_structures=rec.failed_structures)
        watch.stop()
        return rec
    # Healed, then every SQM must serve. One can still go down just after its probe passed (fenced a moment after
    # its link healed, the lease having lapsed during the fault): heal again, as an operator would.
    deadline = time.monotonic() + 90.0
    service = None
    while service is None and time.monotonic() < deadline:
        heal(group, history)
        service = group.wait_service(timeout=min(20.0, max(1.0, deadline - time.monotonic())))
    watch.stop()
    pids = group.pids()
    for name, pid in pids.items():
        seen = group.serving.get(name)
        after = round(seen[1] - watch.healed_at, 3) if seen is not None and seen[0] == pid else None
        rec.serving[name] = after
        # When the member was seen serving again after the heal (None: not, with the process it runs now).
        history.fault("serving again", fault=spec.n, kind=spec.kind, member=name, pid=pid, after_heal_s=after,
                      bound_s=bound_s)
    served = [v for v in rec.serving.values() if v is not None]
    if served:
        rec.timings.setdefault("serve_again_s", max(served))
    if service is not None:
        rec.service_s = round(time.monotonic() - t0, 3)
        rec.recovered = history.now()
        history.fault("recovered", fault=spec.n, kind=spec.kind, service_s=rec.service_s, pids=pids)
    else:
        rec.error = rec.error or "no full service within 90s of healing"
        history.fault("error", fault=spec.n, kind=spec.kind, error=rec.error)
    return rec


def heal(group: ChaosGroup, history: History) -> list[str]:
    """Undo whatever is still broken (a safety net: each fault heals itself): network, a full disk, paused
    managers, a dead CF (restarted and restored), dead or non-serving managers (restarted)."""
    actions: list[str] = []

    def step(what: str, **fields: Any) -> float:
        actions.append(what)
        return 0.0

    group.heal_network()
    if group.backups_paused is not None:
        group.resume_backups()
        step("backup scheduler resumed")
    if group.disk is not None:
        group.disk.free()
    for name in list(group.stopped):
        group.cont(name)
        step(f"SIGCONT {name}")
    if "CF" not in group.c.running_processes():
        group.c.restart_cf()
        step("CF restarted")
        restore_all(group, step)
    for what in reconnect_pstores(group):
        step(what)
    for name in group.names:
        if group.running(name):
            after_heal(group, name, step)
        else:
            # A peer that runs recovers the dead member (its lease lapsed): the restart waits for that, so that the
            # two do not recover it at once. With none running nobody will: the restart recovers it itself.
            if any(group.running(other) for other in group.names if other != name):
                group.wait_peer_recovered(name, 30.0)
            group.c.restart_manager(name, timeout=60.0)
            step(f"{name} restarted")
    if actions:
        history.note(what="heal", actions=actions)
    return actions


def resolve_in_doubt(group: ChaosGroup, coordinator: Coordinator) -> dict[str, int]:
    """The coordinator's final pass: every UOW still in doubt on any SQM is resolved (its decision, or backout
    when the client never learned whether its prepare worked). The operator lists them (an application may list
    only the xids it names); the coordinator resolves each as an application, naming its xid."""

    found: dict[str, list[dict[str, Any]]] = {}
    for name, ep in group.direct.items():
        with Client([ep], token=group.c.operator_token, role="operator", client_name="operator-final") as c:
            found[name] = c.indoubt()
    resolved = coordinator.resolve_all(found)
    left = 0
    for _name, ep in group.direct.items():
        with Client([ep], token=group.c.operator_token, role="operator", client_name="operator-final") as c:
            left += len(c.indoubt())
    return {"in doubt after healing": sum(len(v) for v in found.values()), "resolved": resolved,
            "still in doubt": left}


# A queue whose every get fails for this long is left as it is (its structure lost for good, say): the drain goes
# on to the next queue rather than wait for good, and what the queue still holds the checker counts.
DRAIN_REFUSED_S = 60.0


def drain(group: ChaosGroup, history: History) -> int:
    """Get every message off every workload queue, outside syncpoint, each get in the history (op drain)."""

    n = 0
    eps = list(group.direct.values())
    with Client(eps, token=group.c.token, client_name="drain", request_timeout=30.0) as c:
        for q in DRAINED:
            failing_since: float | None = None
            while True:
                op = history.invoke("drain", "drain", queue=q)
                try:
                    m = c.get(q, syncpoint=False)
                except NoMessageError as e:
                    history.complete(op, FAIL, reason=e.reason_name)
                    break
                except OutcomeUnknownError as e:  # a pending get delivered its message with the error
                    delivered = pending_delivery(e, c.qmgr)
                    history.complete(op, UNKNOWN, reason=e.reason_name, **delivered)
                    n += bool(delivered)
                    continue
                except MQError as e:
                    history.complete(op, FAIL, reason=e.reason_name, detail=str(e)[:200])
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > DRAIN_REFUSED_S:  # the checker counts what is left
                        history.note(what="drain gave up", queue=q, reason=e.reason_name, seconds=DRAIN_REFUSED_S)
                        break
                    time.sleep(0.5)
                    continue
                failing_since = None
                history.complete(op, OK, **delivery_fields(m, c.qmgr))
                n += 1
    return n


SETTLE_S = 15.0  # how long leftovers looks again at entries that members' own short units of work may hold


def leftovers(group: ChaosGroup) -> dict[str, dict[str, int]]:
    """What is still in the structures after the drain (entries locked by a UOW nobody resolved, for example)."""
    client = group.cf()
    try:
        cf = CF(client)
        return settled_leftovers(lambda: left_in(cf), SETTLE_S)
    finally:
        client.close()


def left_in(cf: CF) -> dict[str, dict[str, int]]:
    """One look at the structures: the queues with entries that count as left behind, by state."""
    out = {}
    for s in STRUCTURES:
        for q, states in cf.structure(s).depths().items():
            # The service's control queue keeps final statuses: only its locked entries count there.
            held = states["UP"] or states["UG"]
            # A topic keeps publications until its sweeper removes them: only its locked entries count.
            if q in DRAINED and any(states.values()) or q in (*service_queues(), *topic_queues()) and held \
                    or q == service_queues()[0] and any(states.values()):
                out[q] = states
    return out


def settled_leftovers(look: Callable[[], dict[str, dict[str, int]]], settle_s: float,
                      interval_s: float = 0.25) -> dict[str, dict[str, int]]:
    """What `look` still finds left behind once the members' own short units of work had time to end. A topic's and
    a service's queues are where members work by themselves after the drain: the sweepers remove a topic's backlog
    and take a service's UOW controls one at a time to change or delete them (a few CF round trips each, about once
    a second per member), so one look can find such an entry locked for a moment. `look` is asked again until none
    of those queues is in its answer, for at most `settle_s`: what it still finds then counts. The workload's own
    queues count at the first look (nothing works on them after the drain)."""
    transient = {*service_queues(), *topic_queues()}
    deadline = time.monotonic() + settle_s
    while True:
        out = look()
        if not set(out) & transient or time.monotonic() >= deadline:
            return out
        time.sleep(interval_s)


def heal_and_drain(group: ChaosGroup, history: History, coordinator: Coordinator, extra: dict[str, Any],
                   bar: Progress) -> None:
    """The run's end: heal, every member serving, what is in doubt resolved, every queue drained, what is left."""
    task = bar.add_task("heal, resolve in-doubt, drain", total=None, info="")
    heal(group, history)
    extra["service after healing"] = group.wait_service(timeout=90.0) is not None
    extra["in doubt"] = resolve_in_doubt(group, coordinator)
    extra["drained"] = drain(group, history)
    extra["service"] = drain_service(history, list(group.direct.values()), group.c.token)
    extra["topic"] = drain_subscribers(history, list(group.direct.values()), group.c.token)
    extra["left in the structures"] = leftovers(group)
    history.note(what="drained", **{k: v for k, v in extra.items() if k != "in doubt"})
    bar.update(task, total=1, completed=1, info=f"{extra['drained']} drained")


def run_chaos(opts: ChaosOptions, console: Console | None = None,
              specs: list[FaultSpec] | None = None) -> dict[str, Any]:
    """One run; returns the summary (also written to the report directory). specs: a scripted fault schedule
    (the demo's) instead of the seed's."""
    console = console or Console(stderr=True)
    rdir = Path(opts.report_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    history_path = rdir / "history.jsonl"
    history_path.unlink(missing_ok=True)
    history = History(history_path, seed=opts.seed, options=opts.to_json())
    group = ChaosGroup(rdir / "cluster", managers=opts.managers, lease_ms=opts.lease_ms,
                       backup_interval=opts.backup_interval, log_disk="disk-full" in opts.kinds,
                       duplex=any(k in DUPLEX_KINDS for k in opts.kinds), redis_cluster=opts.redis_cluster,
                       rest=opts.rest)
    group.history = history
    group.seed = opts.seed
    if specs is None:
        specs = schedule(opts.seed, opts.kinds, opts.duration, [f"QM{i}" for i in range(1, opts.managers + 1)],
                         lease_ms=opts.lease_ms)
    group.history = history
    records: list[FaultRecord] = []
    phases: dict[str, float] = {}
    extra: dict[str, Any] = {}
    t_start = time.monotonic()
    try:
        group.up()
        history.note(what="group up", seconds=round(time.monotonic() - t_start, 2),
                     disk_unavailable=group.disk_unavailable)
        coordinator = Coordinator(history, group.direct, token=group.c.token, operator_token=group.c.operator_token)
        work = Workload(history, group.client_endpoints, coordinator, seed=opts.seed, clients=opts.clients,
                        queues=QUEUES, token=group.c.token,
                        rest_endpoints=group.rest_endpoints if opts.rest else None,
                        rest_reachable=group.clients_reach, kombu=opts.kombu)
        with Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=not console.is_terminal) as bar:
            task = bar.add_task(f"seed {opts.seed}: workload", total=opts.duration, info="")
            t0 = time.monotonic()
            history.note(what="workload start")
            work.start()
            pending = list(specs)

            def tick(info: str = "") -> float:
                el = time.monotonic() - t0
                bar.update(task, completed=min(el, opts.duration),
                           info=info or f"{work.actions_done} actions, {len(records)}/{len(specs)} faults")
                return el

            lost: list[str] = []
            while not lost and tick() < opts.duration:
                if pending and time.monotonic() - t0 >= pending[0].at:
                    spec = pending.pop(0)
                    tick(f"fault {spec.n}: {spec.kind} on {spec.target}")
                    records.append(_execute(group, history, spec, serve_bound(opts, spec.kind)))
                    lost = records[-1].failed_structures
                    continue
                time.sleep(0.1)
            history.note(what="workload stop", pids=group.pids())
            stuck = work.stop()
            if stuck:
                extra["client threads still running at stop"] = stuck
            phases["workload_s"] = round(time.monotonic() - t0, 2)
            if lost:
                # Healing, resolving and draining need every structure: with one FAILED the run ends here, its
                # report saying so (the fault's error) rather than waiting on queues no member can serve.
                extra["stopped"] = f"structures left FAILED (their restore failed): {', '.join(lost)}"
                history.note(what="run stopped", failed_structures=lost)
            else:
                t1 = time.monotonic()
                heal_and_drain(group, history, coordinator, extra, bar)
                phases["heal_drain_s"] = round(time.monotonic() - t1, 2)
    finally:
        history.close()
        group.down()
        # Every process's own log (SQMs, CF, backup scheduler) stays with the report: small, and the first thing
        # to read when a fault did not go as planned.
        with contextlib.suppress(OSError):
            shutil.copytree(group.dir / "run", rdir / "process-logs", dirs_exist_ok=True)
        if not opts.keep_cluster:
            group.remove()
    t2 = time.monotonic()
    events = load_history(history_path)
    result = check(events)
    phases["check_s"] = round(time.monotonic() - t2, 2)
    phases["total_s"] = round(time.monotonic() - t_start, 2)
    summary = report.summarize(opts, events, result, [r.to_json() for r in records], phases, extra,
                               disk_unavailable=group.disk_unavailable)
    report.write_report(rdir, summary, result, events)
    return summary


def run_soak(base: ChaosOptions, seeds: list[int], console: Console | None = None) -> dict[str, Any]:
    """Many runs, one per seed, each with its own report directory under base.report_dir/seed-N."""
    console = console or Console(stderr=True)
    runs = []
    for seed in seeds:
        opts = ChaosOptions(**{**asdict(base), "seed": seed, "report_dir": Path(base.report_dir) / f"seed-{seed}"})
        s = run_chaos(opts, console)
        bad = sum(s["findings"][k] for k in MUST_BE_ZERO)
        console.print(f"seed {seed}: {s['operations']} operations, faults "
                      f"{', '.join(f['kind'] for f in s['faults']) or 'none'}: "
                      f"{'[bold red]' + str(bad) + ' FINDINGS[/]' if bad else 'no findings'}")
        runs.append(s)
    soak = report.summarize_soak(base, runs)
    report.write_soak(Path(base.report_dir), soak)
    return soak


__all__ = ["ChaosOptions", "FaultRecord", "heal", "run_chaos", "run_soak"]
