"""The status of a unit of work sent to a service (EntireX's "Understanding UOW Status", docs/uow.md): the statuses, the state
table of every transition, the control record that carries a UOW's status, and the one rule that settles a status
after a restart (the restart Tables 1 and 2, docs/uow.md), used alike by member restart, peer recovery, the sweeper and
every restore engine's fold.

A UOW's status lives in one *control entry* on the service's ``<SERVICE>.UOWCTL`` queue: message id = the UOW id,
correlation id = the status letter (so the next ACCEPTED UOW is a get by correlation id, in commit order), body =
the Control record below (msgpack). A status change replaces the entry (get the old one, put the new one) inside a
queue-manager unit of work, so the change is logged, backed up and restored like any message, and atomic with the
moves of the UOW's messages it goes with. The entry is persistent when the UOW's messages are, or when its status
is (UWSTATP): docs/uow.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cfemu.uow_attributes import CONTROL_SUFFIX
from sqm.conversations.convrecord import RECORD_CID_HEX, ConvRecord
from sqm.conversations.convrecord import after_restart as conversation_after_restart
from sqm.core.packed_body import PackedBody

RECEIVED, ACCEPTED, DELIVERED, POSTPONED = "RECEIVED", "ACCEPTED", "DELIVERED", "POSTPONED"
BACKEDOUT, PROCESSED, CANCELLED, TIMEOUT, DISCARDED = "BACKEDOUT", "PROCESSED", "CANCELLED", "TIMEOUT", "DISCARDED"
ACTIVE = (RECEIVED, ACCEPTED, DELIVERED, POSTPONED)
FINAL = (BACKEDOUT, PROCESSED, CANCELLED, TIMEOUT, DISCARDED)  # kept only with persistent status
STATUSES = ACTIVE + FINAL
LETTER = {RECEIVED: "R", ACCEPTED: "A", DELIVERED: "D", POSTPONED: "P", BACKEDOUT: "B", PROCESSED: "X",
          CANCELLED: "C", TIMEOUT: "T", DISCARDED: "S"}
BY_LETTER = {v: k for k, v in LETTER.items()}

# What a receive says of the message it returns (EntireX's "UOW Status on RECEIVE", docs/uow.md).
RECV_NONE, RECV_FIRST, RECV_MIDDLE, RECV_LAST, RECV_ONLY = (
    "RECV_NONE", "RECV_FIRST", "RECV_MIDDLE", "RECV_LAST", "RECV_ONLY")

# Who acts, and on what event. SENDER / RECEIVER: the application through sqm.conversations.conversation; SYSTEM: the sweeper
# (lifetimes, postponement) and recovery.
SENDER, RECEIVER, SYSTEM = "sender", "receiver", "system"
OPERATOR = "operator"  # ETBCMD SET-UOW-STATUS (sqm.conversations.operator_status)


class TransitionError(ValueError):
    """A transition the state table does not allow from the UOW's status."""


# The state table (EntireX's "ACI Function SYNCPOINT used for Units of Work", and the normal-status diagram; docs/uow.md):
# (who, event, from status) -> to status. Every transition the product makes goes through transition(); a pair
# not here is refused with an error naming the event and the status.
TABLE: dict[tuple[str, str, str], str] = {
    (SENDER, "COMMIT", RECEIVED): ACCEPTED,
    (SENDER, "EOC", RECEIVED): ACCEPTED,
    (SENDER, "EOCCANCEL", RECEIVED): ACCEPTED,
    (SENDER, "BACKOUT", RECEIVED): BACKEDOUT,
    (SENDER, "CANCEL", ACCEPTED): CANCELLED,
    (SENDER, "CANCEL", POSTPONED): CANCELLED,
    (RECEIVER, "RECEIVE", ACCEPTED): DELIVERED,
    (RECEIVER, "COMMIT", DELIVERED): PROCESSED,
    (RECEIVER, "BACKOUT", DELIVERED): ACCEPTED,
    (RECEIVER, "CANCEL", DELIVERED): CANCELLED,
    (RECEIVER, "POSTPONE", DELIVERED): POSTPONED,  # a receiver's CANCEL while postponement attempts remain
    (SYSTEM, "TIMEOUT", ACCEPTED): TIMEOUT,
    (SYSTEM, "RESUME", POSTPONED): ACCEPTED,  # POSTPONE-DELAY has passed
    # The operator's SET-UOW-STATUS: only UOWs no session holds, and not final ones (no UOW is left to change).
    (OPERATOR, "SET-UOW-STATUS ACCEPTED", POSTPONED): ACCEPTED,  # its postponement ends early
    (OPERATOR, "SET-UOW-STATUS CANCELLED", ACCEPTED): CANCELLED,
    (OPERATOR, "SET-UOW-STATUS CANCELLED", POSTPONED): CANCELLED,
}
# SETUSTATUS keeps the status, and is allowed in these (EntireX: "The UOW must be in RECEIVED, ACCEPTED, or
# DELIVERED status").
USER_STATUS_ALLOWED = (RECEIVED, ACCEPTED, DELIVERED)
USER_STATUS_MAX = 64  # bytes (EntireX: 32 or more)


