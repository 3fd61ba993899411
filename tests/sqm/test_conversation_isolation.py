"""A conversation is its sender's (docs/uow.md, "Conversations"): another user who names its id, against a real
redis-server and real logs, can neither add a unit of work to it (which the bound server instance would take as part
of the conversation it keeps context for) nor end it with EOC or EOCCANCEL."""

from __future__ import annotations

import pytest

from cfemu.errors import BadRequestError, NoMessageError, UowStatusError
from sqm.conversations.conversation import SYNC, Conversation
from sqm.core.manager import QueueManager

S, SVC = "APP1", "SVC"  # what the qms fixture (tests/sqm/conftest.py) defines


def test_another_user_cannot_add_a_uow_to_a_bound_conversation(qms: tuple[QueueManager, QueueManager]) -> None:
    alice, mallory = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "mallory", "tok-m")
    server = Conversation(qms[1], "server", "i1")
    conv = alice.send(SVC, b"T1", commit=True).conversation
    assert server.receive(SVC, option=SYNC, convid="NEW").body == b"T1"
    server.commit()  # the conversation is the server instance's now
    with pytest.raises(UowStatusError, match=f"conversation {conv} of service SVC is another sender's"):
        mallory.send(SVC, b"forged", commit=True, conversation=conv)
    with pytest.raises(NoMessageError):
        server.receive(SVC, option=SYNC, convid=conv)  # nothing of mallory's joined it
    alice.send(SVC, b"T2", commit=True, conversation=conv)  # its sender goes on
    assert server.receive(SVC, option=SYNC, convid="OLD").body == b"T2"
    server.commit()


def test_another_user_cannot_end_a_conversation(qms: tuple[QueueManager, QueueManager]) -> None:
    alice, mallory = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "mallory", "tok-m")
    conv = alice.send(SVC, b"T1", commit=True, conversation="orders-42").conversation
    with pytest.raises(UowStatusError, match="another sender's"):
        mallory.send(SVC, b"end it", eoc="EOC", conversation=conv)
    alice.send(SVC, b"T2", commit=True, conversation=conv)  # not ended


def test_the_same_user_with_another_token_is_another_sender(qms: tuple[QueueManager, QueueManager]) -> None:
    alice = Conversation(qms[0], "alice", "tok-a")
    conv = alice.send(SVC, b"T1", commit=True).conversation
    with pytest.raises(UowStatusError, match="another sender's"):
        Conversation(qms[1], "alice", "guessed").send(SVC, b"x", commit=True, conversation=conv)
    again = Conversation(qms[1], "alice", "tok-a")  # the same user id and token, another session and member
    assert again.send(SVC, b"T2", commit=True, conversation=conv).conversation == conv


@pytest.mark.parametrize("conversation", ["NEW", "OLD", "ANY", "tab\there", "x" * 65])
def test_a_conversation_id_a_receive_could_not_name_is_refused(qms: tuple[QueueManager, QueueManager],
                                                               conversation: str) -> None:
    """A sender's conversation id must be one RECEIVE can name by CONVID: not one of its keywords, 1-64 printable
    characters; refused before anything is made."""
    alice = Conversation(qms[0], "alice", "tok-a")
    with pytest.raises(BadRequestError, match="send: a conversation id must be 1-64 printable characters"):
        alice.send(SVC, b"T1", commit=True, conversation=conversation)
    assert alice.sending is None
