"""The group's size limits, named once: every layer that carries a message (the queue definition, the CF, the
record log, the backup files, the SQM service's frames) is held to them, so that a message a queue accepts can
travel every path a message takes (docs/architecture.md, "Size limits").

A message is its body plus a descriptor (ids, properties and fixed fields). The body is bounded per queue
(``QueueDef.max_msg_length``, at most ``MAX_MSG_LENGTH``); the descriptor by ``MAX_ID_LENGTH`` and
``MAX_PROPERTIES_LENGTH``, so that ``DESCRIPTOR_ALLOWANCE`` covers any descriptor and a carrier sized
``MAX_MSG_LENGTH + DESCRIPTOR_ALLOWANCE`` carries any message.
"""

from __future__ import annotations

from typing import Any

import msgpack

# The longest body any queue of the group may be defined to hold: IBM MQ's upper bound for MAXMSGL (100 MB).
MAX_MSG_LENGTH = 100 * 2**20
# A queue's max_msg_length when the definition does not give one.
DEFAULT_MSG_LENGTH = 4 * 2**20
# Message id and correlation id: at most MQ's MQBYTE24.
MAX_ID_LENGTH = 24
# User properties, as msgpack (the form the descriptor stores them in).
MAX_PROPERTIES_LENGTH = 64 * 2**10
# Room for any descriptor beside its body: the properties, the ids (hex in the descriptor), the queue name, the
# entry id and UOW id, the fixed fields and their names. Far more than they can take; a round number.
DESCRIPTOR_ALLOWANCE = 128 * 2**10

# The most units of work one CF call does, for the operations whose input has no bound of its own (a commit or a
# backout of a UOW of any size, an expiry sweep, a get's walk over the expired messages at the head of a queue, a
# relog batch): a unit is one entry, or 1024 list elements a list command may scan for one (docs/cf-layout.md,
# "Outcomes in bounded steps"). The CF is one Redis server that runs one script at a time, so every other client
# (a member's lease renewal included) waits for the call that runs:
# 256 entries take 1-2 ms of an idle server, 3-6 ms of a 2-core machine loaded four times over (BENCHMARKS.md,
# "Bounded CF calls"), while the round trips of a large UOW's calls (two per 256 entries: one to list them, one to
# apply them) add little to its time. The Structure methods call again until the operation is done.
CF_STEP = 256
# The most message data one write batch of a restore's load carries (bytes): a batch of large messages is cut
# below CF_STEP entries, so that copying its data into the CF is bounded too.
CF_STEP_BYTES = 8 * 2**20


#: The largest count or size a definition may hold (a structure's capacity, a queue's backout threshold): what the
#: CF's scripts hold exactly (Lua numbers are doubles) and what a definition's msgpack form can carry.
MAX_DEFINED = 2**53 - 1


def check_defined(what: str, n: int) -> int:
    """A definition's count or size, from 0 (none, or unlimited) to MAX_DEFINED; ValueError, one line, otherwise."""
    if not 0 <= n <= MAX_DEFINED:
        raise ValueError(f"{what} must be between 0 and {MAX_DEFINED}, not {n}")
    return n


def check_max_msg_length(n: int) -> int:
    """A queue's max message length, or ValueError naming the group's bound."""
    if not 0 < n <= MAX_MSG_LENGTH:
        raise ValueError(f"max message length must be 1-{MAX_MSG_LENGTH} bytes (the group's limit, like MQ's "
                         f"MAXMSGL), not {n}")
    return n


def check_id(kind: str, value: bytes) -> bytes:
    """A message id or correlation id, or ValueError: at most MAX_ID_LENGTH bytes."""
    if len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{kind} must be at most {MAX_ID_LENGTH} bytes, not {len(value)}")
    return value


def check_properties_length(props: dict[str, Any]) -> None:
    """ValueError when the properties, packed as the descriptor stores them, exceed MAX_PROPERTIES_LENGTH."""
    n = len(msgpack.packb(props, use_bin_type=False))
    if n > MAX_PROPERTIES_LENGTH:
        raise ValueError(f"message properties take {n} bytes; at most {MAX_PROPERTIES_LENGTH} are allowed")


__all__ = ["CF_STEP", "CF_STEP_BYTES", "DEFAULT_MSG_LENGTH", "DESCRIPTOR_ALLOWANCE", "MAX_ID_LENGTH", "MAX_MSG_LENGTH",
           "MAX_PROPERTIES_LENGTH",
           "check_id", "check_max_msg_length", "check_properties_length"]
