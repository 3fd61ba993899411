"""The web console's handlers (qsg.console.app) through aiohttp's test client, against the suite's real CF: the
login and its session cookie, what the overview shows of the group, the CSRF token and the confirmation every
action needs, a backup taken through it; and the console's pure parts (sessions, events, charts). The console in
a real browser against a live cluster: tests/qsg/test_console_browser.py (make console-test)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.procs import free_port, pid_alive
from qsg import cli
from qsg.console import charts, snapshot
from qsg.console.app import Console
from qsg.console.history import History, changes
from qsg.console.jobs import JobRefusedError, Jobs
from qsg.console.security import SESSION_COOKIE, Sessions
from qsg.console.source import GroupSource
from tests.support.certs import issue, make_ca
from tests.support.waits import wait_until

TOKEN = "operator-token-for-the-console-test"


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return {"redis_url": redis_url, "log_root": str(tmp_path / "logs"), "backup_dir": str(tmp_path / "backups"),
            "token": TOKEN}


def _cfemu(where: dict[str, str], *args: str) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in where.items() if k in ("redis_url", "log_root")]
    assert cli.main([*args, *flags]) == 0


def _run(where: dict[str, str], scenario: Callable[[TestClient[Any, Any], Console], Awaitable[None]]) -> None:
    console = Console(GroupSource(where), interval_s=3600)  # the test polls when it wants a fresh picture

    async def main() -> None:
        async with TestClient(TestServer(console.app)) as client:
            await scenario(client, console)

    asyncio.run(main())


async def _login(client: TestClient[Any, Any]) -> str:
    """Log in; the CSRF token the overview's forms carry."""
    r = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == "/"
    r = await client.get("/")
    page = await r.text()
    return re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]


