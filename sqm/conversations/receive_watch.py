"""What one waiting RECEIVE keeps between its looks at a service's ACCEPTED units of work (docs/uow.md, "A waiting
receive"): whether anything on the service's control queue changed since its last look found nothing to take.

A look reads the ACCEPTED controls and the records of their conversations (sqm.conversations.bindings.take_next): its
cost to the CF grows with the UOWs the receiver may not take, such as those of conversations bound to another
receiver that has left, which wait for it until their lifetime ends. A receive polls while it waits; each poll reads
the control queue's mark first (queue_mark.lua: one cheap CF call, whatever the queue holds) and looks again only
when the mark changed. Every change that can make a UOW receivable (a UOW made ACCEPTED, a conversation's record
replaced or given back) commits or backs out an entry of that queue, which changes the mark, but for one the mark
cannot show: an entry committed inside a list (a commit applied after a later-logged one) in the place of one taken
inside it, both within one poll. Such a change is found by a look on a timer, RECHECK_S after the last: a receive
takes that UOW within about RECHECK_S, and a look at UOWs it cannot take is made about once every RECHECK_S, not at
every poll."""

from __future__ import annotations

import time

from sqm.conversations import uowcontrols as ctl
from sqm.core.member import Member

RECHECK_S = 1.0  # at most this long between two looks, whatever the mark says


class ReceiveWatch:
    """One receive's watch over the service it waits on (made at the receive's start, kept for its whole wait; a
    watch handed another service or CONVID starts over)."""

    def __init__(self) -> None:
        self._start(None)

    def _start(self, what: tuple[str, str] | None) -> None:
        self._what = what  # (service, CONVID) it watches
        self._mark: str | None = None  # the control queue's mark when the last look, which found nothing, began
        self._read: str | None = None  # the mark read before the look now being made
        self._due = 0.0  # monotonic time of the next look, whatever the mark
        self.looked = False  # a look found nothing already

    def worth_a_look(self, qm: Member, svc: ctl.Service, convid: str) -> bool:
        """Whether a look may find something the last one did not: the mark changed, or the timer ran out. One CF
        call (the mark)."""
        if self._what != (svc.name, convid):
            self._start((svc.name, convid))  # another service or CONVID: nothing known of it
        self._read = qm.cf_call(lambda: qm.structure(svc.structure).queue_mark(svc.control))
        return self._read != self._mark or time.monotonic() >= self._due

    def found_nothing(self) -> None:
        """The look found nothing to take: the next waits for the mark to change, or for the timer."""
        self._mark = self._read
        self._due = time.monotonic() + RECHECK_S
        self.looked = True


__all__ = ["RECHECK_S", "ReceiveWatch"]
