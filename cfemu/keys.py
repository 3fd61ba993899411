"""Redis key layout of the CF: every key has one builder here, and nothing else spells a key.

One structure = one hash tag {NAME} = one Redis Cluster slot, so every script may touch any of its keys. The
admin structure is the tag {ADMIN}. The layout (types, fields, writers) is documented in docs/cf-layout.md; the
Lua side names the same keys in the header of cfemu/scripts/_prelude.lua (SCRIPT_KEYS below gives the order,
and tests/cfemu/test_scripts.py checks that the two agree).
"""

from __future__ import annotations

import re
from collections.abc import Callable

STATES = ("UP", "CP", "UG", "EX")
PRIORITIES = range(10)
ADMIN = "{ADMIN}"

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,48}$")


def check_name(kind: str, name: str) -> str:
    """Structure, queue and member names: 1-48 of A-Z a-z 0-9 _ . - (they become parts of Redis keys)."""
    # fullmatch: '$' would also match before a trailing newline, letting "Q1\n" through as a key part
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"bad {kind} name {name!r}: use 1-48 characters of A-Z a-z 0-9 _ . -")
    return name


def text(value: bytes | str) -> str:
    """A Redis reply as text (the client is binary-safe: replies are bytes)."""
    return value.decode() if isinstance(value, bytes) else value


_MEMBER = re.compile(r"^[A-Za-z0-9_\-]{1,32}$")


def check_member_name(name: str) -> str:
    """Member names: 1-32 of A-Z a-z 0-9 _ - (no '.': UOW ids are '<member>.<epoch>.<sequence>')."""
    if not isinstance(name, str) or not _MEMBER.fullmatch(name):
        raise ValueError(f"bad member name {name!r}: use 1-32 characters of A-Z a-z 0-9 _ -")
    return name


def tag(structure: str) -> str:
    return "{" + structure + "}"


# --- a structure's fixed keys: the KEYS every CF script receives -------------------------------------------------
def meta(structure: str) -> str:
    """Hash: the structure's header (state, gen, clock, floor, backup, entries, bytes, capacity)."""
    return f"{tag(structure)}:meta"


def fence(structure: str) -> str:
    """Hash: member -> the epoch the structure accepts from it."""
    return f"{tag(structure)}:fence"


def entries(structure: str) -> str:
    """Hash: entry id -> msgpack descriptor."""
    return f"{tag(structure)}:ent"


def data(structure: str) -> str:
    """Hash: entry id -> message data."""
    return f"{tag(structure)}:data"


def uows(structure: str) -> str:
    """Hash: UOW id -> msgpack {o: owner member, f: first LRSN, g: generation} of each UOW holding entries."""
    return f"{tag(structure)}:uows"


def tomb(structure: str) -> str:
    """Hash: UOW id -> 'C' | 'B', an outcome peer recovery or restore decided, for the owner to learn."""
    return f"{tag(structure)}:tomb"


def queues(structure: str) -> str:
    """Set: the names of the queues defined on the structure."""
    return f"{tag(structure)}:queues"


def expiry(structure: str) -> str:
    """Zset: entry id scored by its expiry time (ms)."""
    return f"{tag(structure)}:expiry"


# The order _prelude.lua gives them (KEYS[1] .. KEYS[8]); a new fixed key goes here and in the prelude's header.
SCRIPT_KEYS: tuple[Callable[[str], str], ...] = (meta, fence, entries, data, uows, tomb, queues, expiry)


def script_keys(structure: str) -> list[str]:
    """The KEYS every CF script receives, in the order _prelude.lua names them."""
    return [key(structure) for key in SCRIPT_KEYS]


# --- a structure's derived keys (the scripts build the same names from the tag: qkey, uowkey, ixkey) -------------
def queue_list(structure: str, queue: str, suffix: str) -> str:
    """List of entry ids; suffix: 'up', 'ug', 'ex' or 'cp:<priority>'."""
    return f"{tag(structure)}:q:{queue}:{suffix}"


def state_list(structure: str, queue: str, state: str, priority: int = 0) -> str:
    """The list that holds a queue's entries in `state` (UP, UG, EX; CP has one list per priority)."""
    return queue_list(structure, queue, f"cp:{priority}" if state == "CP" else state.lower())


