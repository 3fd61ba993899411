"""The run's drain (qsg.chaos.runner.drain) ends whatever the group answers: a queue whose every get fails (its
structure FAILED for good) is left after DRAIN_REFUSED_S, the others are still drained. Pure logic: the client is
a stand-in that answers as a group with one lost structure would."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cfemu.errors import NoMessageError, StructureFailedError
from qsg.chaos import runner
from qsg.chaos.group import DRAINED
from qsg.chaos.history import History

LOST = DRAINED[0]  # the queue of the structure whose restore failed


class _Group:
    """What the drain reads of a group: its members' endpoints and its token."""

    direct = {"QM1": ("127.0.0.1", 1)}
    c = SimpleNamespace(token="t")


class _Client:
    """Every get on LOST refused as a FAILED structure refuses it; each other queue holds one message."""

    qmgr = "QM1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.left = {q: 1 for q in DRAINED if q != LOST}

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, queue: str, syncpoint: bool) -> Any:
        if queue == LOST:
            raise StructureFailedError("structure APP1 failed")
        if not self.left[queue]:
            raise NoMessageError("no message")
        self.left[queue] -= 1
        return SimpleNamespace()


def test_a_queue_that_refuses_every_get_is_left_and_the_drain_ends(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "Client", _Client)
    monkeypatch.setattr(runner, "delivery_fields", lambda m, qmgr: {})
    monkeypatch.setattr(runner, "DRAIN_REFUSED_S", 1.0)
    history = History(tmp_path / "history.jsonl")
    result: list[int] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: result.append(runner.drain(_Group(), history)),  # type: ignore[arg-type]
                              daemon=True)
    worker.start()
    worker.join(timeout=60.0)
    took = time.monotonic() - t0
    assert not worker.is_alive(), "the drain did not end"
    history.close()
    assert result == [len(DRAINED) - 1]  # every other queue drained
    assert took >= 1.0
    notes = [e for e in map(json.loads, (tmp_path / "history.jsonl").read_text().splitlines())
             if e.get("what") == "drain gave up"]
    assert [(n["queue"], n["reason"]) for n in notes] == [(LOST, "MQRC_CF_STRUC_FAILED")]
