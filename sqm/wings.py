"""The wings a queue manager runs with when it serves applications: the EntireX conversations, then publish and
subscribe (their sweepers run in that order). Passed where a member is composed: QueueManager(config,
wings=WINGS) (the service, the in-process member of the cfemu command, the chaos runs' in-process member)."""

from __future__ import annotations

from sqm.conversations import wing as conversations
from sqm.core.manager import Wing
from sqm.pubsub import wing as pubsub

WINGS: tuple[Wing, ...] = (conversations.install, pubsub.install)

__all__ = ["WINGS"]
