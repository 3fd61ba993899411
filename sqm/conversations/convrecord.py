"""A conversation's record: which server instance a conversation of units of work is bound to (EntireX's
"Behavior of Conversation at Broker Restart" and "UOWs and Replicated Servers", docs/uow.md, "Conversations").

A conversation is the UOWs one sender sends with one conversation id to one service. Its record is one entry on the
service's ``<SERVICE>.UOWCTL`` queue beside the UOWs' control entries: message id = ``record_id(conversation)``,
correlation id ``V``, body = ``ConvRecord`` (msgpack). It is a message like the controls, so it is logged, backed up
and restored, and it changes inside the same queue-manager unit of work as the UOW status change it follows.

The rules, as the seed gives them:

* a conversation nobody has received is *new*: any instance of the service may receive it (RECEIVE CONVID=NEW);
* the receive of its first UOW binds it to that receiver (user id and token); its later UOWs go only to that
  receiver (CONVID=OLD, or its id); one UOW of a conversation is delivered at a time, in commit order;
* when its first UOW comes back to ACCEPTED unsettled (a restart of the member that held the delivery, a peer's
  recovery of it, a CF loss; and, alike, the receiver's own BACKOUT or postponement) the binding is dropped: the
  conversation is new again; once the bound receiver settled its first UOW (COMMIT or CANCEL) the binding is kept
  through every restart;
* a conversation is its sender's (user id and token): another sender naming its id is refused, so it can neither
  slip a UOW to the bound server instance nor end the conversation;
* EOC and EOCCANCEL end the conversation: a later send on it is refused while the record lasts;
* a record with no active UOW for the service's CONV-NONACT (on the pseudo-clock) is removed: the conversation is
  over, and its id may begin a new one.

This module is pure: the records and their rules; sqm.conversations.bindings moves them on the CF.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, replace

from sqm.core.packed_body import PackedBody

RECORD_LETTER = "V"  # the records' correlation id on the control queue
RECORD_CID_HEX = RECORD_LETTER.encode().hex()
NEW, OLD, ANY = "NEW", "OLD", "ANY"  # RECEIVE's CONVID: unbound conversations, this receiver's, its own then new


@dataclass
class ConvRecord(PackedBody):
    conversation: str
    service: str
    sender: str = ""  # the user id that began it ("" a record made before senders were kept: anyone's)
    sender_token: str = ""  # its token, sealed: only that sender may add a UOW to it or end it
    receiver: str = ""  # the bound server instance's user id ("" unbound: a new conversation)
    receiver_token: str = ""  # its token, sealed (sqm.core.logon_token)
    first: str = ""  # the UOW whose receive bound it
    firm: bool = False  # the bound receiver settled that first UOW: the binding outlives restarts
    delivering: str = ""  # the UOW of it being received now ("" none): one at a time, in commit order
    eoc: str = ""  # "", "EOC" or "EOCCANCEL": the sender ended the conversation; no further send on it
    active: int = 0  # its UOWs in an active status (RECEIVED, ACCEPTED, DELIVERED, POSTPONED)
    changed_pc: int = 0  # pseudo-clock at its last change
    nonact_ms: int = 0  # CONV-NONACT: with no active UOW, it ends when idle this long
    lifetime_ms: int = 0  # the longest lifetime of its UOWs: it ends when idle this long whatever ``active`` says
    persistent: bool = True

    @property
    def bound(self) -> bool:
        return bool(self.receiver)


def idle(rec: ConvRecord, pc: int, *, held_open: bool = False) -> bool:
    """Whether the conversation is over at pseudo-clock ``pc``: nothing of it being delivered, and no active UOW for
    CONV-NONACT, or no change for the longest lifetime of its UOWs (its count can be high after a CF loss: the
    restore fold drops UOWs one entry at a time, and does not count them off the record) while its sender holds none
    of its UOWs open (``held_open``: a RECEIVED UOW never times out, and once committed it must find its record)."""
    if rec.delivering:
        return False
    quiet = pc - rec.changed_pc
    return (rec.active <= 0 and quiet >= rec.nonact_ms) or (quiet >= rec.lifetime_ms and not held_open)


def idle_unless_held_open(rec: ConvRecord, pc: int) -> bool:
    """Whether only a UOW its sender holds open can keep the conversation from being over (the costly check)."""
    return idle(rec, pc) and not idle(rec, pc, held_open=True)


def owned_by(rec: ConvRecord, sender: str, sender_token: str) -> bool:
    """Whether the sender (user id, sealed token) may add to the conversation: the one that began it."""
    if not rec.sender:
        return True
    return rec.sender == sender and hmac.compare_digest(rec.sender_token, sender_token)


def counted(rec: ConvRecord, was_active: bool, is_active: bool) -> ConvRecord:
    """The record after one of its UOWs changed status: counted off when it left the active statuses."""
    return replace(rec, active=max(0, rec.active + int(is_active) - int(was_active)))


def record_id(conversation: str) -> bytes:
    """The record's message id (24 bytes, as a message id is): a conversation id is the sender's text."""
    return hashlib.sha256(b"conversation\0" + conversation.encode()).digest()[:24]


def bind(rec: ConvRecord, uow: str, receiver: str, receiver_token: str, pc: int) -> ConvRecord:
    """A receive took ``uow`` of the conversation: delivered one at a time, and bound to the receiver if new."""
    if rec.bound:
        return replace(rec, delivering=uow, changed_pc=pc)
    return replace(rec, receiver=receiver, receiver_token=receiver_token, first=uow, firm=False, delivering=uow,
                   changed_pc=pc)


# How a UOW of the conversation left DELIVERED (bindings.follow_delivered): settled by its receiver, or returned.
SETTLED, RETURNED = "settled", "returned"


def after_delivered(rec: ConvRecord, uow: str, how: str, pc: int) -> ConvRecord:
    """A UOW of the conversation left DELIVERED. SETTLED (its receiver's COMMIT or CANCEL): the binding is firm once
    the first UOW is settled. RETURNED (a receiver's BACKOUT or postponement, a restart, a peer's recovery or a CF
    loss): as ``after_restart``, so a conversation whose first UOW its receiver never settled is new again."""
    done = replace(rec, delivering="" if rec.delivering == uow else rec.delivering, changed_pc=max(pc, rec.changed_pc))
    if how == SETTLED:
        return replace(done, firm=True) if uow == rec.first else done
    return after_restart(done) if not rec.delivering or rec.delivering == uow else done


def after_restart(rec: ConvRecord) -> ConvRecord:
    """Seed 003: a first UOW that reverts from DELIVERED to ACCEPTED at a restart drops the conversation's
    assignment to its server; once the first UOW was received and committed, the link is kept."""
    if rec.firm:
        return replace(rec, delivering="")
    return replace(rec, receiver="", receiver_token="", first="", delivering="")


__all__ = ["ANY", "NEW", "OLD", "RECORD_CID_HEX", "RECORD_LETTER", "RETURNED", "SETTLED", "ConvRecord",
           "after_delivered", "after_restart", "bind", "counted", "idle", "idle_unless_held_open", "owned_by", "record_id"]
