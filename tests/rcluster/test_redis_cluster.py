"""The CF spread over a local 3-master Redis Cluster, each structure in one slot (docs/architecture.md, "Structures
spread over a Redis Cluster"): real redis-server processes in cluster mode, in-process members, backup and restore
over a ``redis+cluster://`` URL."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from backup.run import run_backup
from cfemu import keys, lua, rcluster
from cfemu.admin import Admin
from cfemu.connection import ConnectionConfigError, connect
from cfemu.embedded_rcluster import EmbeddedCluster
from cfemu.errors import MQError, NoMessageError
from restore.run import run_restore
from sqm.core.manager import QueueManager
from tests.support.group import start_qm

# Each of these lands on another master of a 3-master cluster with the slots split evenly (checked below).
STRUCTURES = {"APP1": ("Q1",), "APP2": ("Q2",), "APP3": ("Q3",)}


def define(cl: EmbeddedCluster) -> redis.Redis:
    client = connect(cl.url("operator"))
    admin = Admin(client)
    for s, queues in STRUCTURES.items():
        admin.ensure_structure(s, queues)
    return client


def put_committed(qm: QueueManager, queue: str, bodies: list[bytes]) -> None:
    conn = qm.connect()
    for b in bodies:
        conn.put(queue, b)
        conn.commit()


def drain(qm: QueueManager, queue: str, out: list[bytes] | None = None) -> list[bytes]:
    """Every message of ``queue``, each got and committed; into ``out`` as each is committed, so that a caller that
    retries after an error (a cluster settling after a failover) keeps those taken before it."""
    conn = qm.connect()
    out = [] if out is None else out
    while True:
        try:
            body = conn.get(queue).body
        except NoMessageError:
            break
        conn.commit()
        out.append(body)
    return out


def test_a_cluster_url_is_checked_before_anything_is_sent() -> None:
    with pytest.raises(ConnectionConfigError, match="bad address"):
        connect("redis+cluster://127.0.0.1:7000/?node=127.0.0.1:notaport")


def test_every_script_names_the_keys_of_one_hash_tag_only() -> None:
    """A script that touched two tags would be refused by a cluster (CROSSSLOT): a structure script gets the
    structure's eight keys (one tag); an admin script's KEYS are all {ADMIN}'s, but raise_fence, which gets one
    structure's fence and nothing else."""
    assert {k.split("}")[0] for k in keys.script_keys("APP1")} == {"{APP1"}
    for name in lua.admin_operations():
        header = next(line for line in lua.source(name).splitlines() if line.startswith("-- KEYS"))
        tags = {part.split("}")[0] + "}" for part in header.split("{")[1:]}
        assert len(tags) == 1, f"{name} names keys of several tags: {header}"


def test_structures_spread_over_the_masters_and_members_work_on_each(redis_cluster: EmbeddedCluster,
                                                                    tmp_path: Path) -> None:
    cl = redis_cluster
    client = define(cl)
    masters = {s: cl.master_of(s) for s in STRUCTURES}
    assert len(set(masters.values())) == 3, masters  # one structure per master
    assert {s: rcluster.master_of(client, s) for s in STRUCTURES} == {s: cl.address(n) for s, n in masters.items()}
    # Every key of a structure is on its master, none elsewhere; the admin structure is on its own slot's master.
    for s, node in masters.items():
        for other in cl.nodes:
            found = list(cl.admin_client(other).scan_iter(match=f"{{{s}}}:*"))
            assert bool(found) == (other == node), (s, other)
    assert list(cl.admin_client(cl.master_of("ADMIN")).scan_iter(match="{ADMIN}:*"))
    # cfemu status names each structure's slot and master
    from qsg.status_cli import gather_status
    rows = {r["name"]: r for r in gather_status(Admin(client), tmp_path)["structures"]}
    assert {s: (r["slot"], r["master"]) for s, r in rows.items()} == {
        s: (rcluster.slot_of(s), cl.address(n)) for s, n in masters.items()}

    logs = tmp_path / "logs"
    qm1 = start_qm(cl.url("member"), logs, "QM1", background=False)
    qm2 = start_qm(cl.url("member"), logs, "QM2", background=False)
    try:
        for s, (q,) in STRUCTURES.items():
            put_committed(qm1, q, [f"{s}-{i}".encode() for i in range(5)])
        for s, (q,) in STRUCTURES.items():
            assert drain(qm2, q) == [f"{s}-{i}".encode() for i in range(5)]
    finally:
        qm1.stop()
        qm2.stop()


