"""A service's unit-of-work attributes (EntireX's STORE, MAX-UOWS, MAX-MESSAGES-IN-UOW, UOW-DATA-LIFETIME, UWSTATP,
POSTPONE-ATTEMPTS, POSTPONE-DELAY: EntireX's "Attributes used for Units of Work"; docs/architecture.md, "Glossary:
the seed documents"), held on the service queue's definition (QueueDef.uow) so that they are shared by every member
and survive a CF loss with the group repository.

A queue with attributes is a *service*: senders send units of work (UOWs) of several messages to it, receivers
receive each UOW whole and settle it (sqm.conversations.conversation). Its UOW messages and UOW statuses live on two companion
queues of the same structure, defined with it: ``<SERVICE>.UOWDATA`` and ``<SERVICE>.UOWCTL`` (docs/uow.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cfemu.attributes import check_ranges, known_fields

# UWSTATP: 0 = the service's default, 1-254 = keep the status that many UOW lifetimes, 255 = no persistent status.
UWSTATP_DEFAULT, UWSTATP_NONE = 0, 255
MAX_LIFETIME_S = 366 * 86400
MAX_MESSAGES = 100_000
DATA_SUFFIX, CONTROL_SUFFIX = ".UOWDATA", ".UOWCTL"


@dataclass(frozen=True)
class UowAttributes:
    store: bool = True  # STORE: a UOW's messages are persistent unless the sender says otherwise
    max_uows: int = 1000  # MAX-UOWS: active UOWs of the service at once; 0 = the service takes no UOWs
    max_messages: int = 16  # MAX-MESSAGES-IN-UOW
    lifetime_s: int = 86400  # UOW-DATA-LIFETIME, counted on the structure's pseudo-clock (up-time only)
    status_lifetime: int = 0  # UWSTATP multiplier (1-254); 0: no persistent status by default
    postpone_attempts: int = 0  # POSTPONE-ATTEMPTS: a receiver's CANCEL postpones instead, this many times
    postpone_delay_s: int = 0  # POSTPONE-DELAY: how long a postponed UOW waits before it is ACCEPTED again

    def __post_init__(self) -> None:
        check_ranges(self, "UOW", (("max_uows", 0, 10_000_000), ("max_messages", 1, MAX_MESSAGES),
                                   ("lifetime_s", 1, MAX_LIFETIME_S), ("status_lifetime", 0, 254),
                                   ("postpone_attempts", 0, 1000), ("postpone_delay_s", 0, MAX_LIFETIME_S)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UowAttributes:
        known = known_fields(cls, d, "UOW")
        if "store" in known:
            known["store"] = bool(known["store"])
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def data_queue(service: str) -> str:
    return service + DATA_SUFFIX


def control_queue(service: str) -> str:
    return service + CONTROL_SUFFIX


__all__ = ["UowAttributes", "data_queue", "control_queue", "UWSTATP_DEFAULT", "UWSTATP_NONE", "DATA_SUFFIX",
           "CONTROL_SUFFIX"]
