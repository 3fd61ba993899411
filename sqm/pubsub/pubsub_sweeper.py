"""What happens to publications and subscriptions with no caller, run by every member's housekeeping (with the UOW
sweeper, sqm.conversations.uowsweeper): a publication every subscription has passed is removed, and so is one past its lifetime;
an idle subscription past its topic's SUBSCRIPTION-EXPIRATION is removed, and so is a non-durable one whose home
member incarnation is gone (it lives as long as the member it was made through, like a non-persistent UOW). Every
change is gets inside a queue-manager unit of work, so two members sweeping at once remove a thing once: the second
finds it taken, and leaves it.

Lifetimes count on the structure's pseudo-clock (cfemu/scripts/pclock.lua): nothing times out while the store is
down. A publication is removed only at or below the structure's clock read before the subscriptions are read, so a
subscription made during a sweep (its position is the clock at its subscribe) never loses one it should receive.

The subscriptions are read in bounded batches (peek_scan.lua), however many there are, and a publication is removed
only after a complete read: every subscription's roster entry (never replaced, so a paged read returns each one
there throughout) and its position entry (replaced at each receive's COMMIT, so a paged read may miss one whose
receiver commits meanwhile: that one is read again by its message id). A read that fails part way removes nothing."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from cfemu.errors import MQError, NoMessageError, StructureFailedError
from sqm.core.member import Member
from sqm.core.pclock import member_epochs, pseudo_clock
from sqm.pubsub import pubsub as ps

log = logging.getLogger(__name__)
MAX_PER_SWEEP = 500  # publications looked at per topic and sweep (the next sweep goes on)


class PubSubSweeper:
    def __init__(self, qm: Member, batch: int = ps.SCAN_BATCH) -> None:
        self.qm = qm
        self.batch = batch  # entries per CF call of a subscription read
        self.counts: Counter[str] = Counter()

    def sweep(self) -> Counter[str]:
        done: Counter[str] = Counter()
        for t in list(ps.topics(self.qm)):
            try:
                done += self.sweep_topic(t)
            except StructureFailedError:
                continue  # not ACTIVE: no timeout processing while the store is unavailable
        self.counts += done
        return done

    def sweep_topic(self, t: ps.Topic) -> Counter[str]:
        qm = self.qm
        done: Counter[str] = Counter()
        clock = ps.structure_clock(qm, t)  # before the subscriptions: see the module's docstring
        subs = self.read_subscriptions(t)
        newest = max((s.active_pc for entries in subs.values() for s in entries), default=0)
        pc = pseudo_clock(qm, t.structure, floor=newest)  # a restored structure resumes from what it holds
        epochs = member_epochs(qm)

        def removable(s: ps.Subscription) -> str:
            return ps.ended_by(t, s, epochs, pc)

        positions = []
        for entries in subs.values():
            why = removable(ps.merged(entries))
            if why and _remove_subscription(qm, t, entries[0], removable):
                done[why] += 1
            else:  # every entry counts (two only after raced subscribes): the lowest position is kept for
                positions += [s.position for s in entries]
        floor = min(positions + [(clock, ps.AFTER_ALL)])
        lifetime_ms = t.attributes.lifetime_s * 1000
        position: tuple[int, str] = (0, "")
        for _ in range(MAX_PER_SWEEP):
            nxt = ps.next_publication_head(qm, t, position)  # never its data: see next_publication_head
            if nxt.state != "P" or nxt.first is None:
                break
            position = (nxt.lrsn, nxt.pub)
            created = int(nxt.first.properties.get("pub.created", 0))
            if position <= floor:
                why = "publications-received"
            elif created + lifetime_ms <= pc:
                why = "publications-expired"
            else:
                break  # in commit order: those after it are newer (their lifetimes, near enough, too)
            done[why] += _remove_publication(qm, t, nxt.pub, nxt.messages)
        return done

    def read_subscriptions(self, t: ps.Topic) -> dict[str, list[ps.Subscription]]:
        """Every subscription's entries, by message id (hex): a complete read in bounded batches (the module's
        docstring). An MQError part way propagates: nothing is removed on a partial read."""
        qm = self.qm
        names = ps.roster(qm, t, self.batch)  # first: one made after it is read is above the clock read before
        subs: dict[str, list[ps.Subscription]] = {}
        for entry, data in ps.scan_entries(qm, t, ps.SUB_LETTER, self.batch):
            subs.setdefault(entry.msgid, []).append(ps.Subscription.unpack(data))
        for sid in names - subs.keys():  # replaced by a receive's COMMIT while they were read: read it now
            found = ps.peek_entries(qm, t, bytes.fromhex(sid))
            if found:  # none: unsubscribed or removed meanwhile
                subs[sid] = [ps.Subscription.unpack(data) for _, data in found]
        return subs


def _remove_subscription(qm: Member, t: ps.Topic, seen: ps.Subscription,
                         removable: Callable[[ps.Subscription], str]) -> bool:
    """Remove it (its entries and its roster entry) if it is still removable as taken and no session holds it."""
    conn = qm.connect()
    try:
        s = ps.take_subscription(conn, t, seen.name, user=seen.user, token=seen.token)
        if not removable(s):
            conn.backout()
            return False
        ps.take_roster(conn, t, s.sid)
        conn.commit()
        return True
    except MQError:
        conn.backout()
        return False


def _remove_publication(qm: Member, t: ps.Topic, pub: str, count: int) -> int:
    """Remove the publication whole, or leave it: when another member's sweep holds some of its messages, this one
    gives back what it took. Had it committed its part, and the other sweep's member died before its commit, the
    other part would come back alone: a publication with fewer messages than its count, which no look (topic_head)
    and no receive sees again, kept for good."""
    conn = qm.connect()
    try:
        for _ in range(count):
            try:
                conn.get(t.pub_queue, syncpoint=True, correlid=bytes.fromhex(pub), counted=False)
            except NoMessageError:  # another member's sweep holds the rest: it removes it, or a later sweep does
                conn.backout()
                return 0
        conn.commit()
        return 1
    except BaseException:
        conn.backout()
        raise


__all__ = ["PubSubSweeper", "MAX_PER_SWEEP"]
