"""The bounds a publication being published is held to, message by message, before anything of it is committed:

- its size: its messages' data, plus PUBLICATION_MESSAGE_COST each, at most PUBLICATION_ROOM, which is what one
  receive_pub reply carries at the service's default frame. A subscriber receives a publication whole, in one reply;
  a larger one could be committed but no network subscriber could ever receive it, and each subscription receives
  in commit order, so it would hold back every later publication of each subscription for its lifetime. The figures
  restate sqm.service.protocol's (MAX_FRAME less its ENVELOPE, MESSAGE_COST per message), which this package may not
  import: tests/sqm/test_pubsub_publication_bounds.py holds them equal.
- its bytes held in the member's memory until COMMIT: counted against the member's budget of request bytes in
  flight (the service's ByteBudget, --max-request-bytes-per-member), reserved as each message is published and given
  back at COMMIT, BACKOUT or the end of the connection. A message the budget has no room for (within the wait a
  large request's frame has) is refused; the publication keeps the messages it had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cfemu.errors import BadRequestError, ResourceProblemError
from cfemu.limits import DESCRIPTOR_ALLOWANCE, MAX_MSG_LENGTH

PUBLICATION_ROOM = MAX_MSG_LENGTH + DESCRIPTOR_ALLOWANCE  # a default frame's room beside its envelope
PUBLICATION_MESSAGE_COST = 512  # what each message costs a reply beyond its data


def publication_size(data_bytes: int, messages: int) -> int:
    """What a publication of ``messages`` messages with ``data_bytes`` of data takes of a receive_pub reply."""
    return data_bytes + PUBLICATION_MESSAGE_COST * messages


def check_fits(topic: str, pub: str, data_bytes: int, messages: int, body: int) -> None:
    """Refuse (BadRequestError) one more message of ``body`` bytes that would take the publication past the room of
    a reply at the default frame."""
    size = publication_size(data_bytes + body, messages + 1)
    if size > PUBLICATION_ROOM:
        raise BadRequestError(
            f"publication {pub} to {topic}: a message of {body} bytes would make it {size} bytes with its "
            f"{messages + 1} messages' reply costs, more than one receive_pub reply carries ({PUBLICATION_ROOM}); "
            f"it keeps its {messages} messages: commit it and publish the rest as another")


class Holder(Protocol):
    """What holds bytes of the member's budget: a connection (its frames and replies, sqm.service.session.Session
    .reserved), or a connection's publication being published (sqm.pubsub.pubsub.PubSubSession.reserved, until its
    COMMIT or BACKOUT)."""

    reserved: int


class ByteBudget(Protocol):
    """The member's budget of bytes in flight (sqm.service.session.ByteBudget)."""

    limit: int
    used: int

    def reserve(self, holder: Holder, n: int, wait_s: float) -> bool: ...

    def release(self, holder: Holder, n: int | None = None) -> None: ...


@dataclass(frozen=True)
class DraftBudget:
    """Where a member's publications being published count their bytes, and how long one waits for room."""

    budget: ByteBudget
    wait_s: float

    def reserve(self, holder: Holder, topic: str, pub: str, n: int, messages: int) -> None:
        """Reserve n bytes for holder, or refuse the message (ResourceProblemError) when the budget has no room
        for them within the wait."""
        if not self.budget.reserve(holder, n, self.wait_s):
            raise ResourceProblemError(
                f"publish to {topic}: the member's budget of bytes in flight ({self.budget.limit}, requests and "
                f"publications being published) has no room for a message of {n} bytes (in use: "
                f"{self.budget.used}); publication {pub} keeps its {messages} messages: commit or back out "
                "publications being published, or try again")

    def release(self, holder: Holder) -> None:
        """Give back every byte holder's publication holds."""
        self.budget.release(holder)


__all__ = ["PUBLICATION_ROOM", "PUBLICATION_MESSAGE_COST", "ByteBudget", "DraftBudget", "Holder", "check_fits",
           "publication_size"]
