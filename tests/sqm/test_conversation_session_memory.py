"""A long-lived session stays small (docs/uow.md): the UOW -> service hints a session keeps for lookups by id are
bounded, and a UOW whose hint was dropped is still found, against a real redis-server and real logs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.conversations import conversation
from sqm.conversations.conversation import SYNC, Conversation
from sqm.core.manager import QueueManager
from tests.support.group import start_qm

S, SVC = "APP1", "SVC"


@pytest.fixture
def qm(redis_url: str, tmp_path: Path) -> Iterator[QueueManager]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S, ())
    admin.define_queue(SVC, S, uow={"status_lifetime": 2})
    m = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield m
    m.stop()


def test_a_sessions_uow_hints_are_bounded_and_an_old_uow_is_still_found(qm: QueueManager,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conversation, "KNOWN_MAX", 8)
    snd, rcv = Conversation(qm, "alice", "tok-a"), Conversation(qm, "server", "i1")
    sent = [snd.send(SVC, b"%d" % i, commit=True).uow for i in range(20)]
    for _ in sent:
        rcv.receive(SVC, option=SYNC)
        rcv.commit()
    assert len(snd._known) == 8 and len(rcv._known) == 8
    assert set(snd._known) == set(sent[-8:])  # the newest
    assert snd.query(sent[0])["status"] == "PROCESSED"  # its hint dropped, found over the services