def transition(who: str, event: str, status: str) -> str:
    """The status after ``event`` by ``who`` from ``status``, or TransitionError naming both."""
    to = TABLE.get((who, event, status))
    if to is None:
        allowed = sorted(s for (w, e, s) in TABLE if w == who and e == event)
        raise TransitionError(f"{who} {event} is not allowed in status {status}"
                              + (f" (only in {', '.join(allowed)})" if allowed else ""))
    return to


@dataclass
class Control(PackedBody):
    """A UOW's control record: what EntireX lists under "Which Information is saved with the UOW?" (docs/uow.md)."""
    uow: str  # hex
    service: str
    status: str
    sender: str = ""  # user id
    token: str = ""
    persistent: bool = True  # the UOW's messages (STORE)
    status_mult: int = 0  # UWSTATP: 0 = no persistent status, 1-254 = kept that many lifetimes after it ends
    lifetime_ms: int = 0
    created_pc: int = 0  # pseudo-clock at creation: the lifetime counts from here
    changed_pc: int = 0  # pseudo-clock at the last change (a restored structure raises its clock to the newest)
    final_pc: int = 0  # pseudo-clock when it reached a final status: the status lifetime counts from here
    messages: int = 0
    length: int = 0  # total bytes of its messages
    user_status: bytes = b""
    deliveries: int = 0  # attempted delivery count (a receiver's BACKOUT raises it)
    postponements: int = 0
    until_pc: int = 0  # POSTPONED: the pseudo-clock at which it is ACCEPTED again
    home: str = ""  # the member incarnation (member.epoch) it was sent through: a non-persistent UOW lives as long
    # as that incarnation
    owner: str = ""  # RECEIVED: the sender's, DELIVERED: the receiver's queue-manager UOW id (member.epoch.seq)
    receiver: str = ""
    receiver_token: str = ""
    conversation: str = ""
    eoc: str = ""  # "", "EOC" or "EOCCANCEL": how the sender ended the conversation with this UOW
    committed_ms: int = 0  # wall clock of the sender's commit (COMMITTIME)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def persistent_status(self) -> bool:
        return self.status_mult > 0

    @property
    def entry_persistent(self) -> bool:
        """The control entry is logged and backed up when the messages or the status must outlive a CF loss."""
        return self.persistent or self.persistent_status

    @property
    def owner_member(self) -> str:
        return self.owner.split(".", 1)[0] if self.owner else ""

    def outlived(self, epochs: Mapping[str, int]) -> tuple[bool, bool]:
        """Whether a member incarnation that is gone (its member's epoch in ``epochs`` is another now: it restarted,
        or a peer fenced it; or the member is not there at all) held this UOW in a unit of work (its owner), and
        whether one was its home."""
        def gone(incarnation: str) -> bool:
            parts = incarnation.split(".")
            return len(parts) >= 2 and int(parts[1], 16) != epochs.get(parts[0], 0)
        return gone(self.owner), gone(self.home)

    def public(self) -> dict[str, Any]:
        """What QUERY and LAST return (no owner internals)."""
        return {"uow": self.uow, "service": self.service, "status": self.status, "user_status":
                self.user_status.decode("utf-8", "backslashreplace"), "persistent": self.persistent,
                "persistent_status": self.persistent_status, "status_lifetime": self.status_mult,
                "messages": self.messages, "bytes": self.length, "deliveries": self.deliveries,
                "postponements": self.postponements, "sender": self.sender, "receiver": self.receiver,
                "conversation": self.conversation, "eoc": self.eoc, "lifetime_ms": self.lifetime_ms,
                "age_ms": max(0, self.changed_pc - self.created_pc), "committed_ms": self.committed_ms}