def test_one_structure_is_restored_while_the_others_keep_working_on_other_masters(
        redis_cluster: EmbeddedCluster, tmp_path: Path) -> None:
    cl = redis_cluster
    client = define(cl)
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    qm1 = start_qm(cl.url("member"), logs, "QM1", background=False)
    qm2 = start_qm(cl.url("member"), logs, "QM2", background=False)
    try:
        put_committed(qm1, "Q1", [b"before-%d" % i for i in range(20)])
        backup_client = connect(cl.url("backup"))
        run_backup(backup_client, "APP1", backups, log_root=logs)
        put_committed(qm1, "Q1", [b"after-%d" % i for i in range(20)])  # only in the logs
        qm1.log.force() if qm1.log else None  # type: ignore[func-returns-value]
        # APP1's master loses it (its keys only); the other masters and the admin structure are untouched.
        node = cl.master_of("APP1")
        assert node not in (cl.master_of("APP2"), cl.master_of("APP3"), cl.master_of("ADMIN"))
        doomed = list(cl.admin_client(node).scan_iter(match="{APP1}:*"))
        cl.admin_client(node).delete(*doomed)
        assert Admin(client).state("APP1") == "FAILED"

        stop = threading.Event()
        served: list[int] = []
        errors: list[str] = []

        def others() -> None:  # work on APP2 and APP3 all along the restore
            conn = qm2.connect()
            while not stop.is_set():
                try:
                    for q in ("Q2", "Q3"):
                        conn.put(q, b"x")
                        conn.commit()
                        conn.get(q)
                        conn.commit()
                    served.append(1)
                except MQError as e:
                    errors.append(str(e))

        worker = threading.Thread(target=others, daemon=True)
        worker.start()
        t0 = time.monotonic()
        try:
            result = run_restore(connect(cl.url("restore")), "APP1", backup_root=backups, log_root=logs)
        finally:
            took = time.monotonic() - t0
            time.sleep(0.2)
            stop.set()
            worker.join(10)
        assert errors == [] and len(served) > 0, (errors, len(served), took)
        assert result.loaded_entries == 40
        assert Admin(client).state("APP1") == "ACTIVE"
        assert sorted(drain(qm2, "Q1")) == sorted([b"before-%d" % i for i in range(20)]
                                                  + [b"after-%d" % i for i in range(20)])
    finally:
        qm1.stop()
        qm2.stop()


def recovery_hook(cl: EmbeddedCluster, backups: Path, logs: Path):  # type: ignore[no-untyped-def]
    """A member's RECAUTO restore, as qsg.member wires it into ``sqm run``: run_restore with the restore role."""
    def recover(structure: str, progress):  # type: ignore[no-untyped-def]
        client = connect(cl.url("restore"))
        try:
            r = run_restore(client, structure, backup_root=backups, log_root=logs, progress=progress)
        finally:
            client.close()
        return {"backup": r.backup_id, "base_kind": r.base_kind, "replay_from": r.replay_from,
                "summary": f"{r.loaded_entries} entries", "report": r.report_path}
    return recover


