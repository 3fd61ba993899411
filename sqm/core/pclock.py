"""What the features share of the group's time and membership: a structure's pseudo-clock (cfemu/scripts/pclock.lua),
on which lifetimes count (it runs only while the structure is ACTIVE and some member ticks it), the CF's own time,
and every member's current epoch (a member incarnation that is gone has an older one)."""

from __future__ import annotations

from cfemu import keys
from sqm.core.member import Member

# Pseudo-clock ticks farther apart than this are downtime (pclock.lua). Members tick every sweep (about a second).
PCLOCK_GAP_MS = 10_000


def pseudo_clock(qm: Member, structure: str, floor: int = 0) -> int:
    return int(qm.cf_call(lambda: qm.structure(structure).pclock(max_gap_ms=PCLOCK_GAP_MS, floor=floor)).value)


def cf_now_ms(qm: Member, structure: str) -> int:
    """The CF's own time (one clock for the group: a member's wall clock may be skewed), ticking the pseudo-clock."""
    return int(qm.cf_call(lambda: qm.structure(structure).pclock(max_gap_ms=PCLOCK_GAP_MS)).cf_ms)


def member_epochs(qm: Member) -> dict[str, int]:
    """Every member's current epoch (the admin structure's), this member's own as it knows it."""
    epochs = {keys.text(m): int(e) for m, e in qm.admin.redis.hgetall(keys.epochs()).items()}
    epochs[qm.name] = qm.caller.epoch
    return epochs


__all__ = ["PCLOCK_GAP_MS", "cf_now_ms", "member_epochs", "pseudo_clock"]
