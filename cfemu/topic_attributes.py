"""A topic's attributes (EntireX's durable publish and subscribe: whether publications are persistent, how long a
publication lives, whether subscriptions may be durable, SUBSCRIPTION-EXPIRATION; docs/architecture.md, "Glossary:
the seed documents"), held on the topic queue's definition (QueueDef.topic) so that they are shared by every member
and survive a CF loss with the group repository.

A queue with topic attributes is a *topic*: publishers publish publications (one or more messages committed as one
unit of work) to it, subscribers receive each publication committed after they subscribed, in commit order
(sqm.pubsub.pubsub). Its state lives on two companion queues of the same structure, defined with it:
``<TOPIC>.PUB`` (each publication's messages, one copy whatever the number of subscribers) and ``<TOPIC>.SUB``
(one entry per subscription: its name, durability and position) (docs/pubsub.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cfemu.attributes import check_ranges, known_fields

MAX_LIFETIME_S = 366 * 86400
MAX_MESSAGES = 10_000
PUB_SUFFIX, SUB_SUFFIX = ".PUB", ".SUB"


@dataclass(frozen=True)
class TopicAttributes:
    persistent: bool = True  # publications are persistent (logged, backed up, restored after a CF loss)
    lifetime_s: int = 86400  # a publication's lifetime, on the structure's pseudo-clock (up-time only)
    durable: bool = True  # subscriptions may be durable (EntireX: the topic's DURABLE characteristic)
    subscription_expiration_s: int = 7 * 86400  # SUBSCRIPTION-EXPIRATION: an idle subscription goes after this
    max_messages: int = 100  # messages in one publication

    def __post_init__(self) -> None:
        check_ranges(self, "topic", (("lifetime_s", 1, MAX_LIFETIME_S),
                                     ("subscription_expiration_s", 1, MAX_LIFETIME_S), ("max_messages", 1, MAX_MESSAGES)))
        for name in ("persistent", "durable"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"topic attribute {name} must be true or false, not {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TopicAttributes:
        return cls(**known_fields(cls, d, "topic"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def publication_queue(topic: str) -> str:
    return topic + PUB_SUFFIX


def subscription_queue(topic: str) -> str:
    return topic + SUB_SUFFIX


def companion_queues(topic: str) -> tuple[str, str]:
    return publication_queue(topic), subscription_queue(topic)


__all__ = ["TopicAttributes", "publication_queue", "subscription_queue", "companion_queues", "PUB_SUFFIX",
           "SUB_SUFFIX"]
