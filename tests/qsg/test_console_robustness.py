"""The console under a group an operator really has: many queues, a record in the CF it cannot parse. What it shows
must stay small enough to draw and fetch every few seconds, and must not say the CF is down when the CF answered."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cfemu.admin import STRUCTURES
from cfemu.connection import connect
from cfemu.credentials import ENV_SECRETS_DIR
from cfemu.private_files import write_private
from cfemu.progress import Progress
from qsg import cli
from qsg.console import charts, snapshot
from qsg.console.actions import ACTIONS, ActionError
from qsg.console.app import Console
from qsg.console.charts import MAX_SERIES
from qsg.console.history import QUEUES_SAMPLED, SAMPLES, History, Sample
from qsg.console.jobs import DONE, KEPT, RUNNING, Job, JobRefusedError, Jobs
from qsg.console.security import REFRESH_HEADER, SESSION_IDLE_S, LoginGate
from qsg.console.source import GroupSource
from sqm.service import auth
from sqm.service.auth import Failures
from tests.support.waits import wait_until

MANY_QUEUES = 500
CHART_LIMIT = 256 * 1024  # bytes: the overview (and this chart in it) is fetched by every open tab every 2 s


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return {"redis_url": redis_url, "log_root": str(tmp_path / "logs"), "backup_dir": str(tmp_path / "backups")}


def test_the_depth_chart_stays_small_with_many_queues() -> None:
    """The chart is drawn on the console's event loop for every /fragment each open tab fetches: with hundreds of
    queues it must draw some of them (the deepest), not every queue's 300 points."""
    history = History()
    for i in range(SAMPLES):
        history.samples.append(Sample(1000.0 + 2 * i, {f"Q{j:04d}": i + j for j in range(MANY_QUEUES)}, 0, 0))
    svg = charts.line_chart("queue depth", history.depth_series(), unit="msgs")
    assert len(svg) < CHART_LIMIT, f"the depth chart of {MANY_QUEUES} queues is {len(svg)} bytes"


def test_a_record_it_cannot_parse_is_not_reported_as_the_cf_down(where: dict[str, str]) -> None:
    """One structure record with a bad name (written by any holder of a CF user's password) must not turn the page
    into 'the CF does not answer' with no structure at all: the CF answered, and APP1 is fine."""
    flags = [f"--redis-url={where['redis_url']}", f"--log-root={where['log_root']}"]
    assert cli.main(["define", "structure", "APP1", *flags]) == 0
    client = connect(where["redis_url"])
    try:
        record = msgpack.unpackb(client.hget(STRUCTURES, "APP1"))
        client.hset(STRUCTURES, "bad name", msgpack.packb({**record, "name": "bad name"}))
    finally:
        client.close()
    snap = snapshot.take(GroupSource(where))
    assert snap["cf"]["ok"], snap["errors"]
    assert "APP1" in [s["name"] for s in snap["structures"]], snap["errors"]


def test_every_legend_of_the_depth_chart_is_inside_the_chart() -> None:
    """A dozen queues: each line's legend (its name and last value) must be drawn where the page shows it, inside
    the SVG's width, or the operator cannot tell which line is which queue."""
    width = 520
    series = {f"QUEUE.{i:02d}": [(0.0, float(i)), (1.0, float(i + 1))] for i in range(12)}
    svg = charts.line_chart("queue depth", series, unit="msgs", width=width)
    legends = {m.group(2): float(m.group(1)) for m in
               re.finditer(r'<text x="([\d.]+)" y="[\d.]+" class="legend" data-series="([^"]+)"', svg)}
    assert legends.keys() == series.keys()
    outside = sorted(name for name, x in legends.items() if x >= width)
    assert not outside, f"legends drawn beyond the chart's {width} px: {outside}"


def _ended(job: Job) -> bool:
    return job.state == DONE


