"""How the conversations plug into a queue manager (sqm.core.hooks): the sweeper of UOW lifetimes, postponement and
orphans runs from housekeeping every QueueManagerConfig.uow_sweep_interval_ms (0: never), and when a member was
recovered (its own restart, or a peer's recovery of it) the units of work its gone incarnation held are settled by
the restart tables (docs/uow.md)."""

from __future__ import annotations

from sqm.conversations.uowsweeper import Sweeper, settle_member_best_effort
from sqm.core.member import Member

SWEEPER = "conversations.sweeper"  # its key in the queue manager's hooks.state


def install(qm: Member) -> None:
    qm.hooks.add_sweeper(SWEEPER, Sweeper(qm), qm.config.uow_sweep_interval_ms)

    def settle(member: str) -> str:
        settled = settle_member_best_effort(qm)
        return f"units of work settled by the restart tables: {dict(settled)}" if settled else ""

    qm.hooks.on_member_recovered(settle)


def sweeper(qm: Member) -> Sweeper | None:
    """The queue manager's UOW sweeper (its counts, for one), when the wing is installed."""
    return qm.hooks.kept(SWEEPER, Sweeper)


__all__ = ["SWEEPER", "install", "sweeper"]
