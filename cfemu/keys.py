"""Redis key layout of the CF. One structure = one hash tag {NAME} = one Redis Cluster slot.

The layout is documented in docs/cf-layout.md and in the header of cfemu/scripts/_prelude.lua.
"""

from __future__ import annotations

import re

STATES = ("UP", "CP", "UG", "EX")
PRIORITIES = range(10)
ADMIN = "{ADMIN}"

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,48}$")


def check_name(kind: str, name: str) -> str:
    """Structure, queue and member names: 1-48 of A-Z a-z 0-9 _ . - (they become parts of Redis keys)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad {kind} name {name!r}: use 1-48 characters of A-Z a-z 0-9 _ . -")
    return name


def text(value: bytes | str) -> str:
    """A Redis reply as text (the client is binary-safe: replies are bytes)."""
    return value.decode() if isinstance(value, bytes) else value


_MEMBER = re.compile(r"^[A-Za-z0-9_\-]{1,32}$")


def check_member_name(name: str) -> str:
    """Member names: 1-32 of A-Z a-z 0-9 _ - (no '.': UOW ids are '<member>.<epoch>.<sequence>')."""
    if not isinstance(name, str) or not _MEMBER.match(name):
        raise ValueError(f"bad member name {name!r}: use 1-32 characters of A-Z a-z 0-9 _ -")
    return name


def tag(structure: str) -> str:
    return "{" + structure + "}"


def script_keys(structure: str) -> list[str]:
    """The KEYS every CF script receives, in the order _prelude.lua names them."""
    t = tag(structure)
    return [f"{t}:meta", f"{t}:fence", f"{t}:ent", f"{t}:data", f"{t}:uows", f"{t}:tomb", f"{t}:queues",
            f"{t}:expiry"]


def meta(structure: str) -> str:
    return f"{tag(structure)}:meta"


def queue_list(structure: str, queue: str, suffix: str) -> str:
    """suffix: 'up', 'ug', 'ex' or 'cp:<priority>'."""
    return f"{tag(structure)}:q:{queue}:{suffix}"


def uow_set(structure: str, uow: str) -> str:
    return f"{tag(structure)}:uow:{uow}"


def index_set(structure: str, queue: str, kind: str, value: str) -> str:
    return f"{tag(structure)}:ix:{queue}:{kind}:{value}"


def all_structure_keys_pattern(structure: str) -> str:
    return f"{tag(structure)}:*"
