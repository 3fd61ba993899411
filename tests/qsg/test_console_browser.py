"""The web console in a real headless browser (Debian's chromium, driven by Playwright) against a live local
cluster whose service and console serve TLS: log in, read a queue's depth and a structure's state, take a backup
and see it listed, resolve an in-doubt unit of work, restore a structure, see the CF lost and restore the structure
it lost, restart a member, log out; each action with confirmation, as an operator would. Screenshots are kept in var/console-shots/ (not committed).

Opt-in (marker ``browser``): ``make console-test`` installs chromium when it is missing and runs it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qsg.local_group import LocalGroup
from sqm.service.client import Client, client_tls_context
from tests.support.certs import issue, make_ca

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "var" / "console-shots"
CHROMIUM = os.environ.get("CFEMU_CHROMIUM", "/usr/bin/chromium")
# No network beyond loopback here: the flags keep chromium from calling home (refused connections, slow starts).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 90_000  # a page condition on a loaded machine: the console reads the group every 2 s


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[LocalGroup, Path]]:
    ca = make_ca(tmp_path, "ca")
    cert, key = issue(ca, tmp_path, "server", ip="127.0.0.1")
    # RECAUTO off: the restore below is the operator's (a member's RECAUTO would race it for the structure).
    g = LocalGroup.up(tmp_path / "g", managers=2, backup_interval=None, lease_ms=2000, recauto=False,
                      console=True, manager_args=["--tls-cert", str(cert), "--tls-key", str(key)])
    try:
        yield g, ca.cert
    finally:
        g.refresh()  # the member the console restarted: its new pid, from cluster.json
        g.down(timeout=10)


def test_the_console_in_a_browser(group: tuple[LocalGroup, Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    g, ca_cert = group
    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), f"no chromium at {CHROMIUM}: run 'make console-test'"
    url = g.console_url
    assert url and url.startswith("https://127.0.0.1:"), url  # TLS, as the members' service
    [row] = [p for p in g.status()["processes"] if p["process"] == "console"]
    assert row["alive"] and row["address"] == url
    tls = client_tls_context(str(ca_cert))
    (_, host, port1), (_, _, port2) = g.endpoints
    with Client((host, port1), token=g.token, tls=tls) as c:
        for body in (b"one", b"two", b"three"):
            c.put("Q1", body)
        c.commit()
    with Client((host, port1), token=g.token, tls=tls) as c:
        c.put("Q2", b"in doubt")
        uow = c.prepare("XID-CONSOLE")
    operator_token = g.operator_token
    assert operator_token

    SHOTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        # The console's certificate is the test CA's: the browser has no way to trust that CA, so it is told to
        # accept it (the service's clients above check it for real).
        context = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)

        def shot(name: str) -> None:
            page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

        def confirm(question: str, name: str) -> None:
            expect(page.locator("#question")).to_contain_text(question)
            shot(name)
            page.click("#confirm")
            page.wait_for_url(url + "#jobs")

        def job_done(title: str) -> Any:
            row = page.locator("#jobs tr", has_text=title).first
            expect(row).to_have_attribute("data-state", "done", timeout=WAIT_MS)
            return row

        page.goto(url)
        expect(page.locator("#token")).to_be_visible()
        page.fill("#token", "not the token")
        page.click("#login")
        expect(page.locator("#login-error")).to_have_text("wrong token")
        shot("01-login-refused")
        problems.clear()  # the refused login's page came with its 401, as it should
        page.fill("#token", operator_token)
        page.click("#login")
        cookie = next(c for c in context.cookies() if c["name"] == "cfemu_console")
        assert cookie["secure"] and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert operator_token not in page.url

        expect(page.locator("#queue-Q1 td.depth")).to_have_text("3")
        expect(page.locator("#structure-APP1 td.state")).to_contain_text("ACTIVE")
        for member in ("QM1", "QM2"):
            expect(page.locator(f"#member-{member} td.health")).to_contain_text("serving")
        expect(page.locator(f'#indoubt tr[data-uow="{uow}"]')).to_contain_text("XID-CONSOLE")
        shot("02-overview")

        # A backup, confirmed, then listed with its signature.
        page.click("#structure-APP1 button.backup-now")
        confirm("Take a backup of structure APP1 now?", "03a-confirm-backup")
        job_done("backup of APP1")
        backup = page.locator("#backups tr[data-backup]").first
        expect(backup).to_contain_text("APP1")
        expect(backup).to_contain_text("ok")
        expect(backup).to_contain_text("key ")
        shot("03-backup-listed")

        # The in-doubt unit of work, committed: its message becomes available on Q2.
        page.locator(f'#indoubt tr[data-uow="{uow}"] button.resolve-commit').click()
        confirm(f"Commit unit of work {uow} (XID XID-CONSOLE), in doubt on QM1?", "04a-confirm-commit")
        expect(job_done(f"commit of {uow}")).to_contain_text("committed on QM1")
        expect(page.locator("#no-indoubt")).to_be_visible()
        expect(page.locator('#queue-Q2 td[data-depth="CP"]')).to_have_text("1")
        shot("04-indoubt-resolved")

        # A restore of the ACTIVE structure (marked FAILED first): its progress reported, its report listed.
        page.click("#structure-APP1 button.restore")
        confirm("Restore structure APP1 (ACTIVE) from its newest good backup", "05a-confirm-restore")
        expect(job_done("restore of APP1")).to_contain_text("restored APP1")
        expect(page.locator("#restores tbody tr").first).to_contain_text("APP1")
        expect(page.locator("#structure-APP1 td.state")).to_contain_text("ACTIVE")
        expect(page.locator("#queue-Q1 td.depth")).to_have_text("3")
        jobs = page.request.get(url + "api/snapshot").json()["jobs"]
        restore_job = next(j for j in jobs if j["title"] == "restore of APP1")
        assert restore_job["phase"], restore_job  # the restore reported its phases to the page as it went
        expect(page.locator("#events")).to_contain_text("restore of APP1: done: restored APP1")
        shot("05-restored")

        # The CF lost (SIGKILL) and started again empty: the structure is FAILED, not in the CF; a restore from
        # the console brings it back with its messages (RECAUTO is off: nothing else restores it).
        g.kill_cf()
        expect(page.locator("#cf-down")).to_be_visible()
        shot("07-cf-lost")
        g.restart_cf()
        expect(page.locator("#structure-APP1 td.state")).to_contain_text("FAILED")
        expect(page.locator("#structure-APP1 td.state")).to_contain_text("not in CF")
        expect(page.locator("#structure-APP1 button.backup-now")).to_be_disabled()
        shot("08-structure-failed")
        page.click("#structure-APP1 button.restore")
        confirm("Restore structure APP1 (FAILED) from its newest good backup", "09a-confirm-restore-lost")
        expect(page.locator('#jobs tr[data-state="done"]')).to_have_count(4)  # this restore too (newest first)
        expect(job_done("restore of APP1")).to_contain_text("restored APP1")
        expect(page.locator("#structure-APP1 td.state")).to_contain_text("ACTIVE")
        expect(page.locator("#queue-Q1 td.depth")).to_have_text("3")
        expect(page.locator('#queue-Q2 td[data-depth="CP"]')).to_have_text("1")
        expect(page.locator("#events")).to_contain_text("the CF does not answer")
        expect(page.locator("#events")).to_contain_text("structure APP1: ACTIVE -> FAILED")
        shot("09-restored-after-cf-loss")

        # A member restarted by the operator.
        page.click("#member-QM2 button.restart")
        confirm("Restart member QM2?", "06a-confirm-restart")
        expect(job_done("restart of QM2")).to_contain_text("QM2 restarted")
        expect(page.locator("#member-QM2 td.health")).to_contain_text("serving")
        shot("06-member-restarted")

        page.click("#logout")
        expect(page.locator("#token")).to_be_visible()
        assert page.request.get(url + "fragment").status == 401
        browser.close()
    # Nothing the page tried was refused (a script or style blocked by the Content-Security-Policy, a 404).
    assert problems == []
