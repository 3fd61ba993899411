"""How publish/subscribe plugs into a queue manager (sqm.core.hooks): its sweeper (publications every subscription
has passed or past their lifetime, idle subscriptions, non-durable ones of gone member incarnations) runs from
housekeeping every QueueManagerConfig.uow_sweep_interval_ms (0: never), after the conversations' when both are
installed (docs/pubsub.md)."""

from __future__ import annotations

from sqm.core.member import Member
from sqm.pubsub.pubsub_sweeper import PubSubSweeper

SWEEPER = "pubsub.sweeper"  # its key in the queue manager's hooks.state


def install(qm: Member) -> None:
    qm.hooks.add_sweeper(SWEEPER, PubSubSweeper(qm), qm.config.uow_sweep_interval_ms)


def sweeper(qm: Member) -> PubSubSweeper | None:
    """The queue manager's publish/subscribe sweeper, when the wing is installed."""
    return qm.hooks.kept(SWEEPER, PubSubSweeper)


__all__ = ["SWEEPER", "install", "sweeper"]