def uow_set(structure: str, uow: str) -> str:
    """Set: the ids of the entries a UOW holds."""
    return uow_set_prefix(structure) + uow


def uow_set_prefix(structure: str) -> str:
    """What every uow_set(structure, uow) begins with, the UOW after it (cfemu/_bulk.c names them so)."""
    return f"{tag(structure)}:uow:"


def uow_work(structure: str, uow: str, kind: str) -> str:
    """Sorted set: what is left of a UOW's outcome done in steps (commit.lua, backout.lua): its puts (kind 'p')
    scored by put LRSN, its gets ('g') by get LRSN."""
    return f"{tag(structure)}:uow{kind}:{uow}"


def index_set(structure: str, queue: str, kind: str, value: str) -> str:
    """Set: ids of a queue's entries by correlation id (kind 'c') or message id (kind 'm'), value in hex."""
    return index_set_prefix(structure, queue, kind) + value


def index_set_prefix(structure: str, queue: str, kind: str) -> str:
    """What every index_set(structure, queue, kind, value) begins with, the value after it (a bulk load names a
    million index sets: it builds each prefix once)."""
    return f"{tag(structure)}:ix:{queue}:{kind}:"


def pclock(structure: str) -> str:
    """Hash: the structure's pseudo-clock (v = ms of up-time, w = the CF's time of the last tick): pclock.lua."""
    return f"{tag(structure)}:pclock"


def all_structure_keys_pattern(structure: str) -> str:
    """A SCAN pattern for every key of the structure (all of them share the tag)."""
    return f"{tag(structure)}:*"


# --- the admin structure {ADMIN} -----------------------------------------------------------------------------
def group() -> str:
    """String: the queue-sharing group's name."""
    return f"{ADMIN}:group"


def uow_defaults() -> str:
    """String (msgpack): the group's defaults for its services (cfemu.uow_attributes.UowDefaults)."""
    return f"{ADMIN}:uow-defaults"


def structure_defs() -> str:
    """Hash: structure name -> msgpack StructureDef."""
    return f"{ADMIN}:structures"


def queue_defs() -> str:
    """Hash: queue name -> msgpack QueueDef."""
    return f"{ADMIN}:queues"


def members() -> str:
    """Hash: member -> msgpack info of each live member (joined, not yet left or recovered)."""
    return f"{ADMIN}:members"


def epochs() -> str:
    """Hash: member -> its current fencing epoch (kept after the member leaves: epochs only grow)."""
    return f"{ADMIN}:epochs"


def lease(member: str) -> str:
    """String with a TTL: the member's epoch while its lease runs."""
    return f"{ADMIN}:lease:{member}"


def recovery_lock(member: str) -> str:
    """String with a TTL: the peer recovering this failed member."""
    return f"{ADMIN}:recovering:{member}"


def conversation_lock(structure: str, service: str, record: str) -> str:
    """String with a TTL: the unit of work that makes the first record of one conversation of a service (``record``:
    the record's message id, hex), so that two first sends on one conversation id make one record."""
    return f"{ADMIN}:convlock:{structure}:{service}:{record}"


def structure_recovery_lock(structure: str) -> str:
    """String with a TTL: the member recovering this failed structure automatically (RECAUTO), "member@epoch"."""
    return f"{ADMIN}:recauto:{structure}"


def recovery_attempts() -> str:
    """Hash: structure -> "member@epoch" of an automatic recovery under way (no TTL; cleared when it ends)."""
    return f"{ADMIN}:recauto-attempts"


def backups(structure: str) -> str:
    """Hash: backup id -> msgpack catalog entry of the structure's backups (the copy in the CF)."""
    return f"{ADMIN}:backups:{structure}"


def repository() -> str:
    """String: JSON {id, path} of the group repository (cfemu.repository) whose log root is the group's."""
    return f"{ADMIN}:repository"


def duplex() -> str:
    """Hash {mode: DUPLEX | SIMPLEX, gen: N} of a duplexed CF, written by its controller (cfemu.duplex_control):
    members wait for the secondary while DUPLEX; gen grows at every promotion (a stale primary is never used)."""
    return f"{ADMIN}:duplex"
