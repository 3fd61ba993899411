"""How publish/subscribe plugs into a queue manager (sqm.core.hooks): its sweeper (publications every subscription
has passed or past their lifetime, idle subscriptions, non-durable ones of gone member incarnations) runs from
housekeeping every QueueManagerConfig.uow_sweep_interval_ms (0: never), after the conversations' when both are
installed (docs/pubsub.md)."""

from __future__ import annotations

from sqm.core.member import Member
from sqm.pubsub.pubsub_sweeper import PubSubSweeper

SWEEPER = "pubsub.sweeper"  # its key in the queue manager's hooks.state


def install(qm: Member) -> None:
    sweeper = PubSubSweeper(qm)
    qm.hooks.state[SWEEPER] = sweeper
    if qm.config.uow_sweep_interval_ms:
        qm.hooks.every(qm.config.uow_sweep_interval_ms / 1000, sweeper.sweep)


def sweeper(qm: Member) -> PubSubSweeper | None:
    """The queue manager's publish/subscribe sweeper, when the wing is installed."""
    found = qm.hooks.state.get(SWEEPER)
    return found if isinstance(found, PubSubSweeper) else None


__all__ = ["SWEEPER", "install", "sweeper"]
