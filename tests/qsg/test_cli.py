"""The operator CLI as operators run it: `cfemu` and `sqm` subprocesses against a real CF (and a real server for
the --server and in-doubt verbs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from sqm.log import writer_is_open
from sqm.service.client import Client
from tests.support.service_proc import start_server

ROOT = Path(__file__).resolve().parents[2]


def run(tool: str, *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    module = {"cfemu": "qsg.cli", "sqm": "sqm.cli"}[tool]
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env if env is not None else dict(os.environ))


def ok(tool: str, *args: str) -> str:
    r = run(tool, *args)
    assert r.returncode == 0, f"{tool} {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> list[str]:
    return ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]


@pytest.mark.slow
def test_define_status_put_browse_get(where: list[str], redis_url: str, tmp_path: Path) -> None:
    ok("cfemu", "define", "structure", "APP1", "--max-entries", "50", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", "--backout-threshold", "3", "--backout-queue", "BQ",
       *where)
    ok("cfemu", "define", "queue", "BQ", "--structure", "APP1", *where)
    q = Admin(connect(redis_url)).queue_def("Q1")
    assert (q.structure, q.backout_threshold, q.backout_queue) == ("APP1", 3, "BQ")

    out = json.loads(ok("cfemu", "put", "Q1", "one", "two", "--priority", "4", "--json", *where))
    assert out["put"] == 2
    browsed = json.loads(ok("cfemu", "browse", "Q1", "--json", *where))
    assert [m["body"] for m in browsed["messages"]] == ["one", "two"]
    assert {m["priority"] for m in browsed["messages"]} == {4}

    status = json.loads(ok("cfemu", "status", "--json", *where))
    (app1,) = status["structures"]
    assert (app1["name"], app1["state"], app1["depth"]["CP"], app1["max_entries"]) == ("APP1", "ACTIVE", 2, 50)
    assert {q["name"]: q["depth"]["CP"] for q in status["queues"]} == {"Q1": 2, "BQ": 0}
    assert app1["last_backup"] is None

    plain = ok("cfemu", "status", *where)  # not a terminal: plain columns, no box drawing
    assert "APP1" in plain and "ACTIVE" in plain and "│" not in plain and "╭" not in plain

    got = json.loads(ok("cfemu", "get", "Q1", "--count", "5", "--json", *where))
    assert [m["body"] for m in got["messages"]] == ["one", "two"]
    empty = run("cfemu", "get", "Q1", *where)
    assert empty.returncode == 1
    # The in-process operator SQM logged what it did in the group's log root, where restore looks.
    printed = ok("sqm", "log", "print", "--all", "--log-root", str(tmp_path / "logs"))
    assert "PUT" in printed and "GET" in printed


@pytest.mark.slow
def test_recauto_is_defined_shown_and_altered(where: list[str], redis_url: str, tmp_path: Path) -> None:
    """RECAUTO: on by default, off with --no-recauto, shown by status, altered alone (the capacity stays), in the
    CF and the group repository; and altered in the repository alone once the CF has lost the structure."""
    from cfemu.repository import GroupRepository
    from tests.support.harness import lose_cf

    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "structure", "APP2", "--max-entries", "7", "--no-recauto", *where)
    status = json.loads(ok("cfemu", "status", "--json", *where))
    assert {s["name"]: s["recauto"] for s in status["structures"]} == {"APP1": True, "APP2": False}
    assert "RECAUTO" in ok("cfemu", "status", *where)
    altered = json.loads(ok("cfemu", "alter", "structure", "APP2", "--recauto", "--json", *where))
    assert (altered["recauto"], altered["max_entries"]) == (True, 7)
    admin = Admin(connect(redis_url))
    assert admin.structure_def("APP2").recauto is True
    repo = GroupRepository(tmp_path / "logs")
    assert repo.structures()["APP2"].recauto is True and repo.structures()["APP2"].max_entries == 7
    lose_cf(admin.redis)
    ok("cfemu", "alter", "structure", "APP1", "--no-recauto", *where)
    assert repo.structures()["APP1"].recauto is False and admin.structures() == []


@pytest.mark.slow
def test_status_shows_every_structure_the_group_knows_and_reads_the_backup_mark_with_its_lease(
        where: list[str], redis_url: str) -> None:
    """A structure lost with the CF keeps its row (FAILED, not in the CF), as the group repository defines it; a
    backup mark whose lease has ended is no backup running."""
    import time

    from cfemu.cf import CF
    from tests.support.harness import lose_cf

    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    ok("cfemu", "define", "structure", "APP2", "--no-recauto", *where)
    client = connect(redis_url)
    s = CF(client).structure("APP1")
    s.backup_begin("APP1-B1", 0, lease_ms=1)  # a backup that died: its lease ends at once
    time.sleep(0.05)
    rows = {r["name"]: r for r in json.loads(ok("cfemu", "status", "--json", *where))["structures"]}
    assert (rows["APP1"]["backup_running"], rows["APP1"]["stale_backup_mark"]) == (None, "APP1-B1")
    plain = ok("cfemu", "status", *where)
    assert "stale backup mark" in plain and "backup running" not in plain
    s.backup_begin("APP1-B2", 0, lease_ms=60_000)  # a live one (it takes the stale mark over)
    rows = {r["name"]: r for r in json.loads(ok("cfemu", "status", "--json", *where))["structures"]}
    assert (rows["APP1"]["backup_running"], rows["APP1"]["stale_backup_mark"]) == ("APP1-B2", None)
    assert "backup running" in ok("cfemu", "status", *where)

    lose_cf(client)
    doc = json.loads(ok("cfemu", "status", "--json", *where))
    rows = {r["name"]: r for r in doc["structures"]}
    assert set(rows) == {"APP1", "APP2"}
    for name in ("APP1", "APP2"):
        assert (rows[name]["state"], rows[name]["in_cf"], rows[name]["depth"]) == ("FAILED", False, None)
    assert (rows["APP1"]["recauto"], rows["APP2"]["recauto"]) == (True, False)
    assert {q["name"]: q["structure"] for q in doc["queues"]} == {"Q1": "APP1"}
    plain = ok("cfemu", "status", *where)
    assert plain.count("FAILED (not in CF)") == 2, plain
    client.close()


def test_status_names_and_skips_a_record_it_cannot_parse(where: list[str], redis_url: str) -> None:
    """One structure record with a bad name must not make `cfemu status` fail (as if the CF were down): the record
    is named on one line and skipped, every other structure is shown."""
    import msgpack

    from cfemu.admin import STRUCTURES

    ok("cfemu", "define", "structure", "APP1", *where)
    client = connect(redis_url)
    try:
        record = msgpack.unpackb(client.hget(STRUCTURES, "APP1"))
        client.hset(STRUCTURES, "bad name", msgpack.packb({**record, "name": "bad name"}))
    finally:
        client.close()
    doc = json.loads(ok("cfemu", "status", "--json", *where))
    assert [s["name"] for s in doc["structures"]] == ["APP1"]
    [bad] = doc["bad_records"]
    assert "'bad name'" in bad and "\n" not in bad
    plain = ok("cfemu", "status", *where)
    assert "APP1" in plain and "warning: structure 'bad name' skipped: bad structure name" in plain


@pytest.mark.slow
def test_errors_are_one_line_and_change_nothing(where: list[str], redis_url: str, tmp_path: Path) -> None:
    ok("cfemu", "define", "structure", "APP1", *where)
    for args, needle in ((["define", "structure", "APP1"], "already defined"),
                         (["define", "queue", "Q!", "--structure", "APP1"], "bad queue name"),
                         (["define", "queue", "Q1", "--structure", "NOPE"], "structure NOPE is not defined"),
                         (["put", "NOQ", "x"], "queue NOQ is not defined")):
        r = run("cfemu", *args, *where)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert [q.name for q in Admin(connect(redis_url)).queues()] == []
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    r = run("cfemu", "status", cwd=tmp_path, env=env)
    assert r.returncode == 2 and "no CF found" in r.stderr
    r = run("cfemu", "status", "--redis-url", "http://x", env=env)
    assert r.returncode == 2 and "unsupported URL scheme" in r.stderr


@pytest.mark.slow
def test_through_a_server_and_in_doubt_resolution(where: list[str], redis_url: str, tmp_path: Path) -> None:
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    srv = start_server(redis_url, tmp_path, "QM1", "--token", "tok", env={"SQM_OPERATOR_TOKEN": "op-tok"})
    try:
        server = ["--server", srv.endpoint, "--token", "op-tok"]  # cfemu's --token is the operator's
        ok("cfemu", "put", "Q1", "via server", *server)
        assert [m["body"] for m in json.loads(ok("cfemu", "browse", "Q1", "--json", *server))["messages"]] == [
            "via server"]
        r = run("cfemu", "browse", "Q1", "--server", srv.endpoint, "--token", "wrong")
        assert r.returncode == 2 and "MQRC_NOT_AUTHORIZED" in r.stderr

        with Client(srv.endpoint, token="tok") as c:
            c.put("Q1", b"two-phase")
            uow = c.prepare("XID-1")
        # With only the application's token (no operator token anywhere), cfemu has an application's rights: it
        # may not list every in-doubt UOW.
        app_env = {k: v for k, v in os.environ.items() if k not in ("SQM_OPERATOR_TOKEN", "CFEMU_SECRETS_DIR")}
        r = run("cfemu", "indoubt", "list", "--server", srv.endpoint, env={**app_env, "SQM_TOKEN": "tok"},
                cwd=tmp_path)
        assert r.returncode == 2 and "MQRC_NOT_AUTHORIZED" in r.stderr and "xid" in r.stderr, r.stderr
        listed = json.loads(ok("cfemu", "indoubt", "list", "--json", *server))["indoubt"]
        assert [(u["uow"], u["xid"], u["qmgr"]) for u in listed] == [(uow, "XID-1", "QM1")]
        assert "XID-1" in ok("cfemu", "indoubt", "list", *server)
        # a member that does not answer: the rows of those that did, its own line, and retry later (an empty or
        # short list must not read as "nothing in doubt")
        r = run("cfemu", "indoubt", "list", *server, "--server", "127.0.0.1:1")
        assert r.returncode == 75 and "XID-1" in r.stdout and "127.0.0.1:1: no answer" in r.stdout, r
        assert "did not answer, their in-doubt units of work are not listed" in r.stderr, r.stderr
        partial = run("cfemu", "indoubt", "list", "--json", *server, "--server", "127.0.0.1:1")
        doc = json.loads(partial.stdout)
        assert partial.returncode == 75 and [u["uow"] for u in doc["indoubt"]] == [uow]
        assert [f["server"] for f in doc["unreachable"]] == ["127.0.0.1:1"]
        # no member named and no local cluster: refused, not an empty list
        bare = run("cfemu", "indoubt", "list", "--token", "op-tok", env=app_env, cwd=tmp_path)
        assert bare.returncode == 2 and "no members to ask" in bare.stderr, bare.stderr
        ok("cfemu", "indoubt", "resolve", uow, "--commit", *server)
        assert json.loads(ok("cfemu", "indoubt", "list", "--json", *server))["indoubt"] == []
        r = run("cfemu", "indoubt", "resolve", uow, "--backout", *server)
        assert r.returncode == 2 and "not in doubt" in r.stderr
        got = json.loads(ok("cfemu", "get", "Q1", "--all", "--json", *server))
        assert sorted(m["body"] for m in got["messages"]) == ["two-phase", "via server"]
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_backup_and_restore_verbs_delegate(where: list[str], redis_url: str, tmp_path: Path) -> None:
    ok("cfemu", "define", "structure", "APP1", *where)
    backups = str(tmp_path / "backups")
    out = json.loads(ok("cfemu", "backup", "run", "APP1", "--redis-url", redis_url, "--backup-dir", backups,
                        "--json"))
    assert out["structure"] == "APP1"
    assert "APP1" in ok("cfemu", "backup", "list", "--backup-dir", backups)
    assert "usage: cfemu restore" in ok("cfemu", "restore", "--help")  # cfrestore's command line, named as run
    assert "usage: sqm run" in ok("sqm", "run", "--help")
    r = run("sqm", "run", "--name", "QM1", "--redis-url", redis_url, "--lease-ms", "10")
    assert r.returncode == 2 and "argument --lease-ms: must be a whole number from 500 to" in r.stderr


def test_put_commits_in_units_of_work_of_per_commit_messages(where: list[str]) -> None:
    """cfemu put --count N puts in units of work of at most --per-commit messages (a unit of work holds at most
    MAXUMSGS); a failure backs out only the unit of work it was in and says how many were committed before."""
    ok("cfemu", "define", "structure", "APP1", "--max-entries", "30", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    assert json.loads(ok("cfemu", "put", "Q1", "x", "--count", "25", "--per-commit", "10", "--json", *where))["put"] == 25
    r = run("cfemu", "put", "Q1", "y", "--count", "10", "--per-commit", "4", *where)
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "4 of 10 message(s) were put on Q1 and committed; the next unit of work was backed out" in r.stderr
    got = json.loads(ok("cfemu", "browse", "Q1", "--json", "--limit", "100", *where))
    assert [m["body"] for m in got["messages"]].count("y") == 4 and len(got["messages"]) == 29


@pytest.mark.slow
def test_an_interrupted_put_says_what_it_committed(where: list[str], redis_url: str) -> None:
    """Ctrl-C in a long `cfemu put`: the units of work committed before it stay, and the command says how many
    (and lists them with --json), so that the operator does not put them again; only the unit of work in flight is
    backed out. It printed only "interrupted", and a rerun put thousands of messages twice."""
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "QINT", "--structure", "APP1", *where)
    proc = subprocess.Popen([sys.executable, "-m", "qsg.cli", "put", "QINT", "x", "--count", "200000",
                             "--per-commit", "200", "--json", *where], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _depth(redis_url) < 400:
            assert proc.poll() is None and time.monotonic() < deadline, "the put ended or never committed 400"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    doc = json.loads(out)
    committed = _depth(redis_url)
    assert doc["interrupted"] is True and doc["put"] == len(doc["msgids"]) == committed >= 400, (doc["put"], committed)
    assert committed % 200 == 0, "whole units of work only"
    assert f"{committed} of 200000 message(s) were put on QINT and committed before the interrupt" in err, err
    assert err.rstrip().endswith("cfemu: interrupted"), err


def _depth(redis_url: str) -> int:
    """QINT's committed messages, as the CF counts them."""
    return CF(connect(redis_url)).structure("APP1").depths().get("QINT", {}).get("CP", 0)