def test_login_session_cookie_and_security_headers(where: dict[str, str]) -> None:
    async def scenario(client: TestClient[Any, Any], console: Console) -> None:
        r = await client.get("/", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/login"
        assert (await client.get("/fragment")).status == 401
        assert (await client.get("/api/snapshot")).status == 401
        t0 = time.monotonic()
        r = await client.post("/login", data={"token": "wrong"})
        assert r.status == 401 and "wrong token" in await r.text()
        assert time.monotonic() - t0 >= 0.1  # a failed login is answered after the address's delay
        assert SESSION_COOKIE not in {c.key for c in client.session.cookie_jar}
        r = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
        assert r.status == 303 and TOKEN not in r.headers["Location"]
        cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        r = await client.get("/")
        page = await r.text()
        assert r.status == 200 and TOKEN not in page
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Frame-Options"] == "DENY"
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        assert (await client.post("/logout", data={}, allow_redirects=False)).status == 403  # no CSRF token
        r = await client.post("/logout", data={"csrf_token": csrf}, allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/login"
        assert (await client.get("/fragment")).status == 401

    _run(where, scenario)


def test_overview_shows_depths_states_and_events(where: dict[str, str]) -> None:
    _cfemu(where, "define", "structure", "APP1")
    _cfemu(where, "define", "queue", "Q1", "--structure", "APP1")
    _cfemu(where, "put", "Q1", "one", "two", "three")

    async def scenario(client: TestClient[Any, Any], console: Console) -> None:
        await _login(client)
        await console.poll_once()
        page = await (await client.get("/fragment")).text()
        row = re.search(r'<tr id="queue-Q1".*?</tr>', page, re.S).group(0)  # type: ignore[union-attr]
        assert re.search(r'class="num depth">\s*3\s*<', row), row
        assert re.search(r'data-depth="CP">3<', row), row
        oldest = re.search(r'class="num oldest">([^<]*)<', row).group(1)  # type: ignore[union-attr]
        assert re.fullmatch(r"\d+s", oldest.strip()), oldest
        assert 'data-state="ACTIVE"' in page and "<svg" in page
        Admin(connect(where["redis_url"])).set_state("APP1", "FAILED")
        await console.poll_once()
        page = await (await client.get("/fragment")).text()
        assert 'data-state="FAILED"' in page and "structure APP1: ACTIVE -&gt; FAILED" in page
        doc = await (await client.get("/api/snapshot")).json()
        assert [s["state"] for s in doc["snapshot"]["structures"]] == ["FAILED"]
        assert any(e["text"] == "structure APP1: ACTIVE -> FAILED" for e in doc["events"])

    _run(where, scenario)


def test_a_backup_through_the_console_needs_csrf_and_confirmation(where: dict[str, str]) -> None:
    _cfemu(where, "define", "structure", "APP1")
    _cfemu(where, "define", "queue", "Q1", "--structure", "APP1")
    _cfemu(where, "put", "Q1", "kept")

    async def scenario(client: TestClient[Any, Any], console: Console) -> None:
        csrf = await _login(client)
        await console.poll_once()
        form = {"structure": "APP1"}
        r = await client.post("/action/backup", data=form, allow_redirects=False)
        assert r.status == 403 and "CSRF" in await r.text()
        r = await client.post("/action/backup", data={**form, "csrf_token": "forged"}, allow_redirects=False)
        assert r.status == 403
        r = await client.post("/action/backup", data={**form, "csrf_token": csrf},
                              headers={"Origin": "http://evil.example"}, allow_redirects=False)
        assert r.status == 403 and "another origin" in await r.text()
        # First the confirmation page; nothing is done yet.
        r = await client.post("/action/backup", data={**form, "csrf_token": csrf})
        page = await r.text()
        assert r.status == 200 and "Take a backup of structure APP1 now?" in page and 'value="yes"' in page
        assert console.jobs.list() == []
        # A structure the group does not have: a one-line error on the overview, nothing started.
        r = await client.post("/action/backup", data={"structure": "NOPE", "csrf_token": csrf, "confirmed": "yes"})
        assert "no structure NOPE in this group" in await r.text() and console.jobs.list() == []
        r = await client.post("/action/backup", data={**form, "csrf_token": csrf, "confirmed": "yes"},
                              allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/#jobs"
        [job] = console.jobs.list()
        deadline = time.monotonic() + 120
        while job.state == "running" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert job.state == "done", job.result
        await console.poll_once()
        doc = await (await client.get("/api/snapshot")).json()
        [backup] = doc["snapshot"]["backups"]
        assert backup["structure"] == "APP1" and backup["state"] == "ok" and backup["entries"] == 1
        assert backup["signed_by"] and backup["disk_bytes"] > 0
        assert backup["id"] in job.result
        texts = [e["text"] for e in doc["events"]]
        assert "backup of APP1: running" in texts and f"backup of APP1: done: {job.result}" in texts
        page = await (await client.get("/fragment")).text()
        assert f'data-backup="{backup["id"]}"' in page and f"key {backup['signed_by']}" in page
        # Resolving a UOW that is not in doubt is refused before anything is sent.
        r = await client.post("/action/resolve", data={"member": "QM1", "uow": "u-1", "outcome": "commit",
                                                       "csrf_token": csrf, "confirmed": "yes"})
        assert "is not in doubt on QM1" in await r.text() and len(console.jobs.list()) == 1
        r = await client.post("/action/restore", data={"structure": "APP1", "backup": "APP1-20000101T000000Z-000000",
                                                       "csrf_token": csrf})
        assert "no backup APP1-20000101T000000Z-000000 of APP1 is listed" in await r.text()
        r = await client.post("/action/restart", data={"member": "CF", "csrf_token": csrf, "confirmed": "yes"})
        assert "CF is not a member of a local cluster" in await r.text() and len(console.jobs.list()) == 1
        r = await client.post("/action/restore", data={"structure": "APP1", "csrf_token": csrf})
        assert "is ACTIVE: it is marked FAILED first" in await r.text()  # the confirmation says so
        assert (await client.post("/action/nothing", data={"csrf_token": csrf})).status == 404

    _run(where, scenario)


def test_console_refuses_a_network_address_without_tls(where: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["console", "--host", "0.0.0.0", "--redis-url", where["redis_url"]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "only with TLS" in err


def test_sessions_end_when_idle_or_too_old() -> None:
    sessions = Sessions(idle_s=10, max_s=100, limit=2)
    s = sessions.begin("127.0.0.1")
    assert sessions.find(s.id, now=s.started + 5) is s
    assert sessions.find(s.id, now=s.started + 16) is None  # idle 11 s since its last use
    a, b, c = sessions.begin(""), sessions.begin(""), sessions.begin("")
    assert sessions.find(a.id) is None and sessions.find(b.id) is b and sessions.find(c.id) is c  # the oldest ended
    assert not b.csrf_ok(None) and not b.csrf_ok(c.csrf) and b.csrf_ok(b.csrf)


def _snap(state: str, *, recovering: str | None = None, recauto: int = 0, last_event: str = "") -> dict[str, Any]:
    return {"at": time.time(), "cf": {"ok": True},
            "structures": [{"name": "APP1", "state": state, "recovering_by": recovering, "backup_running": None,
                            "last_backup": None}],
            "queues": [{"name": "Q1", "depth": {"CP": 2, "UP": 1}}],
            "members": [{"name": "QM1", "health": "serving", "epoch": 1,
                         "service": {"puts": 10 + recauto, "gets": 4, "structure_recoveries_completed": recauto}}],
            "duplex": {"last_event": last_event, "secondary_state": "in sync"}, "processes": []}


def test_events_between_snapshots() -> None:
    texts = [e.text for e in changes(_snap("ACTIVE"), _snap("FAILED", recovering="QM1@1", recauto=1,
                                                             last_event="promoted the secondary"))]
    assert texts == ["structure APP1: ACTIVE -> FAILED", "structure APP1: recovery by QM1@1 started",
                     "RECAUTO completed on QM1 (1)", "promoted the secondary"]
    assert changes(_snap("ACTIVE"), _snap("ACTIVE")) == []
    # A structure lost with the CF: ACTIVE before the CF stopped answering, FAILED once it answers again.
    lost = History()
    down = {**_snap("ACTIVE"), "cf": {"ok": False}, "structures": [], "queues": []}
    for snap in (_snap("ACTIVE"), down, _snap("FAILED")):
        lost.add(snap)
    assert [e.text for e in lost.events] == ["the CF does not answer", "the CF answers again",
                                             "structure APP1: ACTIVE -> FAILED"]
    h = History()
    h.add(_snap("ACTIVE"))
    later = _snap("ACTIVE", recauto=4)
    later["at"] += 2
    h.add(later)
    assert h.depth_series()["Q1"][-1][1] == 3
    assert h.rate_series()["puts/s"][-1][1] == pytest.approx(2.0, rel=0.01)


def test_line_chart_draws_each_series_and_escapes_names() -> None:
    assert "no data yet" in charts.line_chart("depth", {})
    svg = charts.line_chart("depth", {"Q1": [(0, 0), (1, 5)], "<b>": [(0, 1), (1, 2)]})
    assert svg.count("<polyline") == 2 and "&lt;b&gt;" in svg and "<b>" not in svg and "Q1: 5" in svg


def test_a_login_from_another_host_without_tls_is_refused(where: dict[str, str]) -> None:
    console = Console(GroupSource(where), interval_s=3600)
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        ("192.0.2.7", 40000) if name == "peername" else default)
    request = make_mocked_request("POST", "/login", transport=transport, app=console.app)

    async def login() -> Any:
        return await console.login(request)

    response = asyncio.run(login())
    assert response.status == 403 and "serves no TLS" in response.text
    assert len(console.sessions) == 0


def test_the_console_over_tls_sets_a_secure_cookie(where: dict[str, str], tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    cert, key = issue(ca, tmp_path, "console", ip="127.0.0.1")
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    trust = ssl.create_default_context(cafile=str(ca.cert))
    console = Console(GroupSource(where), interval_s=3600)

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, served)
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as http:
                r = await http.post(f"https://127.0.0.1:{port}/login", data={"token": TOKEN}, ssl=trust,
                                    allow_redirects=False)
                assert r.status == 303
                cookie = r.headers["Set-Cookie"]
                assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
                with pytest.raises(aiohttp.ClientConnectorCertificateError):  # a client that does not trust it
                    await http.get(f"https://127.0.0.1:{port}/login", ssl=ssl.create_default_context())
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_part_that_cannot_be_read_leaves_the_others(where: dict[str, str], tmp_path: Path) -> None:
    _cfemu(where, "define", "structure", "APP1")
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    snap = snapshot.take(GroupSource(where, servers=[dead]))
    assert snap["cf"]["ok"] and [s["name"] for s in snap["structures"]] == ["APP1"]
    [member] = [m for m in snap["members"] if m["name"] == dead]
    assert member["health"] == "unreachable" and member["service_error"]
    lost = snapshot.take(GroupSource({**where, "redis_url": f"redis://{dead}"}))
    assert not lost["cf"]["ok"] and lost["errors"] and lost["errors"][0].startswith("cf: ")
    assert lost["structures"] == []


def test_one_action_per_target_at_a_time() -> None:
    jobs = Jobs()
    release = threading.Event()
    first = jobs.start("backup", "structure APP1", "backup of APP1", lambda progress: release.wait(30) and "ok")
    with pytest.raises(JobRefusedError, match="backup of APP1 is still running"):
        jobs.start("restore", "structure APP1", "restore of APP1", lambda progress: "no")
    failing = jobs.start("backup", "structure APP2", "backup of APP2", lambda progress: 1 / 0)
    release.set()
    wait_until(lambda: first.state == "done" and failing.state == "failed", 30, "both jobs ended")
    assert first.result == "ok" and "division by zero" in failing.result


@pytest.mark.slow
def test_cluster_up_console_serves_and_cluster_down_stops_it(tmp_path: Path) -> None:
    d = str(tmp_path / "cluster")
    env = {k: v for k, v in os.environ.items() if k != "CFEMU_SECRETS_DIR"}  # the cluster's own secrets

    def cfemu(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "qsg.cli", *args], capture_output=True, text=True, timeout=120,
                           env=env)
        assert r.returncode == 0, f"cfemu {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    try:
        up = json.loads(cfemu("cluster", "up", "--dir", d, "--managers", "1", "--backup-interval", "0", "--console",
                              "--json"))
        [row] = [p for p in up["processes"] if p["process"] == "console"]
        assert row["alive"] and row["address"].startswith("http://127.0.0.1:")
        url, pid = row["address"], row["pid"]
        assert f"console {url}" in cfemu("cluster", "status", "--dir", d)
        token = (tmp_path / "cluster" / "secrets" / "operator.token").read_text().strip()

        async def visit() -> str:
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                page = await (await http.post(url + "login", data={"token": token})).text()
                deadline = time.monotonic() + 60
                while 'id="queue-Q1"' not in page and time.monotonic() < deadline:  # its first reading
                    await asyncio.sleep(0.2)
                    page = await (await http.get(url)).text()
                return page

        page = asyncio.run(visit())
        assert 'id="queue-Q1"' in page and 'id="member-QM1"' in page
    finally:
        cfemu("cluster", "down", "--dir", d)
    assert wait_until(lambda: not pid_alive(pid), 30, "the console stopped by cluster down")


def test_an_action_under_way_shows_its_phase_and_progress(where: dict[str, str]) -> None:
    async def scenario(client: TestClient[Any, Any], console: Console) -> None:
        await _login(client)
        await console.poll_once()  # the overview's sections are drawn once the group has been read
        halfway, release = threading.Event(), threading.Event()

        def work(progress: Any) -> str:
            progress("read backup", 5, 5)
            progress("load", 3, 10)
            halfway.set()
            release.wait(30)
            return "loaded 10"

        job = console.jobs.start("restore", "structure APP1", "restore of APP1", work)
        assert halfway.wait(30)
        page = await (await client.get("/fragment")).text()
        row = re.search(rf'<tr data-job="{job.id}".*?</tr>', page, re.S).group(0)  # type: ignore[union-attr]
        assert 'data-state="running"' in row and "load" in row and '<progress max="10" value="3">' in row
        assert "3/10" in row
        release.set()
        deadline = time.monotonic() + 30
        while job.state == "running" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        page = await (await client.get("/fragment")).text()
        row = re.search(rf'<tr data-job="{job.id}".*?</tr>', page, re.S).group(0)  # type: ignore[union-attr]
        assert 'data-state="done"' in row and "loaded 10" in row and "<progress" not in row

    _run(where, scenario)


@pytest.mark.slow
def test_the_overview_lists_each_members_connections(where: dict[str, str], tmp_path: Path) -> None:
    """The console reads DISPLAY CONN (the members' connections operation): a client's application name, its peer
    and its open unit of work are on the page."""
    from sqm.service.client import Client
    from tests.support.service_proc import TOKEN as APP_TOKEN
    from tests.support.service_proc import start_server

    _cfemu(where, "define", "structure", "APP1")
    _cfemu(where, "define", "queue", "Q1", "--structure", "APP1")
    srv = start_server(where["redis_url"], tmp_path, "QM1", env={"SQM_OPERATOR_TOKEN": TOKEN})
    console = Console(GroupSource(where, servers=[srv.endpoint]), interval_s=3600)

    async def main() -> None:
        async with TestClient(TestServer(console.app)) as client:
            await _login(client)
            with Client(srv.endpoint, token=APP_TOKEN, client_name="ledger") as app:
                app.put("Q1", b"open")
                await console.poll_once()
                page = await (await client.get("/fragment")).text()
            row = re.search(r'<tr data-conn="[^"]*">(?:(?!</tr>).)*ledger.*?</tr>', page, re.S)
            assert row is not None, page
            assert "INFLIGHT" in row.group(0) and "QM1." in row.group(0) and "127.0.0.1:" in row.group(0)
            doc = await (await client.get("/api/snapshot")).json()
            assert any(c["application"] == "cfemu-console" for c in doc["snapshot"]["connections"])

    try:
        asyncio.run(main())
    finally:
        assert srv.stop() == 0
