"""docker-compose.yml run for real, the way a user runs it (opt-in: `pytest -m compose`, or `make compose-test`).

`docker-compose up -d` brings up the secured group (the CF with its default user off, QM1-QM3 authenticating every
client, the backup scheduler, the CF's exporter, a Spark master and worker); the test then drives it from the host
through the 127.0.0.1-published ports with the application token the README says to take from the tools service:
- the scheduler's metrics port and the exporter's answer (the exporter with the CF's INFO, again after the CF's
  loss, without a restart);
- an attacker's view first: the CF answers NOAUTH, the service refuses no token, a wrong token, and an
  operator's request made with the application token;
- units of work on every member (committed, backed out), a fuzzy backup through the tools service under load,
  more work after it, a unit of work left in flight;
- a service with kept statuses (ORDERS, `cfemu define queue --uow --status-lifetime`) and a durable topic (NEWS,
  `cfemu topic define`), used through the service as applications do (logon, send, receive, syncpoint; subscribe,
  publish, receive_pub, pub_commit), with a UOW ACCEPTED, one DELIVERED, one RECEIVED and a publication received
  but not committed at each crash: after each restore every status is what docs/uow.md's Table 1 says, and every
  durable subscriber receives every committed publication once, whole, in commit order (nothing backed out);
- the CF container's redis-server killed (SIGKILL, as a crash): the restart policy brings the CF back, empty; one
  member restores APP1 by itself (RECAUTO, on by default: one restore, no command typed) with every committed
  message and nothing else; the members carry on without a restart; work goes on; RECAUTO turned off, the CF
  killed again: the structure stays failed until the operator restores it (the runbook's steps) with the Spark
  engine on the compose Spark cluster (`--engine spark --master spark://spark-master:7077`); every queue drained
  through the service and checked against what the test committed (nothing lost, nothing extra);
- nothing in the logs, backups and secrets volumes readable by anyone but their owner (uid 10001), and every
  container of the group runs as that user;
- `docker-compose down -v` leaves no container, network or volume behind; the group's logs are kept in a file
  (CFEMU_COMPOSE_LOGS, default /tmp/cfemucompose-logs.txt), and none of its processes logged a traceback.

The images must exist: docker/build-images.sh builds them where no registry is reachable (make compose-test does);
COMPOSE_FILE picks the compose files (default: docker-compose.yml with docker/compose.local.yml, the local
stand-ins for the public redis and apache/spark images), DOCKER the docker client.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import EndOfUowError, MQError, NoMessageError
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]  # up, two restores and down on a loaded machine

ROOT = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER", "docker")
PROJECT = os.environ.get("COMPOSE_PROJECT_NAME", "cfemucompose")
FILES = os.environ.get("COMPOSE_FILE", "docker-compose.yml:docker/compose.local.yml")
IMAGES = ["cfemu:latest", "cfemu-spark:latest"] + (["cfemu-debian:bookworm"] if "compose.local" in FILES else [])
PORTS = [6379, 7001, 7002, 7003, 9101, 9102, 9103, 9110, 9121]
MEMBERS = {"QM1": 7001, "QM2": 7002, "QM3": 7003}
QUEUES = ("Q1", "Q2")
OWNER = 10001  # the image's cfemu user: owns every volume, runs every process of the group
LOGS = Path(os.environ.get("CFEMU_COMPOSE_LOGS", f"/tmp/{PROJECT}-logs.txt"))  # the group's logs, kept after down


# The scheduler's first backup comes after an hour: the restores start from the test's own backup, then from the
# first restore's restore point, and must replay the members' logs past it.
def compose_env() -> dict[str, str]:
    return {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_FILE": FILES, "BACKUP_INTERVAL": "3600",
            "COMPOSE_HTTP_TIMEOUT": "600"}


def run(cmd: list[str], *, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=ROOT, env=compose_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def dc(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["docker-compose", *args], timeout=timeout, check=check)


def tools(*args: str, timeout: float = 900) -> str:
    """A command in the tools service, as the README and the runbook say: docker-compose run --rm tools ..."""
    return dc("run", "--rm", "-T", "tools", *args, timeout=timeout).stdout


def container(service: str) -> str:
    return dc("ps", "-q", service).stdout.strip()


def inspect(service: str, fmt: str) -> str:
    return run([DOCKER, "inspect", "-f", fmt, container(service)]).stdout.strip()


def wait_healthy(services: list[str], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    pending = list(services)
    while pending:
        pending = [s for s in pending if inspect(s, "{{.State.Status}} {{.State.Health.Status}}") != "running healthy"]
        if pending and time.monotonic() > deadline:
            logs = dc("logs", "--no-color", "--tail", "30", *pending, check=False).stdout
            raise AssertionError(f"not healthy after {timeout}s: {pending}\n{logs}")
        time.sleep(2)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, float]]:
    for binary in (DOCKER, "docker-compose"):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} is not installed (apt-get install docker.io docker-compose)")
    if run([DOCKER, "info"], check=False, timeout=60).returncode != 0:
        pytest.skip("no Docker daemon answers")
    missing = [i for i in IMAGES if run([DOCKER, "image", "inspect", i], check=False).returncode != 0]
    if missing:
        pytest.skip(f"images {missing} are missing: make compose-test (docker/build-images.sh) builds them")
    dc("down", "-v", "--remove-orphans")  # what an aborted earlier run left
    busy = [p for p in PORTS if not port_free(p)]
    assert not busy, f"127.0.0.1 ports {busy} are in use: the compose file publishes them"
    volumes_before = set(run([DOCKER, "volume", "ls", "-q"]).stdout.split())
    times: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        dc("up", "-d", "--no-build", timeout=1800)
        wait_healthy(["cf", "qm1", "qm2", "qm3", "backup-scheduler", "cf-exporter"])
        times["up"] = time.monotonic() - t0
        yield times
    except BaseException:
        print(dc("logs", "--no-color", "--tail", "50", check=False).stdout[-20000:])
        raise
    finally:
        LOGS.write_text(dc("logs", "--no-color", "--timestamps", check=False).stdout)
        t1 = time.monotonic()
        dc("down", "-v", "--remove-orphans", timeout=900)
        times["down"] = time.monotonic() - t1
        print("compose run times (s):", json.dumps({k: round(v, 1) for k, v in times.items()}))
        label = f"label=com.docker.compose.project={PROJECT}"
        for kind in ("container", "network", "volume"):
            left = run([DOCKER, kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label])
            assert not left.stdout.strip(), f"{kind}s left behind: {left.stdout}"
        leaked = set(run([DOCKER, "volume", "ls", "-q"]).stdout.split()) - volumes_before
        assert not leaked, f"anonymous volumes left behind: {leaked}"
        # An exception a process logged is a bug even when the test's checks held (the CF's loss itself is logged
        # as a one-line error by whoever saw it, with no traceback).
        lines = LOGS.read_text().splitlines()
        tracebacks = [i for i, line in enumerate(lines) if "Traceback" in line]
        assert not tracebacks, f"tracebacks in the group's logs ({LOGS}):\n" + "\n".join(
            "\n".join(lines[i - 1:i + 25]) for i in tracebacks[:3])


class Ledger:
    """What the test committed: the bodies every queue must hold after any restore."""

    def __init__(self) -> None:
        self.expected: dict[str, collections.Counter[bytes]] = {q: collections.Counter() for q in QUEUES}
        self.never: set[bytes] = set()  # bodies put in units of work that were backed out or left in flight
        self.lock = threading.Lock()
        self.seq = 0
        self.committed_puts = 0

    def body(self, tag: str) -> bytes:
        with self.lock:
            self.seq += 1
            return f"{tag}-{self.seq:06d}".encode()

    def uow(self, client: Client, tag: str, puts: int = 3, gets: int = 0, commit: bool = True) -> None:
        put = [(QUEUES[i % 2], self.body(tag)) for i in range(puts)]
        for queue, body in put:
            client.put(queue, body)
        got = []
        for i in range(gets):
            queue = QUEUES[i % 2]
            try:
                got.append((queue, client.get(queue).body))
            except NoMessageError:
                pass
        if commit:
            client.commit()
        else:
            client.backout()
        with self.lock:
            if commit:
                self.committed_puts += len(put)
                for queue, body in put:
                    self.expected[queue][body] += 1
                for queue, body in got:
                    self.expected[queue][body] -= 1
                    assert self.expected[queue][body] >= 0, f"{body!r} delivered more often than it was put"
            else:
                self.never.update(body for _, body in put)

    def depth(self, queue: str) -> int:
        return sum(self.expected[queue].values())


def clients(token: str) -> dict[str, Client]:
    return {qm: Client(("127.0.0.1", port), token=token, client_name=f"compose-test-{qm}")
            for qm, port in MEMBERS.items()}


def app1_queues() -> list[dict[str, Any]]:
    status = json.loads(tools("cfemu", "status", "--json"))
    (app1,) = [s for s in status["structures"] if s["name"] == "APP1"]
    assert app1["state"] == "ACTIVE", app1
    return [q for q in status["queues"] if q["structure"] == "APP1"]


def queue_depths() -> dict[str, int]:
    """Q1's and Q2's committed depths."""
    return {q["name"]: q["depth"]["CP"] for q in app1_queues() if q["name"] in QUEUES}


def restorable() -> dict[str, int]:
    """What a restore must bring back of each queue of APP1's (the services' and topics' companions too): the
    committed entries, and those that uncommitted gets hold (backed out by the restore); not the uncommitted puts."""
    return {q["name"]: q["depth"]["CP"] + q["depth"]["UG"] for q in app1_queues()
            if q["depth"]["CP"] + q["depth"]["UG"]}


def kill_cf() -> None:
    """SIGKILL the CF's redis-server (a crash, not a docker stop): the restart policy must bring it back."""
    restarts = int(inspect("cf", "{{.RestartCount}}"))
    os.kill(int(inspect("cf", "{{.State.Pid}}")), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while int(inspect("cf", "{{.RestartCount}}")) == restarts:
        assert time.monotonic() < deadline, "the CF did not come back after it was killed"
        time.sleep(0.5)
    wait_healthy(["cf"], timeout=120)


EXPORTER_PORT, SCHEDULER_PORT = 9121, 9110


def scrape(port: int) -> dict[str, float]:
    """The samples of a /metrics page published on the host's loopback: name{labels} -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        page = r.read().decode()
    return {name: float(value) for line in page.splitlines() if line and not line.startswith("#")
            for name, _, value in [line.rpartition(" ")]}


def sample(samples: dict[str, float], prefix: str) -> float:
    """The value of the one sample whose name and labels start with prefix."""
    found = [v for k, v in samples.items() if k.startswith(prefix)]
    assert len(found) == 1, (prefix, found, sorted(samples)[:80])
    return found[0]


def check_cf_exporter() -> None:
    """The exporter serves the CF's INFO: the CF answers, its server, its clients (the members), its memory, its
    cached scripts and the calls of them (the CF's operations)."""
    cf = scrape(EXPORTER_PORT)
    assert sample(cf, "cfemu_cf_up") == 1.0
    (server,) = [k for k in cf if k.startswith("cfemu_cf_info{")]
    assert 'version="7.' in server and 'role="master"' in server and cf[server] == 1.0, server
    assert sample(cf, "cfemu_cf_connected_clients") >= len(MEMBERS)
    assert sample(cf, "cfemu_cf_memory_used_bytes") > 0
    assert sample(cf, "cfemu_cf_cached_scripts") > 0
    assert sample(cf, 'cfemu_cf_command_calls_total{command="evalsha"}') > 0


LOST = {2373}  # MQRC_CF_STRUC_FAILED, also once the CF is back empty (the members know Q1 from the group repository)


def refused_while_lost(client: Client) -> set[str]:
    """Until the structure is restored, every put is refused with MQRC_CF_STRUC_FAILED: while the CF is down, and
    once it is back, empty (the queue's definition went with it; the group repository still has it, and the
    restore brings it back). Returns the reasons seen."""
    seen = set()
    for _ in range(5):
        try:
            client.put("Q1", b"refused", syncpoint=False)
        except MQError as e:
            assert e.reason in LOST, e
            seen.add(e.reason_name)
        else:
            raise AssertionError("a put was accepted into a structure lost with the CF")
        time.sleep(0.5)
    return seen


def wait_active(structure: str, timeout: float) -> None:
    """Until the CF's status shows the structure ACTIVE (a member's automatic recovery restored it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = json.loads(tools("cfemu", "status", "--json", timeout=120))
            states = {s["name"]: s["state"] for s in status["structures"]}
        except (AssertionError, ValueError, KeyError) as e:  # the CF still coming back: the tools say so
            states = {"?": str(e)[-200:]}
        if states.get(structure) == "ACTIVE":
            return
        assert time.monotonic() < deadline, f"{structure} not ACTIVE {timeout}s after the CF came back: {states}"
        time.sleep(2)


def recovery_messages(text: str) -> list[str]:
    """The members' log lines holding `text` (the CSQE messages of automatic structure recovery)."""
    logs = dc("logs", "--no-color", *(m.lower() for m in MEMBERS)).stdout
    return [line for line in logs.splitlines() if text in line]


def restore(*engine: str) -> dict[str, Any]:
    result = json.loads(tools("cfrestore", "run", "APP1", "--json", *engine))
    assert result["state_before"] == "FAILED", result
    assert sum(result["records_by_member"].values()) > 0, result  # the work after the backup came from the logs
    print(f"restore ({result['engine']}):", {k: v for k, v in result["counts"].items() if v},
          "records by member:", result["records_by_member"])
    return result


class Services:
    """A service with kept statuses (ORDERS: persistent UOWs, UWSTATP 3) and a durable topic (NEWS) through the
    group's service, as applications use them, and what each CF loss must leave of them (docs/uow.md Table 1,
    docs/pubsub.md): alice sends on QM1, bob receives on QM2; the publisher publishes on QM1, carol (QM3) receives
    as she goes, dave (QM2) only at the end."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.uows: dict[str, list[bytes]] = {}  # committed by alice: its messages
        self.expect: dict[str, str] = {}  # uow -> its status now
        self.processed: collections.Counter[str] = collections.Counter()  # uow -> times bob committed it
        self.published: list[list[bytes]] = []  # committed publications, in commit order
        self.received: dict[str, list[list[bytes]]] = {"carol": [], "dave": []}  # committed by each subscriber
        self.seq = 0
        self.connect()
        for name in self.received:
            self.subscriber(name).subscribe("NEWS", name)

    def connect(self) -> None:
        """New sessions: after a CF loss and restore the old ones held what the restore settled."""
        def client(port: int, name: str, user: str = "") -> Client:
            c = Client(("127.0.0.1", port), token=self.token, client_name=f"compose-test-{name}")
            if user:
                c.logon(user, f"{user}-secret")
            return c
        self.alice, self.bob = client(7001, "alice", "alice"), client(7002, "bob", "bob")
        self.publisher = client(7001, "publisher")
        self.carol, self.dave = client(7003, "carol", "carol"), client(7002, "dave", "dave")

    def close(self) -> None:
        for c in (self.alice, self.bob, self.publisher, self.carol, self.dave):
            c.close()

    def subscriber(self, name: str) -> Client:
        return {"carol": self.carol, "dave": self.dave}[name]

    def body(self, tag: str) -> bytes:
        self.seq += 1
        return f"{tag}-{self.seq:04d}".encode()

    def send(self, commit: bool = True) -> str:
        """A UOW of two messages from alice: ACCEPTED, or RECEIVED when not committed."""
        bodies = [self.body("uow"), self.body("uow")]
        self.alice.send("ORDERS", bodies[0])
        sent = self.alice.send("ORDERS", bodies[1], commit=commit)
        assert sent["status"] == ("ACCEPTED" if commit else "RECEIVED"), sent
        self.expect[sent["uow"]] = sent["status"]
        if commit:
            self.uows[sent["uow"]] = bodies
        return str(sent["uow"])

    def receive(self, commit: bool = True) -> str:
        """bob takes the next ACCEPTED UOW whole: PROCESSED, or DELIVERED when not committed."""
        first = self.bob.receive("ORDERS", option="SYNC")
        uow, bodies = first["uow"], [first["body"]]
        while True:
            try:
                bodies.append(self.bob.receive("ORDERS", option="SYNC")["body"])
            except EndOfUowError:
                break
        assert bodies == self.uows[uow], (uow, bodies)
        if commit:
            assert self.bob.syncpoint("COMMIT")["status"] == "PROCESSED"
            self.processed[uow] += 1
        self.expect[uow] = "PROCESSED" if commit else "DELIVERED"
        return str(uow)

    def publish(self, commit: bool = True) -> None:
        bodies = [self.body("pub"), self.body("pub")]
        self.publisher.publish("NEWS", bodies[0])
        self.publisher.publish("NEWS", bodies[1], commit=commit)
        if commit:
            self.published.append(bodies)

    def take(self, name: str, commit: bool = True) -> list[list[bytes]]:
        """Every publication there is for ``name`` now, then its COMMIT (or none: received again later)."""
        got = []
        while True:
            try:
                got.append(list(self.subscriber(name).receive_pub("NEWS", name)["messages"]))
            except NoMessageError:
                break
        if commit:
            self.subscriber(name).pub_commit()
            self.received[name].extend(got)
        return got

    def after_cf_loss(self) -> None:
        """What the restore made of each status (Table 1 for persistent UOWs with kept statuses), checked with new
        sessions; a publication received but not committed comes again."""
        self.close()
        self.connect()
        for uow, before in self.expect.items():
            after = {"RECEIVED": "BACKEDOUT", "DELIVERED": "ACCEPTED"}.get(before, before)
            status = self.alice.syncpoint("QUERY", uow)
            assert status["status"] == after, (before, status)
            if before == "DELIVERED":
                assert status["deliveries"] == 1, status
            self.expect[uow] = after

    def check_end(self) -> None:
        """Every UOW processed once (none backed out), every subscriber has every publication once, in order."""
        while "ACCEPTED" in self.expect.values():
            self.receive()
        assert set(self.processed) == set(self.uows) and set(self.processed.values()) == {1}, self.processed
        for name in self.received:
            self.take(name)
            assert self.received[name] == self.published, (name, self.received[name], self.published)
        self.close()


def test_the_compose_cluster_runs_secured_loses_its_cf_and_restores(cluster: dict[str, float]) -> None:
    t0 = time.monotonic()
    token = tools("cat", "/run/cfemu/secrets/service.token").strip()
    assert len(token) >= 40

    # An attacker's view from the host: the published ports let nobody in without the group's secrets.
    with socket.create_connection(("127.0.0.1", 6379), timeout=10) as s:
        s.sendall(b"PING\r\nFLUSHALL\r\nCONFIG GET dir\r\n")
        time.sleep(0.5)
        answer = s.recv(4096)
    assert answer.count(b"-NOAUTH") == 3, answer
    with pytest.raises(NotAuthorizedError):
        Client(("127.0.0.1", 7001)).put("Q1", b"no token", syncpoint=False)
    with pytest.raises(NotAuthorizedError):
        Client(("127.0.0.1", 7002), token="x" * 43).put("Q1", b"wrong token", syncpoint=False)
    with pytest.raises(NotAuthorizedError):
        Client(("127.0.0.1", 7003), token=token).define_structure("EVIL")

    # The CF's INFO (the cf-exporter service) and the backup scheduler's metrics, published on loopback.
    check_cf_exporter()
    scheduler = scrape(SCHEDULER_PORT)
    assert sample(scheduler, "cfbackup_scheduler_info{") == 1.0
    assert 'interval_seconds="3600"' in next(k for k in scheduler if k.startswith("cfbackup_scheduler_info{"))
    assert sample(scheduler, "cfbackup_scheduler_structure_list_failures_total") == 0

    tools("cfemu", "topic", "define", "NEWS", "--structure", "APP1")
    tools("cfemu", "define", "queue", "ORDERS", "--structure", "APP1", "--uow", "--status-lifetime", "3")
    svc = Services(token)
    svc.send()
    svc.receive()  # PROCESSED: kept
    svc.send()  # ACCEPTED at both crashes
    for _ in range(3):
        svc.publish()
    assert len(svc.take("carol")) == 3

    ledger = Ledger()
    conns = clients(token)
    for i in range(12):  # committed work on every member, a backout now and then, gets from the second round
        for qm, c in conns.items():
            ledger.uow(c, f"{qm}-a", puts=3, gets=2 if i else 0, commit=i % 5 != 3)

    # A fuzzy backup through the tools service while QM1 keeps putting and getting.
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            ledger.uow(conns["QM1"], "QM1-during-backup", puts=2, gets=1)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        backup = json.loads(tools("cfbackup", "run", "APP1", "--json"))
    finally:
        stop.set()
        loader.join()
    assert backup["structure"] == "APP1"
    for i in range(6):  # work after the backup: only the logs have it
        for qm, c in conns.items():
            ledger.uow(c, f"{qm}-b", puts=2, gets=1, commit=i != 4)
    conns["QM3"].put("Q1", b"in-flight-at-the-crash")  # never committed: must not come back
    ledger.never.add(b"in-flight-at-the-crash")
    svc.send()
    svc.receive(commit=False)  # DELIVERED at the crash: ACCEPTED again after it, its delivery counted
    svc.send(commit=False)  # RECEIVED at the crash: BACKEDOUT after it
    svc.publish()
    assert len(svc.take("carol")) == 1
    svc.publish()
    svc.publish()
    assert len(svc.take("carol", commit=False)) == 2  # received again after the restore
    svc.publish(commit=False)  # never committed: never received
    assert queue_depths() == {q: ledger.depth(q) for q in QUEUES}
    cluster["workload and backup"] = time.monotonic() - t0

    # The CF dies. The restart policy brings it back empty, and one member restores APP1 by itself (RECAUTO, on by
    # default) from the backup and every member's log: no command typed.
    t1 = time.monotonic()
    kill_cf()
    cluster["cf back after kill"] = time.monotonic() - t1
    wait_active("APP1", timeout=600)
    cluster["kill to APP1 ACTIVE again (RECAUTO)"] = time.monotonic() - t1
    assert queue_depths() == {q: ledger.depth(q) for q in QUEUES}
    check_cf_exporter()  # the exporter reads the CF that came back (its scripts loaded again): no restart
    assert inspect("cf-exporter", "{{.RestartCount}}") == "0"
    completed = recovery_messages("CSQE131I recovery of APP1 completed")
    assert len(completed) == 1, f"one automatic restore, not {len(completed)}: {completed}"
    print("recovered by RECAUTO:", completed[0])
    for qm in MEMBERS:  # the members carried on: no restart, and they serve the restored structure
        assert inspect(qm.lower(), "{{.RestartCount}}") == "0", qm
    try:
        conns["QM3"].backout()  # its unit of work was in flight when the CF died
    except MQError:
        pass
    conns = clients(token)
    for _ in range(4):
        for qm, c in conns.items():
            ledger.uow(c, f"{qm}-c", puts=2, gets=2)
    svc.after_cf_loss()
    assert len(svc.take("carol")) == 2  # the two it had not committed, and nothing else
    svc.receive()
    svc.receive()  # the UOW that was ACCEPTED and the one that was DELIVERED, each once
    svc.send()  # ACCEPTED at the second crash
    svc.receive(commit=False)
    svc.send(commit=False)
    svc.publish()
    svc.publish()
    assert len(svc.take("carol", commit=False)) == 2

    # Again, with RECAUTO off: nothing happens until the operator restores, here with the Spark engine on the
    # compose Spark cluster (the tools service is the driver), as the runbook says.
    tools("cfemu", "alter", "structure", "APP1", "--no-recauto")
    entries = restorable()
    print("restorable entries before the second kill:", entries)
    kill_cf()
    print("refused while the CF was lost:", refused_while_lost(conns["QM2"]))
    t3 = time.monotonic()
    result = restore("--engine", "spark", "--master", "spark://spark-master:7077")
    cluster["restore, spark engine"] = time.monotonic() - t3
    assert result["engine"] == "spark" and result["counts"]["restored"] == sum(entries.values()), (entries, result)
    assert len(recovery_messages("CSQE131I recovery of APP1 completed")) == 1, "RECAUTO off, yet a member restored"

    # Drained through the service: exactly what was committed, nothing lost, nothing extra, nothing backed out.
    drained: dict[str, collections.Counter[bytes]] = {q: collections.Counter() for q in QUEUES}
    for i, queue in enumerate(QUEUES * 2):
        c = list(conns.values())[i % len(conns)]
        while True:
            try:
                drained[queue][c.get(queue, syncpoint=False).body] += 1
            except NoMessageError:
                break
    for queue in QUEUES:
        assert drained[queue] == +ledger.expected[queue], queue
        assert not ledger.never & set(drained[queue]), queue
    for c in conns.values():
        c.close()
    assert sum(map(ledger.depth, QUEUES)) > 50
    svc.after_cf_loss()
    svc.check_end()
    print("uows processed:", len(svc.processed), "statuses:", collections.Counter(svc.expect.values()),
          "publications:", len(svc.published), "received by each subscriber:",
          {n: len(r) for n, r in svc.received.items()})
    print("drained:", {q: sum(drained[q].values()) for q in QUEUES}, "committed puts:", ledger.committed_puts, "never to be seen (backed out, in flight):", len(ledger.never))

    # Nothing world- (or group-) readable in the volumes, everything owned by the group's user; every process of
    # the group runs as that user.
    mounts = [arg for v in ("logs", "backups", "secrets") for arg in ("-v", f"{PROJECT}_{v}:/v/{v}:ro")]
    find = [DOCKER, "run", "--rm", "--user", "0", "--network", "none", *mounts, "--entrypoint", "find", "cfemu:latest",
            "/v", "-mindepth", "1"]
    exposed = run([*find, "(", "-perm", "/077", "-o", "!", "-uid", str(OWNER), ")", "-printf", "%m %U %p\n"]).stdout
    assert exposed == "", f"readable by others, or not the owner's:\n{exposed}"
    listed = run([*find, "-type", "f", "-printf", "%p\n"]).stdout.split()
    for kind in ("/v/logs/QM1/", "/v/backups/APP1/", "/v/secrets/secrets/service.token", "/v/secrets/users.acl"):
        assert any(p.startswith(kind) for p in listed), kind
    assert any("/restore-" in p for p in listed)  # the restore reports
    for service in ("cf", "qm1", "qm2", "qm3", "backup-scheduler", "cf-exporter", "spark-master", "spark-worker"):
        assert inspect(service, "{{.Config.User}}") in ("cfemu", f"{OWNER}:{OWNER}"), service
    cluster["test"] = time.monotonic() - t0
