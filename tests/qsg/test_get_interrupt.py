"""Ctrl-C in a waiting `cfemu get` (an in-process member, a real CF): acted on between two of the member's calls,
never inside one, and within a wait slice, however long the --wait-ms. Raised inside the member's own call (a
sleep in its wait, a CF call, a lock just taken), it could leave the member unable to back the unit of work out
or stop, as it did for put."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from qsg.cli import main
from qsg.messages_cli import WAIT_SLICE_MS
from sqm.core.connection import Connection


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> list[str]:
    return ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]


def test_ctrl_c_in_a_long_wait_ends_the_get_between_two_member_calls(
        where: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["define", "structure", "APP1", *where]) == 0
    assert main(["define", "queue", "QWAIT", "--structure", "APP1", *where]) == 0
    calls: list[str] = []  # how each of the member's gets ended: "returned", "no message" or "interrupted inside"
    signalled: list[float] = []
    member_get = Connection.get

    def get(self: Connection, queue: str, **kw: Any) -> Any:
        if not calls:  # Ctrl-C arrives while the member waits in its first call
            threading.Timer(WAIT_SLICE_MS / 4000, lambda: (signalled.append(time.monotonic()),
                                                           os.kill(os.getpid(), signal.SIGINT))).start()
        try:
            reply = member_get(self, queue, **kw)
        except KeyboardInterrupt:
            calls.append("interrupted inside")
            raise
        except Exception:
            calls.append("no message")
            raise
        calls.append("returned")
        return reply

    monkeypatch.setattr(Connection, "get", get)
    capsys.readouterr()
    assert main(["get", "QWAIT", "--wait-ms", "60000", *where]) == 130
    ended = time.monotonic()
    assert calls == ["no message"], calls
    assert ended - signalled[0] < 5, "the interrupt is acted on within a slice of the wait, not at its end"
    assert capsys.readouterr().err.rstrip().endswith("cfemu: interrupted")

    # The member stopped cleanly: a message put now is there, and the next get as the same member takes it.
    monkeypatch.setattr(Connection, "get", member_get)
    assert main(["put", "QWAIT", "after", *where]) == 0
    assert main(["get", "QWAIT", "--json", *where]) == 0
    assert '"body": "after"' in capsys.readouterr().out
