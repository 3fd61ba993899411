"""The chaos suite's service drain (qsg.chaos.conversations.drain_service) against a real `sqm run` member and a
real redis-server: a receipt whose COMMIT is refused leaves nothing held, so the UOW is received again and
processed. Before: the drain's session kept the UOW, every later receive answered 'end of unit of work', the drain
went round until its limit and the final pass found the UOW ACCEPTED (CHAOS-RESULTS.md, 2026-11-26 20:10,
uow-unsettled)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from qsg.chaos.conversations import SERVICE, SERVICE_UOW, Conv, ConvRunner, ConvSession, drain_service
from qsg.chaos.history import History, load_history
from qsg.chaos.uowcheck import DRAIN_CLIENT, FINAL_CLIENT, RECEIVER
from sqm.conversations import uowcontrols as ctl
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf
from tests.support.service_proc import TOKEN, ServerProc, start_server
from tests.support.uow_looks import a_sweepers_look


@pytest.fixture
def group(redis_server: Any, tmp_path: Path) -> Iterator[tuple[ServerProc, QueueManager]]:
    """One member serving clients (the drain's) and one in this process (the sweeper whose look the test times)."""
    client = redis_server.client()
    lose_cf(client)
    client.close()
    define_group(redis_server.url, structure="APP2", queues=("Q3",))
    Admin(connect(redis_server.url)).define_queue(SERVICE, "APP2", uow=SERVICE_UOW)
    srv = start_server(redis_server.url, tmp_path, "QM1", "--token", TOKEN)
    look = start_qm(redis_server.url, tmp_path / "logs", "QM2", background=False)
    yield srv, look
    look.stop()
    assert srv.stop() == 0, srv.log_text()


def final_statuses(history: History) -> dict[str, str]:
    events = load_history(history.path)
    invoked = {e["id"]: e for e in events if e.get("type") == "invoke"}
    return {str(e["suow"]): str(e["status"]) for e in events
            if e.get("type") == "ok" and invoked[e["id"]]["client"] == FINAL_CLIENT and e.get("suow")}


@pytest.mark.slow
def test_a_drain_receipt_whose_commit_is_refused_is_backed_out_and_received_again(
        group: tuple[ServerProc, QueueManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, qm = group
    history = History(tmp_path / "history.jsonl", seed=0)
    eps = [("127.0.0.1", srv.port)]
    sender = ConvSession(history, eps, "c0", user="c0", user_token="chaos-0", token=TOKEN)
    assert ConvRunner(history, sender, "c0.1").run(Conv("send", (("0-0-1", 64), ("0-0-2", 64))))
    sender.close()
    uow = next(str(e["suow"]) for e in load_history(history.path) if e.get("type") == "ok" and e.get("suow"))

    # The drain's first COMMIT comes while a sweeper holds the UOW's control to look at it, longer than a settle waits
    # for it (ctl.HELD_WAIT_S): the COMMIT is refused, as a settle of a UOW that changed meanwhile is.
    real_sync = ConvRunner.sync
    looks: list[threading.Thread] = []

    def sync(self: ConvRunner, c: Any, option: str, role: str, suow: str = "") -> tuple[str, Any]:
        if self.s.name == DRAIN_CLIENT and option == "COMMIT" and role == RECEIVER and not looks:
            looks.append(a_sweepers_look(qm, SERVICE, suow, ctl.HELD_WAIT_S + 1.0))
        return real_sync(self, c, option, role, suow)
    monkeypatch.setattr(ConvRunner, "sync", sync)
    t0 = time.monotonic()
    out = drain_service(history, eps, TOKEN, limit_s=20.0)
    for t in looks:
        t.join(10)
    events = load_history(history.path)
    invoked = {e["id"]: e for e in events if e.get("type") == "invoke"}
    refused = [e for e in events if e.get("type") == "fail" and invoked[e["id"]]["client"] == DRAIN_CLIENT
               and invoked[e["id"]].get("option") == "COMMIT"]
    assert looks and refused, "the drain's first COMMIT was refused"
    assert out["UOWs drained"] == 1 and out["UOWs still active"] == 0, out
    assert final_statuses(history) == {uow: "PROCESSED"}
    assert time.monotonic() - t0 < 15, "the drain did not wait for its limit"