def test_a_running_action_is_not_forgotten_behind_newer_ones() -> None:
    """A long restore, and meanwhile KEPT quick actions (in-doubt UOWs resolved one by one): the restore must stay
    listed, and so still refuse a second restore of the same structure, which would run beside the first."""
    release = threading.Event()

    def long_restore(progress: Progress) -> str:
        release.wait(60)
        return "restored"

    jobs = Jobs()
    restore = jobs.start("restore", "structure APP1", "restore of APP1", long_restore)
    try:
        for i in range(KEPT):
            quick = jobs.start("resolve", f"uow U{i}", f"commit of U{i}", lambda progress: "committed")
            wait_until(partial(_ended, quick), 30, f"commit of U{i} ended")
        assert restore.state == RUNNING
        assert restore in jobs.list(), "the running restore is no longer listed"
        with pytest.raises(JobRefusedError, match="restore of APP1 is still running"):
            jobs.start("restore", "structure APP1", "restore of APP1 again", lambda progress: "a second restore")
    finally:
        release.set()


def test_a_session_ends_when_the_operator_token_changes(where: dict[str, str]) -> None:
    """The operator token leaked and was replaced: whoever logged in with the old one must be logged out, not keep
    the console (its actions included) for the rest of the session's 12 hours."""
    source = GroupSource({**where, "token": "the-operator-token-before-it-leaked"})
    console = Console(source, interval_s=3600)

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            r = await client.post("/login", data={"token": "the-operator-token-before-it-leaked"},
                                  allow_redirects=False)
            assert r.status == 303
            assert (await client.get("/fragment")).status == 200
            source.where["token"] = "the-operator-token-after-the-leak"
            assert (await client.get("/fragment")).status == 401

    asyncio.run(scenario())


def test_a_sample_remembers_the_deepest_queues_only() -> None:
    """Thousands of queues must not make each of the history's samples thousands of entries."""
    history = History()
    snap = {"at": 1.0, "cf": {"ok": True}, "members": [], "structures": [],
            "queues": [{"name": f"Q{j:05d}", "depth": {"CP": j}} for j in range(QUEUES_SAMPLED * 10)]}
    history.add(snap)
    [sample] = history.samples
    assert len(sample.depths) == QUEUES_SAMPLED
    assert min(sample.depths.values()) == QUEUES_SAMPLED * 9  # the deepest ones


def test_the_chart_says_it_draws_the_deepest_queues_only() -> None:
    series = {f"Q{j:03d}": [(0.0, float(j)), (1.0, float(j))] for j in range(MAX_SERIES + 5)}
    svg = charts.line_chart("queue depth", series, unit="msgs")
    assert svg.count("<polyline") == MAX_SERIES
    assert f"the {MAX_SERIES} highest of {MAX_SERIES + 5}" in svg
    assert 'data-series="Q000"' not in svg and f'data-series="Q{MAX_SERIES + 4:03d}"' in svg