def status_letter_hex(status: str) -> str:
    return LETTER[status].encode().hex()


def after_restart(c: Control) -> Control | None:
    """Seed 003's restart Tables 1 and 2 as one rule: what a UOW's status becomes when the process that held it
    is gone (its member restarted or was recovered by a peer, or the CF was lost and the structure restored).
    None: no trace of it remains. A persistent UOW comes back ACCEPTED from ACCEPTED, DELIVERED (its delivery
    counted) and POSTPONED, and is lost from RECEIVED (its sender never committed); a non-persistent UOW is not
    restored. Its status stays only where it is persistent: BACKEDOUT from RECEIVED, DISCARDED where a
    non-persistent UOW's data was discarded, final statuses as they were (Table 2)."""
    if c.status in FINAL:
        return c if c.persistent_status else None
    if c.status == RECEIVED:
        if not c.persistent_status:
            return None
        return _final(c, BACKEDOUT if c.persistent else DISCARDED)
    if c.persistent:
        return replace(c, status=ACCEPTED, owner="", until_pc=0,
                       deliveries=c.deliveries + (1 if c.status == DELIVERED else 0))
    return _final(c, DISCARDED) if c.persistent_status else None


def after_backout(c: Control, pc: int) -> Control | None:
    """A UOW whose holder backed out while its member lives (the scope's commit was refused, or its client left):
    a sent one is BACKEDOUT, a received one ACCEPTED again with its delivery counted (its messages are still on the
    CF, persistent or not)."""
    if c.status == RECEIVED:
        return finish(c, transition(SENDER, "BACKOUT", c.status), pc)
    if c.status == DELIVERED:
        return replace(c, status=transition(RECEIVER, "BACKOUT", c.status), owner="", deliveries=c.deliveries + 1,
                       changed_pc=pc)
    return c


def _final(c: Control, status: str) -> Control:
    return replace(c, status=status, owner="", until_pc=0, final_pc=c.changed_pc)


def finish(c: Control, status: str, pc: int) -> Control | None:
    """``c`` at ``status`` from pseudo-clock ``pc``: a final status is kept only when the status is persistent."""
    if status in FINAL:
        return replace(c, status=status, owner="", until_pc=0, changed_pc=pc, final_pc=pc) \
            if c.persistent_status else None
    return replace(c, status=status, changed_pc=pc)


_STATUS_CIDS = frozenset(status_letter_hex(s) for s in STATUSES)


def is_control_queue(queue: str) -> bool:
    return queue.endswith(CONTROL_SUFFIX)


def restore_control_entry(entry: Mapping[str, Any], data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """The restore fold's step for a control entry that survived the CF's loss (restore.settle): after_restart on
    its record, the entry's correlation id following the status. None: the status is not kept. A conversation's
    record follows the restart rule of conversations (sqm.conversations.convrecord.after_restart); an entry that is
    neither (a user's LAST pointer, on the same queue) is restored as it is."""
    if str(entry.get("cid", "")) == RECORD_CID_HEX:  # a conversation's record: its binding as a restart leaves it
        try:
            return dict(entry), conversation_after_restart(ConvRecord.unpack(data)).pack()
        except Exception:  # noqa: BLE001 - not a record (put there by other means): restored as it was
            return dict(entry), data
    if str(entry.get("cid", "")) not in _STATUS_CIDS:
        return dict(entry), data
    try:
        c = after_restart(Control.unpack(data))
    except Exception:  # noqa: BLE001 - not a control (put there by other means): restored as it was
        return dict(entry), data
    if c is None:
        return None
    return {**entry, "cid": status_letter_hex(c.status)}, c.pack()


__all__ = ["Control", "TransitionError", "transition", "after_restart", "after_backout", "finish", "restore_control_entry",
           "is_control_queue", "status_letter_hex", "STATUSES", "ACTIVE", "FINAL", "TABLE", "OPERATOR"]
