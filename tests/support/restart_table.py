"""Seed 003, "What happens when Broker restarts?", Restart Table 1, written out as the seed gives it (an oracle
written by hand, not derived from the product's rule): (status before, persistent UOW, persistent status) -> status
after (None: no trace kept, "---"). The pure rule's test and the restart's test check against the same rows."""

from __future__ import annotations

from sqm.conversations.uowstatus import (
    ACCEPTED,
    BACKEDOUT,
    DELIVERED,
    DISCARDED,
    POSTPONED,
    PROCESSED,
    RECEIVED,
)

RESTART_TABLE_1: list[tuple[str, bool, bool, str | None]] = [
    (RECEIVED, True, True, BACKEDOUT), (RECEIVED, True, False, None),
    (RECEIVED, False, True, DISCARDED), (RECEIVED, False, False, None),
    (ACCEPTED, True, True, ACCEPTED), (ACCEPTED, True, False, ACCEPTED),
    (ACCEPTED, False, True, DISCARDED), (ACCEPTED, False, False, None),
    (DELIVERED, True, True, ACCEPTED), (DELIVERED, True, False, ACCEPTED),
    (DELIVERED, False, True, DISCARDED), (DELIVERED, False, False, None),
    (POSTPONED, True, True, ACCEPTED), (POSTPONED, True, False, ACCEPTED),
    (POSTPONED, False, True, DISCARDED), (POSTPONED, False, False, None),
    (PROCESSED, True, True, PROCESSED), (PROCESSED, True, False, None),
    (PROCESSED, False, True, PROCESSED), (PROCESSED, False, False, None),
]
