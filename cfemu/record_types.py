"""The record type of a persistent store record (EntireX's PSTORE report "Record Type"), by the queue it is on: the
migration's reports (backup.migrate_report) and a member's running store report (sqm.core.storereport) name records
the same way.

``message`` (an entry of a plain queue, or of a service's ``.UOWDATA``), ``uow-status`` (an entry of a service's
``.UOWCTL``), ``uow-last`` (a user's SYNCPOINT LAST pointer on ``.UOWCTL``, correlation id ``L``), ``publication``
(``<T>.PUB``), ``subscription`` (``<T>.SUB``; ``subscription-roster``: its roster entry, correlation id ``R``) and
``definition`` (the structure and each queue), ``conversation`` (a conversation's record on ``.UOWCTL``,
correlation id ``V``)."""

from __future__ import annotations

UOWDATA, UOWCTL = ".UOWDATA", ".UOWCTL"  # cfemu.uow_attributes' companion suffixes
PUB, SUB = ".PUB", ".SUB"  # a topic's companion suffixes (cfemu.topic_attributes, docs/pubsub.md)
MESSAGE, UOW_STATUS, UOW_LAST, PUBLICATION, SUBSCRIPTION, SUBSCRIPTION_ROSTER, DEFINITION = (
    "message", "uow-status", "uow-last", "publication", "subscription", "subscription-roster", "definition")
CONVERSATION = "conversation"
LAST_CORRELID = b"L".hex()  # a user's SYNCPOINT LAST pointer on .UOWCTL (sqm.conversations.uowcontrols.LAST_LETTER)
CONVERSATION_CORRELID = b"V".hex()  # a conversation's record on .UOWCTL (sqm.conversations.convrecord)
ROSTER_CORRELID = b"R".hex()  # a subscription's roster entry on .SUB (sqm.pubsub.pubsub.ROSTER_LETTER), not its position


def record_type(queue: str, correlid: str = "") -> str:
    """A CF entry's record type, by the companion-queue suffix of its queue (and on .UOWCTL its correlation id:
    a status letter, or L for a user's LAST pointer)."""
    if queue.endswith(UOWCTL):
        return {LAST_CORRELID: UOW_LAST, CONVERSATION_CORRELID: CONVERSATION}.get(correlid, UOW_STATUS)
    if queue.endswith(PUB):
        return PUBLICATION
    if queue.endswith(SUB):
        return SUBSCRIPTION_ROSTER if correlid == ROSTER_CORRELID else SUBSCRIPTION
    return MESSAGE


__all__ = ["CONVERSATION", "DEFINITION", "MESSAGE", "PUBLICATION", "SUBSCRIPTION", "SUBSCRIPTION_ROSTER", "UOW_LAST", "UOW_STATUS",
           "record_type"]
