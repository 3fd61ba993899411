"""A service's unit-of-work attributes (EntireX's STORE, MAX-UOWS, MAX-MESSAGES-IN-UOW, UOW-DATA-LIFETIME, UWSTATP,
POSTPONE-ATTEMPTS, POSTPONE-DELAY, CONV-NONACT: EntireX's "Attributes used for Units of Work"; docs/architecture.md, "Glossary:
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
    # store, max_uows and status_lifetime: a service that does not give them takes the group's (UowDefaults)
    store: bool = True  # STORE: a UOW's messages are persistent unless the sender says otherwise
    max_uows: int = 1000  # MAX-UOWS: active UOWs of the service at once; 0 = the service takes no UOWs
    max_messages: int = 16  # MAX-MESSAGES-IN-UOW
    lifetime_s: int = 86400  # UOW-DATA-LIFETIME, counted on the structure's pseudo-clock (up-time only)
    status_lifetime: int = 0  # UWSTATP multiplier (1-254); 0: no persistent status by default
    postpone_attempts: int = 0  # POSTPONE-ATTEMPTS: a receiver's CANCEL postpones instead, this many times
    postpone_delay_s: int = 0  # POSTPONE-DELAY: how long a postponed UOW waits before it is ACCEPTED again
    conv_nonact_s: int = 300  # CONV-NONACT: a conversation with no active UOW ends after this much idle up-time

    def __post_init__(self) -> None:
        check_ranges(self, "UOW", (("max_uows", 0, 10_000_000), ("max_messages", 1, MAX_MESSAGES),
                                   ("lifetime_s", 1, MAX_LIFETIME_S), ("status_lifetime", 0, 254),
                                   ("postpone_attempts", 0, 1000), ("postpone_delay_s", 0, MAX_LIFETIME_S),
                                   ("conv_nonact_s", 1, MAX_LIFETIME_S)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UowAttributes:
        known = known_fields(cls, d, "UOW")
        if "store" in known:
            known["store"] = bool(known["store"])
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The attributes the group sets a default for (EntireX's Broker section of the attribute file: STORE, MAX-UOWS,
# UWSTATP): a service that does not give one takes the group's. The precedence is the request's, then the
# service's, then the group's (a request's STORE=NO and UWSTATP=255 override both): docs/uow.md, "Defaults".
GROUP_FIELDS = ("store", "max_uows", "status_lifetime")


@dataclass(frozen=True)
class UowDefaults:
    """The group's defaults for its services (``cfemu define uow-defaults``), held in the CF (Admin.uow_defaults) and,
    durably, in the group repository; the built-in ones until an operator sets them."""
    store: bool = True
    max_uows: int = 1000
    status_lifetime: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.store, bool):
            raise ValueError(f"UOW default store must be true or false, not {self.store!r}")
        check_ranges(self, "UOW default", (("max_uows", 0, 10_000_000), ("status_lifetime", 0, 254)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UowDefaults:
        return cls(**known_fields(cls, d, "UOW default"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def service_attributes(given: Mapping[str, Any], group: UowDefaults) -> UowAttributes:
    """A service's attributes as they apply: the ones its definition gives, the group's defaults for the rest of
    GROUP_FIELDS, the built-in ones for the others."""
    return UowAttributes.from_dict({**group.to_dict(), **given})


def stored_attributes(given: Mapping[str, Any]) -> dict[str, Any]:
    """What a service's definition keeps of ``given`` (checked whole): every attribute but the GROUP_FIELDS it does
    not give, which stay the group's (a service defined before group defaults existed keeps all it stored)."""
    full = UowAttributes.from_dict(given).to_dict()
    return {k: v for k, v in full.items() if k not in GROUP_FIELDS or k in given}


def data_queue(service: str) -> str:
    return service + DATA_SUFFIX


def control_queue(service: str) -> str:
    return service + CONTROL_SUFFIX


__all__ = ["GROUP_FIELDS", "UowAttributes", "UowDefaults", "data_queue", "control_queue", "service_attributes",
           "stored_attributes", "UWSTATP_DEFAULT", "UWSTATP_NONE", "DATA_SUFFIX",
           "CONTROL_SUFFIX"]
