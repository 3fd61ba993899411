"""The operator changes a unit of work's status (EntireX's ETBCMD SET-UOW-STATUS; seed 003: "This applies also to
operations with ETBCMD to modify the status of UOWs"; docs/uow.md, "The operator's SET-UOW-STATUS").

What an operator may do is rows of the state table (sqm.conversations.uowstatus.TABLE, who = OPERATOR): make a
POSTPONED UOW ACCEPTED before its POSTPONE-DELAY is over, and CANCEL an ACCEPTED or POSTPONED one (its messages to
the service's backout queue, as a receiver's last CANCEL moves them, or removed). A UOW that a session holds
(RECEIVED by its sender, DELIVERED to its receiver) is refused: its holder, or its member's restart, settles it;
a final status is refused: it has no UOW left to change. The change is one replacement of the UOW's control entry in
a queue-manager unit of work, as every status change is: logged, so it survives a restart, a peer's recovery and a CF
loss, and made once when two operators race. Each change is written to the member's log file too (who, from, to).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from cfemu.errors import BadRequestError, UnknownUowError, UowStatusError
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import move_to_backout_queue
from sqm.conversations.uowstatus import (
    ACCEPTED,
    CANCELLED,
    OPERATOR,
    Control,
    TransitionError,
    finish,
    transition,
)
from sqm.core.member import Member

log = logging.getLogger(__name__)

TARGETS = (ACCEPTED, CANCELLED)  # the statuses an operator may set


def set_uow_status(qm: Member, uow: str, status: str, *, by: str) -> dict[str, Any]:
    """SET-UOW-STATUS: the UOW ``uow`` (any service's) to ``status`` (ACCEPTED or CANCELLED), as the state table
    allows; refused with UowStatusError naming the status it is in and the ones allowed. ``by``: who asked, for the
    log. Returns the UOW's status after it (QUERY's fields; ``status`` None when no trace is kept)."""
    if status not in TARGETS:
        raise BadRequestError(f"SET-UOW-STATUS: the status must be {' or '.join(TARGETS)}, not {status!r}")
    found = ctl.find(qm, uow, wait_s=ctl.HELD_WAIT_S)
    if found is None:
        raise UnknownUowError(f"unit of work {uow} is not known (never sent, or its status was not kept)")
    svc, _ = found
    pc = ctl.pseudo_clock(qm, svc.structure)
    event = f"SET-UOW-STATUS {status}"

    def change(old: Control) -> Control | None:
        try:
            to = transition(OPERATOR, event, old.status)
        except TransitionError as e:
            raise UowStatusError(f"unit of work {uow}: {e}") from None
        if to == ACCEPTED:  # its postponement ends now: it queues behind the UOWs already ACCEPTED (seed 003)
            return replace(old, status=to, until_pc=0, changed_pc=pc)
        return finish(old, to, pc)

    conn = qm.connect()
    try:
        old, new = ctl.replace(qm, svc, uow, change, conn=conn)
        moved = status == CANCELLED and move_to_backout_queue(conn, svc, uow)
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    log.warning("%s: SET-UOW-STATUS by %s: unit of work %s of service %s from %s to %s%s", qm.name, by, uow,
                svc.name, old.status, status, f" (its messages moved to {svc.backout_queue})" if moved else "")
    out = new.public() if new is not None else {"uow": uow, "service": svc.name, "status": None}
    return {**out, "was": old.status, "moved_to": svc.backout_queue if moved else ""}


__all__ = ["TARGETS", "set_uow_status"]
