"""The local cluster launcher (real processes, cleaned up) and the docker-compose topology.

docker-compose.yml is always parsed with PyYAML and its topology checked; when the docker-compose binary is
installed (Debian's docker-compose package) `docker-compose config -q` validates the file as well. Every command
line in the file is parsed by the project's own argument parsers, so the file cannot drift from the CLIs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import qsg.local_group as local_group_mod
from backup import cli as backup_cli
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import find_server
from cfemu.errors import FencedError
from cfemu.procs import pid_alive
from qsg import cli as cfemu_cli
from qsg.local_group import LocalGroup, LocalGroupError
from sqm import cli as sqm_cli
from sqm.core.connection import Message
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
MANAGERS = ("qm1", "qm2", "qm3")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def volumes_of(service: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount point of the named volumes a service mounts."""
    out = {}
    for v in service.get("volumes", []):
        name, target = v.split(":")[:2]
        out[name] = target
    return out


def test_docker_compose_config_validates() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:  # the YAML checks below still run; this is the extra check by the real tool
        return
    r = subprocess.run([binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_compose_topology(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"cf", *MANAGERS, "backup-scheduler", "spark-master", "spark-worker", "tools"} <= set(services)
    assert set(compose["volumes"]) == {"logs", "backups", "secrets"}
    assert services["cf"]["image"].startswith("redis:")
    # secured with no step for the user: the CF's default user is off (an ACL file from the group's secrets), every
    # cfemu process finds its role's credentials in the secrets volume, and no token has a default value
    assert "--aclfile" in services["cf"]["command"]
    assert services["secrets-init"]["command"][:3] == ["cfemu", "secrets", "init"]
    for name, svc in services.items():
        if svc.get("image", "").startswith("cfemu") and name != "secrets-init":
            assert "secrets" in volumes_of(svc), name
            assert svc["environment"]["CFEMU_SECRETS_DIR"] == "/run/cfemu/secrets", name
            assert "SQM_TOKEN" not in svc["environment"], name

    published: list[str] = []
    for name in MANAGERS:
        qm = services[name]
        assert qm["build"]["context"] == "." and qm["depends_on"]["cf"]["condition"] == "service_healthy"
        assert volumes_of(qm)["logs"] == "/var/lib/cfemu/logs"  # every member's log on the shared volume
        assert qm["environment"]["CFEMU_LOG_ROOT"] == "/var/lib/cfemu/logs"
        assert qm["environment"]["REDIS_URL"] == "redis://cf:6379/0"
        cmd = qm["command"]
        assert cmd[:2] == ["sqm", "run"] and cmd[cmd.index("--name") + 1] == name.upper()
        # Secured: it finds the group's tokens in the secrets volume, and nothing turns authentication off.
        assert volumes_of(qm)["secrets"] == "/run/cfemu" and "--no-auth" not in cmd
        assert qm["environment"]["CFEMU_SECRETS_DIR"] == "/run/cfemu/secrets"
        args = sqm_cli.build_parser().parse_args(cmd[1:])
        assert str(args.port) in " ".join(qm["ports"]) and str(args.metrics_port) in " ".join(qm["ports"])
        assert str(args.metrics_port) in " ".join(qm["healthcheck"]["test"])
        published += qm["ports"]
    assert len(published) == len(set(published))
    assert all(p.startswith("127.0.0.1:") for s in services.values() for p in s.get("ports", []))

    sched = services["backup-scheduler"]
    assert {"logs", "backups"} <= set(volumes_of(sched))
    assert sched["command"][:2] == ["cfbackup", "schedule"]
    sched_args = backup_cli.build_parser().parse_args([a.replace("${BACKUP_INTERVAL:-60}", "60")
                                                       for a in sched["command"][1:]])
    assert set(MANAGERS) <= set(sched["depends_on"])
    assert f"127.0.0.1:{sched_args.metrics_port}:{sched_args.metrics_port}" in sched["ports"]
    assert f":{sched_args.metrics_port}/metrics" in " ".join(sched["healthcheck"]["test"])  # the compose test waits
    exporter = services["cf-exporter"]  # the CF's INFO as metrics, as the operator's CF user (the secrets volume)
    exporter_args = cfemu_cli.build_parser().parse_args(exporter["command"][1:])
    assert exporter_args.command == "exporter" and volumes_of(exporter)["secrets"] == "/run/cfemu"
    assert f"127.0.0.1:{exporter_args.port}:{exporter_args.port}" in exporter["ports"]
    assert f":{exporter_args.port}/metrics" in " ".join(exporter["healthcheck"]["test"])

    master, worker, tools = services["spark-master"], services["spark-worker"], services["tools"]
    assert master["image"].split(":")[0] in ("apache/spark", "bitnami/spark")
    assert "spark://spark-master:7077" in worker["command"]
    assert "ports" not in master  # no authentication: reachable from the group's containers only
    for s in (master, worker, tools):  # the restore tool and the Spark job read every log and the backups
        assert {"logs", "backups"} <= set(volumes_of(s))
    assert worker["build"]["target"] == tools["build"]["target"] == "spark"

    assert "logs" in volumes_of(services["define"])  # definitions go to the group repository on the log volume
    script = services["define"]["command"][2]
    assert "cfemu define $$definition" in script and "|| true" not in script  # only "already defined" is fine
    definitions = re.findall(r'"((?:structure|queue) [^"]+)"', script)
    assert definitions[0] == "structure APP1" and len(definitions) == 3
    for definition in definitions:
        cfemu_cli.build_parser().parse_args(["define", *definition.split()])

    # The CF comes back (empty) when it dies, for restore to refill it; it runs as the owner of the secrets volume
    # (10001, the image's cfemu user), which keeps the ACL file 0600, and reachable on the compose network.
    cf = services["cf"]
    assert cf["restart"] == "unless-stopped" and cf["user"].split(":")[0] == "10001"
    assert cf["command"][cf["command"].index("--protected-mode") + 1] == "no"


def test_dockerfile_builds_the_project_on_python_3_11_slim() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # the public image by default; docker/build-images.sh passes a local stand-in where no registry is reachable
    assert "ARG BASE=python:3.11-slim\nFROM ${BASE} AS base" in text and "pip install ." in text
    assert "useradd --system --uid 10001" in text  # the uid the CF runs as in docker-compose.yml
    assert "FROM base AS spark" in text
    for package in ("cfemu", "sqm", "backup", "restore"):
        assert f"COPY {package} ./{package}" in text


def cfemu(*args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    # The cluster's commands find its secrets in its directory: not the suite's (tests/conftest.py).
    env = {k: v for k, v in os.environ.items() if k != "CFEMU_SECRETS_DIR"}
    r = subprocess.run([sys.executable, "-m", "qsg.cli", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env=env)
    if check:
        assert r.returncode == 0, f"cfemu {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def get_through_a_fencing(state: dict[str, Any], token: str, timeout_s: float = 60) -> Message:
    """A get outside syncpoint, as an application that handles MQRC_CONNECTION_BROKEN does: a member whose lease
    lapsed while the loaded machine starved it after the CF came back is fenced by its peer and restarted by the
    supervisor (a get it had not committed is backed out by the peer's recovery); the application connects again
    and retries, and the message is still there."""
    deadline = time.monotonic() + timeout_s
    while True:
        with Client([f"127.0.0.1:{m['port']}" for m in state["managers"]], token=token) as c:
            try:
                return c.get("Q1", syncpoint=False)
            except FencedError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_cluster_up_status_backup_down(tmp_path: Path) -> None:
    d = str(tmp_path / "cluster")
    pids: list[int] = []
    try:  # the cluster runs detached: take it down even when `up` itself fails an assertion
        up = json.loads(cfemu("cluster", "up", "--dir", d, "--managers", "2", "--backup-interval", "1",
                              "--json").stdout)
        pids = [p["pid"] for p in up["processes"]]
        assert [p["process"] for p in up["processes"]] == ["CF", "QM1", "QM2", "backup-scheduler", "cf-supervisor"]
        assert all(p["alive"] and p["ready"] for p in up["processes"])
        state = json.loads((tmp_path / "cluster" / "cluster.json").read_text())
        assert {"redis_url", "log_root", "backup_dir", "managers", "cf", "scheduler"} <= set(state)
        again = cfemu("cluster", "up", "--dir", d, check=False)
        assert again.returncode == 2 and "already running" in again.stderr
        assert "token" not in state, "the service token is a secret: cluster.json is not where it lives"
        with pytest.raises(NotAuthorizedError):  # authentication is on by default
            Client([f"127.0.0.1:{m['port']}" for m in state["managers"]], reconnect_timeout=0)
        loaded = LocalGroup.load(tmp_path / "cluster")
        token, op_token = loaded.token, loaded.operator_token
        assert token and op_token and token != op_token  # one token per role, both made by `cluster up`
        with Client([f"127.0.0.1:{m['port']}" for m in state["managers"]], token=token) as c:
            c.put("Q1", b"backed up", syncpoint=False)
            with pytest.raises(NotAuthorizedError):  # an application may not redefine anything
                c.define_queue("Q1", "APP1", replace=True)
        with Client([f"127.0.0.1:{m['port']}" for m in state["managers"]], token=op_token, role="operator") as c:
            assert c.status()["auth"] is True
        deadline = time.monotonic() + 60
        manifests: list[Path] = []
        while not manifests and time.monotonic() < deadline:  # the scheduler runs cfbackup every second
            manifests = list((tmp_path / "cluster" / "backups").glob("APP1/*/manifest.json"))
            time.sleep(0.2)
        assert manifests, (tmp_path / "cluster" / "run" / "backup-scheduler.log").read_text()
        status = json.loads(cfemu("status", "--cluster-dir", d, "--json").stdout)
        assert status["structures"][0]["name"] == "APP1"
        assert {m["name"] for m in status["members"]} == {"QM1", "QM2"}
        assert all(m["lease_ms"] > 0 and m["epoch"] > 0 for m in status["members"])
        st = json.loads(cfemu("cluster", "status", "--dir", d, "--json").stdout)
        assert all(p["alive"] for p in st["processes"])
        running = find_server()  # the CF runs the newest server found here, and status says which
        assert st["cf_server"] == running.as_dict(), st["cf_server"]
        assert f"CF server {running.product} {running.version_text} ({running.path})" in \
            cfemu("cluster", "status", "--dir", d).stdout
        # The CF dies (kill -9, no command): the supervisor restarts it, a member restores APP1 (RECAUTO is on by
        # default, `cluster up` gave the members the backup directory).
        assert status["structures"][0]["recauto"] is True
        os.kill(int(state["cf"]["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            r = cfemu("status", "--cluster-dir", d, "--json", check=False)
            if r.returncode == 0 and json.loads(r.stdout)["structures"][:1] and \
                    json.loads(r.stdout)["structures"][0]["state"] == "ACTIVE":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"APP1 not ACTIVE again: {r.stdout} {r.stderr}")
        pids.append(json.loads((tmp_path / "cluster" / "cluster.json").read_text())["cf"]["pid"])
        assert get_through_a_fencing(state, token).body == b"backed up"  # restored from the scheduler's backups
    finally:
        down = json.loads(cfemu("cluster", "down", "--dir", d, "--json").stdout)
    assert down["still_running"] == {} and down["killed_after_timeout"] == {}
    assert not any(pid_alive(pid) for pid in pids)
    assert cfemu("cluster", "status", "--dir", d, check=False).returncode == 1
    assert (tmp_path / "cluster" / "logs" / "QM1").is_dir()  # down keeps everything durable
    cfemu("cluster", "down", "--dir", d, "--purge")
    assert not (tmp_path / "cluster").exists()


def test_api_kill_and_restart_cf_and_managers_and_down_cleans_up(tmp_path: Path) -> None:
    c = LocalGroup.up(tmp_path / "c", managers=2, backup_interval=None, lease_ms=1000)
    try:
        with pytest.raises(LocalGroupError, match="already running"):
            LocalGroup.up(tmp_path / "c", managers=1)
        port = int(c.state["cf"]["port"])
        c.kill_cf()
        c.restart_cf()
        assert int(c.state["cf"]["port"]) == port
        client = connect(c.cf_url())
        assert Admin(client).structures() == []  # it came back empty, like a lost CF
        client.close()
        c.kill_manager("QM2")
        assert "QM2" not in c.running_processes()
        with pytest.raises(LocalGroupError, match="not running"):
            c.kill_manager("QM2")
        c.restart_manager("QM2")
        assert c.running_processes().keys() == {"CF", "QM1", "QM2"}
        pids = list(c.running_processes().values())
    finally:
        killed = c.down()
    assert killed == {}
    assert c.running_processes() == {}
    assert not any(pid_alive(p) for p in pids)
    assert LocalGroup.load(tmp_path / "c").running_processes() == {}


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(LocalGroupError, match="--managers must be 1-32"):
        LocalGroup.up(tmp_path, managers=0)
    with pytest.raises(LocalGroupError, match="no cluster in"):
        LocalGroup.load(tmp_path / "nothing")
    r = cfemu("cluster", "status", "--dir", str(tmp_path / "nothing"), check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no cluster in" in r.stderr
    assert not os.listdir(tmp_path)


SETTINGS_ENV = ("REDIS_URL", "CFEMU_LOG_ROOT", "CFEMU_BACKUP_DIR", "CFEMU_CLUSTER_DIR", "CFEMU_CF_DIR", "SQM_TOKEN",
                "CFEMU_SECRETS_DIR")


@pytest.mark.e2e
@pytest.mark.slow
def test_every_cli_finds_the_cluster_from_its_directory_with_no_flags_and_no_environment(tmp_path: Path) -> None:
    """README "Using it": after `cfemu cluster up`, cfemu, cfbackup, cfrestore and sqm run in the same directory
    find the cluster's CF, logs and backups by themselves (cfemu.settings: the nearest var/cluster)."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    cluster = (tmp_path / "var" / "cluster").resolve()

    def cli(module: str, *args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                           cwd=cwd, env=env)
        assert r.returncode == 0, f"{module} {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    try:
        # The only flags: two managers for the 2-core machines, and a scheduler that does not fire during the test
        # (its backup would race the one run below; test_cli_cluster_up_status_backup_down covers its backups).
        cli("qsg.cli", "cluster", "up", "--managers", "2", "--backup-interval", "3600")
        assert (cluster / "cluster.json").is_file()
        cli("qsg.cli", "put", "Q1", "one", "two")  # an in-process SQM: the cluster's CF and log root
        assert (cluster / "logs" / "OPS").is_dir()

        run = cli("backup.cli", "run", "APP1")
        (manifest,) = (cluster / "backups").glob("APP1/*/manifest.json")
        backup_id = manifest.parent.name
        assert backup_id in run.stdout and json.loads(manifest.read_text())["entries"] == 2
        assert backup_id in cli("backup.cli", "list").stdout
        below = tmp_path / "somewhere" / "deeper"  # the nearest cluster: found from below too
        below.mkdir(parents=True)
        assert backup_id in cli("backup.cli", "list", cwd=below).stdout

        plan = cli("restore.cli", "plan", "APP1").stdout
        assert backup_id in plan and "restored" in plan and str(cluster / "backups") in plan

        # In-doubt units of work: listed from every member, and resolved on the one holding it, with no flags (the
        # runbook's lines; without --server the list was always empty, and resolve refused)
        group = LocalGroup.load(cluster)
        (_, host, port) = [e for e in group.endpoints if e[0] == "QM2"][0]
        with Client([f"{host}:{port}"], token=group.token) as app:
            app.put("Q1", b"two-phase")
            uow = app.prepare("XID-LOCAL")
        listed = json.loads(cli("qsg.cli", "indoubt", "list", "--json").stdout)
        assert [(u["uow"], u["xid"], u["qmgr"]) for u in listed["indoubt"]] == [(uow, "XID-LOCAL", "QM2")]
        assert listed["unreachable"] == []
        assert "committed on QM2" in cli("qsg.cli", "indoubt", "resolve", uow, "--commit").stdout
        assert json.loads(cli("qsg.cli", "indoubt", "list", "--json").stdout)["indoubt"] == []

        printed = cli("sqm.cli", "log", "print", "--all").stdout
        assert f"under {cluster / 'logs'}" in printed and "PUT" in printed and "COMMIT" in printed
        assert not (tmp_path / "var" / "logs").exists() and not (tmp_path / "var" / "backups").exists()
    finally:
        cli("qsg.cli", "cluster", "down", "--purge")
    assert not cluster.exists()


def test_cfbackup_schedule_hands_its_settings_to_every_backup(redis_url: str, tmp_path: Path) -> None:
    """The scheduler's backups (child processes, started from another working directory) use the scheduler's
    settings, not what they would find on their own."""
    import threading

    from backup.schedule import run_backup_scheduler
    from cfemu.settings import resolve

    Admin(connect(redis_url)).define_structure("APP1")
    mine = resolve(redis_url=redis_url, backup_dir=tmp_path / "backups", log_root=tmp_path / "logs", env={})
    stop = threading.Event()
    t = threading.Thread(target=run_backup_scheduler, args=(0.2, mine, ["APP1"], stop), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "backups").glob("APP1/*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(timeout=60)
    assert list((tmp_path / "backups").glob("APP1/*/manifest.json"))


def test_a_manager_whose_planned_port_was_taken_meanwhile_starts_on_another(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports are picked free when the cluster is planned and bound seconds later, after the CF starts: another
    process took one in between (the short chaos run failed so while other suites ran: QM2 'address already in
    use'). The first start moves to fresh ports; it used to abort the whole cluster."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    planned = iter([taken.getsockname()[1]])
    real_free_port = local_group_mod.free_port
    monkeypatch.setattr(local_group_mod, "free_port", lambda host: next(planned, None) or real_free_port(host))
    try:
        c = LocalGroup.up(tmp_path / "c", managers=1, backup_interval=None, lease_ms=1000)
        try:
            port = int(c.manager("QM1")["port"])
            assert port != taken.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        finally:
            c.down()
    finally:
        taken.close()