class Producer:
    """Committed puts on a queue through one member, each its own UOW; what the application was told."""

    def __init__(self, qm: QueueManager, queue: str) -> None:
        self.qm, self.queue = qm, queue
        self.acked: list[bytes] = []
        self.maybe: list[bytes] = []
        self.failures = 0
        self.last_error: MQError | None = None  # named when a wait on this producer times out
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = self.qm.connect()
        i = 0
        while not self.stop.is_set():
            body = b"%s-%d" % (self.queue.encode(), i)
            i += 1
            try:
                conn.put(self.queue, body)
            except MQError as e:
                self.failures += 1
                self.last_error = e
                try:
                    conn.backout()
                except MQError:
                    pass
                time.sleep(0.05)
                continue
            try:
                conn.commit()
                self.acked.append(body)
            except MQError as e:
                self.maybe.append(body)
                self.failures += 1
                self.last_error = e
                time.sleep(0.05)

    def __repr__(self) -> str:
        return (f"Producer({self.queue}: {len(self.acked)} acked, {self.failures} failures, last error "
                f"{self.last_error!r}, thread {'alive' if self.thread.is_alive() else 'ended'})")

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def wait_for(cond, timeout: float, what: str, about: object = None) -> float:  # type: ignore[no-untyped-def]
    """Seconds until cond() holds; AssertionError after timeout, naming what cond last raised and `about`."""
    t0 = time.monotonic()
    last: Exception | None = None  # what the condition last raised, named if it times out
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except (MQError, redis.exceptions.RedisError) as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last!r}; {about!r})")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["APP1", "APP2"])
def test_a_master_killed_under_load_has_its_structures_restored_automatically_and_nothing_is_lost(
        redis_cluster: EmbeddedCluster, tmp_path: Path, victim: str) -> None:
    """SIGKILL the master holding a structure (no replica): the other masters keep serving APP3 meanwhile; the
    node comes back empty on its port (as the launcher's supervisor brings it back); a member restores the
    structure by itself (RECAUTO) from its backup and the logs; every acknowledged put is there, once. APP2 shares
    its master with the admin structure: the members re-join the admin structure that came back empty."""
    cl = redis_cluster
    queue = STRUCTURES[victim][0]
    client = define(cl)
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    hook = recovery_hook(cl, backups, logs)
    qm1 = start_qm(cl.url("member"), logs, "QM1", recover_structure=hook)
    qm2 = start_qm(cl.url("member"), logs, "QM2", recover_structure=hook)
    try:
        put_committed(qm1, queue, [b"early-%d" % i for i in range(10)])
        for s in STRUCTURES:
            run_backup(connect(cl.url("backup")), s, backups, log_root=logs)
        node = cl.master_of(victim)
        assert (node == cl.master_of("ADMIN")) == (victim == "APP2") and node != cl.master_of("APP3")
        with Producer(qm1, queue) as p1, Producer(qm2, "Q3") as p3:
            wait_for(lambda: len(p1.acked) >= 20 and len(p3.acked) >= 20, 30, "load on APP1 and APP3")
            pid = cl.kill(node)
            killed = time.monotonic()
            assert pid
            served_before = len(p3.acked)
            wait_for(lambda: len(p3.acked) > served_before + 10, 20, "APP3 to keep working meanwhile", p3)
            time.sleep(1.5)  # past the cluster's node timeout: the others see the master failed
            cl.start_node(node)  # back empty on its port, owning its slots again
            wait_for(lambda: Admin(client).state(victim) == "ACTIVE", 90, f"{victim} ACTIVE again (RECAUTO)")
            acked_at_kill = len(p1.acked)
            wait_for(lambda: len(p1.acked) > acked_at_kill + 5, 30, f"puts on {victim} again", p1)
            to_full_service = time.monotonic() - killed
            # The structures that outlived the node (and, for APP2, the admin structure) serve the re-joined
            # members: their fences carry the members' new epochs (cfemu.repository.redefine_survivors).
            served_after = len(p3.acked)
            # A bound with room for a loaded machine: CI runs this beside other whole groups.
            wait_for(lambda: len(p3.acked) > served_after + 10, 45, "APP3 to serve the re-joined members", p3)
        assert not qm1.fenced and not qm2.fenced
        recoveries = qm1.counters.get("structure_recoveries_completed", 0) + qm2.counters.get(
            "structure_recoveries_completed", 0)
        assert recoveries == 1, (qm1.counters, qm2.counters)
        got = drain(qm2, queue)
        acked = [b"early-%d" % i for i in range(10)] + p1.acked
        assert len(got) == len(set(got)), "a message delivered twice"
        assert set(acked) <= set(got), f"lost: {sorted(set(acked) - set(got))[:5]}"
        assert set(got) <= set(acked) | set(p1.maybe)
        print(f"kill to full service: {to_full_service:.1f}s; acked {len(acked)}, maybe {len(p1.maybe)}")
    finally:
        qm1.stop()
        qm2.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_master_killed_with_a_replica_has_the_replica_promoted_and_its_structure_served_without_restore(
        redis_cluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With a replica per master, SIGKILL of APP1's master promotes its replica (cluster-node-timeout 1 s); the
    members follow the new slot map by themselves and APP1 is served again with no restore (the members here have
    none to run). What the replica had received is there: the test waits for the replica (WAIT) before the kill,
    because Redis replication is asynchronous (docs/cf-layout.md: without that, the last acknowledged operations
    may be missing from the promoted copy, which is why the launcher restores instead)."""
    cl: EmbeddedCluster = redis_cluster_factory(replicas=1)
    client = define(cl)
    logs = tmp_path / "logs"
    qm1 = start_qm(cl.url("member"), logs, "QM1")
    qm2 = start_qm(cl.url("member"), logs, "QM2")
    try:
        put_committed(qm1, "Q1", [b"m-%d" % i for i in range(20)])
        node = cl.master_of("APP1")
        assert cl.admin_client(node).execute_command("WAIT", 1, 5000) == 1  # the replica has it all
        cl.kill(node)
        t0 = time.monotonic()
        wait_for(lambda: cl.master_of("APP1") != node, 30, "the replica promoted")
        promoted = cl.master_of("APP1")
        assert cl.role(promoted) == "master"
        got: list[bytes] = []
        wait_for(lambda: len(drain(qm2, "Q1", got)) >= 20, 30, "APP1 served again")
        print(f"kill to service on the promoted replica: {time.monotonic() - t0:.1f}s")
        assert sorted(got) == sorted(b"m-%d" % i for i in range(20))
        rcluster.refresh(client)  # this client has not met the failover yet: its first call would, and fail
        assert Admin(client).state("APP1") == "ACTIVE" and Admin(client).structure_def("APP1")
        put_committed(qm1, "Q1", [b"after"])
        assert drain(qm2, "Q1") == [b"after"]
        assert not qm1.fenced and not qm2.fenced
    finally:
        qm1.stop()
        qm2.stop()