def test_the_charts_are_drawn_once_per_snapshot_not_per_page(where: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every open tab fetches /fragment every few seconds: the charts are drawn by the poller, not the page."""
    token = "the-operator-token-of-the-chart-test"
    console = Console(GroupSource({**where, "token": token}), interval_s=3600)
    drawn: list[str] = []
    draw = charts.line_chart

    def counting(title: str, *args: Any, **kwargs: Any) -> str:
        drawn.append(title)
        return draw(title, *args, **kwargs)

    monkeypatch.setattr(charts, "line_chart", counting)

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            await console.poll_once()
            assert (await client.post("/login", data={"token": token}, allow_redirects=False)).status == 303
            before = len(drawn)
            for _ in range(5):
                assert "queue depth" in await (await client.get("/fragment")).text()
            assert len(drawn) == before, "a page request drew the charts"
            await console.poll_once()
            assert len(drawn) == before + 2

    asyncio.run(scenario())


def test_a_session_ends_when_the_operator_token_file_is_replaced(where: dict[str, str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The token in the secrets directory ('cfemu secrets' rotates it by replacing the file): the next request of
    a session begun with the old one is refused, without the console re-reading its settings per request."""
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(mode=0o700)
    token_file = secrets_dir / "operator.token"
    write_private(token_file, b"the-operator-token-in-its-file")
    monkeypatch.setenv(ENV_SECRETS_DIR, str(secrets_dir))
    monkeypatch.delenv("SQM_OPERATOR_TOKEN", raising=False)
    console = Console(GroupSource(where), interval_s=3600)

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            r = await client.post("/login", data={"token": "the-operator-token-in-its-file"}, allow_redirects=False)
            assert r.status == 303
            assert (await client.get("/fragment")).status == 200
            write_private(token_file, b"the-operator-token-rotated")
            r = await client.get("/fragment")
            assert r.status == 401
            assert len(console.sessions) == 0

    asyncio.run(scenario())


def test_the_pages_automatic_refresh_keeps_no_session_alive(where: dict[str, str]) -> None:
    """A page left open refreshes itself every 2 s: that must not keep an unattended session from its idle end."""
    token = "the-operator-token-of-the-idle-test"
    console = Console(GroupSource({**where, "token": token}), interval_s=3600)

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            assert (await client.post("/login", data={"token": token}, allow_redirects=False)).status == 303
            [session] = list(console.sessions._by_id.values())
            session.used -= 100.0
            idle_since = session.used
            assert (await client.get("/fragment", headers={REFRESH_HEADER: "auto"})).status == 200
            assert session.used == idle_since, "the automatic refresh reset the idle clock"
            session.used -= SESSION_IDLE_S  # unattended for longer than the idle limit: refreshed all along
            assert (await client.get("/fragment", headers={REFRESH_HEADER: "auto"})).status == 401
            assert (await client.post("/login", data={"token": token}, allow_redirects=False)).status == 303
            [session] = list(console.sessions._by_id.values())
            session.used -= 100.0
            assert (await client.get("/fragment")).status == 200
            assert session.used > time.monotonic() - 60, "the operator's own request did not reset the idle clock"

    asyncio.run(scenario())


def _group(**health: str) -> dict[str, Any]:
    """A snapshot of a local cluster whose members have these healths."""
    return {"members": [{"name": n, "health": h} for n, h in health.items()],
            "processes": [{"process": n} for n in health]}


def test_the_last_serving_member_is_not_restarted() -> None:
    restart = ACTIONS["restart"]
    with pytest.raises(ActionError, match="QM1 is the last serving member"):
        restart.check({"member": "QM1"}, _group(QM1="serving", QM2="down", QM3="unreachable"))
    assert restart.check({"member": "QM1"}, _group(QM1="serving", QM2="serving")) == {"member": "QM1"}
    assert restart.check({"member": "QM2"}, _group(QM1="serving", QM2="down")) == {"member": "QM2"}


def test_one_member_restarts_at_a_time() -> None:
    """Two restarts of two members at once could leave no member serving: the second is refused, one line."""
    restart = ACTIONS["restart"]
    snap = _group(QM1="serving", QM2="serving", QM3="serving")
    first, second = restart.check({"member": "QM1"}, snap), restart.check({"member": "QM2"}, snap)
    release = threading.Event()
    jobs = Jobs()
    running = jobs.start("restart", restart.target(first), restart.title(first),
                         lambda progress: f"restarted: {release.wait(60)}")
    try:
        with pytest.raises(JobRefusedError, match="^restart of QM1 is still running: wait for it to end$"):
            jobs.start("restart", restart.target(second), restart.title(second), lambda progress: "a second")
    finally:
        release.set()
    wait_until(partial(_ended, running), 30, "the restart ended")
    jobs.start("restart", restart.target(second), restart.title(second), lambda progress: "restarted")


def test_parallel_failed_logins_from_one_address_are_throttled_as_consecutive_ones(where: dict[str, str]) -> None:
    """Guesses sent in parallel each waited their own delay at once: now each waits for the one before it, so the
    n-th failure in a row is answered no sooner than the sum of the delays before it."""
    console = Console(GroupSource({**where, "token": "the-operator-token-of-the-guess-test"}), interval_s=3600)
    guesses = 4
    floor = sum(Failures().record("x", 0.0)[1] for _ in range(guesses))  # the delays of 4 failures in a row

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            t0 = time.monotonic()
            replies = await asyncio.gather(*(client.post("/login", data={"token": f"guess {i}"})
                                             for i in range(guesses)))
            elapsed = time.monotonic() - t0
            assert [r.status for r in replies] == [401] * guesses
            assert elapsed >= floor, f"{guesses} parallel guesses answered in {elapsed:.2f} s (< {floor:.2f} s)"
            console.login_gate, console.failures = LoginGate(waiting=2), Failures()
            replies = await asyncio.gather(*(client.post("/login", data={"token": f"guess {i}"}) for i in range(3)))
            assert sorted(r.status for r in replies) == [401, 401, 429]
            busy = next(r for r in replies if r.status == 429)
            assert "login attempts from 127.0.0.1 are waiting already" in await busy.text()

    asyncio.run(scenario())


def test_a_local_peer_keeping_wrong_logins_queued_does_not_keep_the_operator_out(
        where: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every local client is the one loopback address: twelve wrong logins in a loop kept the address's queue full,
    and the operator's right token got 429 five times of five. The right token is now let in at once; the wrong
    ones are still answered one at a time after their delays, and counted."""
    monkeypatch.setattr(auth, "AUTH_DELAY_MAX_S", 0.4)  # the queue's delays short: the server's cleanup waits for them
    token = "the-operator-token-of-the-queue-test"
    console = Console(GroupSource({**where, "token": token}), interval_s=3600)

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, None)
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/login"
        stop = asyncio.Event()
        statuses: list[int] = []

        async def guesser(http: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                async with http.post(url, data={"token": "wrong"}, allow_redirects=False) as r:
                    statuses.append(r.status)

        try:
            async with aiohttp.ClientSession() as attacker, aiohttp.ClientSession() as operator:
                guessers = [asyncio.create_task(guesser(attacker)) for _ in range(12)]
                await asyncio.sleep(1.5)
                answers = []
                for _ in range(5):
                    async with operator.post(url, data={"token": token}, allow_redirects=False) as r:
                        answers.append(r.status)
                    await asyncio.sleep(0.2)
                stop.set()
                for task in guessers:
                    task.cancel()
                await asyncio.gather(*guessers, return_exceptions=True)
        finally:
            await runner.cleanup()
        assert answers == [303] * 5, answers
        assert set(statuses) <= {401, 429} and 429 in statuses, statuses  # the guesses: still queued and refused
        assert console.failures.record("127.0.0.1", time.monotonic())[0] > 3  # and counted

    asyncio.run(scenario())


@pytest.mark.parametrize(("token", "right_answer"), [
    ("the-operator-token-long-enough-to-pass-at-once", 303),  # strong: let in at once, past the queue
    ("short-token", 429),  # weak: waits its turn like any guess, so the full queue refuses it too
])
def test_only_a_strong_token_is_let_in_past_its_addresss_queue(where: dict[str, str], token: str,
                                                               right_answer: int) -> None:
    """Letting the right token past the queue means guesses are checked at once, however slowly failures are
    answered: harmless for 32 random bytes, a brute-force door for an operator's short token. A short token's login
    waits its turn, so with the address's queue full of guesses it is refused (429) like them."""
    console = Console(GroupSource({**where, "token": token}), interval_s=3600)
    console.login_gate = LoginGate(waiting=2)

    async def scenario() -> None:
        async with TestClient(TestServer(console.app)) as client:
            guesses = [asyncio.create_task(client.post("/login", data={"token": f"guess {i}"})) for i in range(2)]
            for _ in range(500):  # both guesses in the address's queue
                if _queued(console) == 2:
                    break
                await asyncio.sleep(0.01)
            assert _queued(console) == 2
            right = await client.post("/login", data={"token": token}, allow_redirects=False)
            assert right.status == right_answer
            assert sorted(r.status for r in await asyncio.gather(*guesses)) == [401, 401]

    asyncio.run(scenario())


def _queued(console: Console) -> int:
    return sum(n for _, n in console.login_gate._by_peer.values())


def test_a_request_naming_another_host_is_refused(where: dict[str, str]) -> None:
    """DNS rebinding: a page of rebound.example whose name now resolves to 127.0.0.1 sends Host: rebound.example.
    The console answers its own names and addresses only."""
    console = Console(GroupSource({**where, "token": "the-operator-token-of-the-host-test"}), interval_s=3600,
                      allowed_hosts=["console.example"])

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, None)
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}/login"
                for host in ("rebound.example", f"rebound.example:{port}", "127.0.0.1.rebound.example"):
                    r = await http.get(url, headers={"Host": host})
                    assert r.status == 421, host
                    assert "is not this console's address" in await r.text()
                    assert r.headers["X-Frame-Options"] == "DENY"
                r = await http.post(url, data={"token": "the-operator-token-of-the-host-test"},
                                    headers={"Host": "rebound.example"}, allow_redirects=False)
                assert r.status == 421 and len(console.sessions) == 0
                for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "[::1]:80", "console.example"):
                    assert (await http.get(url, headers={"Host": host})).status == 200, host
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