@pytest.mark.slow
def test_two_in_process_commands_at_once_the_second_says_to_wait_or_name_itself(where: list[str]) -> None:
    """Each in-process cfemu command is the member OPS (its log, its lock): a second one while a `get --wait`
    runs is refused in one line, retry later (75), naming --qm-name; it was a LogLockedError traceback, exit 1."""
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q2", "--structure", "APP1", *where)
    get_q2 = [sys.executable, "-m", "qsg.cli", "get", "Q2", "--wait-ms", "30000", *where]
    waiting = subprocess.Popen(get_q2, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the put below must meet the get while it waits: wait until the get holds OPS's log (a get that lost the
        # lock to the define's last moments exits 75 and is started again)
        ops_log = Path(where[where.index("--log-root") + 1]) / "OPS"
        deadline = time.monotonic() + 60
        while not writer_is_open(ops_log):
            assert time.monotonic() < deadline, "the waiting get never opened OPS's log"
            if waiting.poll() is not None:
                waiting = subprocess.Popen(get_q2, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.05)
        r = run("cfemu", "put", "Q1", "later", *where)
        assert r.returncode == 75 and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
        assert "another cfemu command runs as OPS" in r.stderr and "--qm-name" in r.stderr, r.stderr
        assert r.stderr.startswith("cfemu: error: ") and "Traceback" not in r.stderr
        named = run("cfemu", "put", "Q1", "named", "--qm-name", "OPS2", *where)
        assert named.returncode == 0, named.stderr
    finally:
        waiting.kill()
        waiting.wait()


@pytest.mark.slow
def test_a_long_put_and_get_show_progress_on_a_terminal(where: list[str]) -> None:
    """Thousands of messages take seconds: on a terminal a bar counts them (not in a pipe, not with --json)."""
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    command = " ".join([sys.executable, "-m", "qsg.cli", "put", "Q1", "x", "--count", "3000", "--per-commit", "500",
                        *where])
    on_tty = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
    assert on_tty.returncode == 0, on_tty.stdout + on_tty.stderr
    assert "3000/3000" in on_tty.stdout and "put 3000 message(s) on Q1 (committed)" in on_tty.stdout, on_tty.stdout
    piped = run("cfemu", "get", "Q1", "--count", "3000", *where)
    assert piped.returncode == 0 and "/3000" not in piped.stdout  # a pipe gets the table only
