"""The descriptor of one CF entry (a message), as the CF scripts store it (a msgpack map)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from cfemu.limits import check_properties_length

PropertyValue = str | int | float | bool


@dataclass
class Entry:
    id: str
    queue: str
    priority: int = 0
    persistent: bool = True
    msgid: str = ""  # hex
    correlid: str = ""  # hex
    expiry: int = 0  # absolute, ms since the epoch; 0 = never
    put_time: int = 0  # ms since the epoch
    backout_count: int = 0
    properties: dict[str, PropertyValue] = field(default_factory=dict)
    state: str = ""  # UP, CP, UG, EX
    lrsn: int = 0  # LRSN of the entry's last transition (the redo rule compares against it)
    uow: str = ""  # the UOW holding it (UP or UG)
    order: tuple[int, int] = (0, 0)  # (commit lrsn, put lrsn): FIFO order within a priority
    length: int = 0

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "q": self.queue, "p": self.priority, "per": 1 if self.persistent else 0,
                "mid": self.msgid, "cid": self.correlid, "exp": self.expiry, "pt": self.put_time,
                "bc": self.backout_count, "pr": self.properties, "st": self.state, "l": self.lrsn,
                "u": self.uow, "o1": self.order[0], "o2": self.order[1], "len": self.length}

    def pack(self) -> bytes:
        return msgpack.packb(self.wire(), use_bin_type=False)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Entry:
        props = d.get("pr") or {}
        return cls(id=d["id"], queue=d["q"], priority=int(d.get("p", 0)), persistent=bool(d.get("per", 1)),
                   msgid=d.get("mid", ""), correlid=d.get("cid", ""), expiry=int(d.get("exp", 0)),
                   put_time=int(d.get("pt", 0)), backout_count=int(d.get("bc", 0)),
                   properties=dict(props) if isinstance(props, dict) else {}, state=d.get("st", ""),
                   lrsn=int(d.get("l", 0)), uow=d.get("u", ""),
                   order=(int(d.get("o1", 0)), int(d.get("o2", 0))), length=int(d.get("len", 0)))

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls.from_wire(msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape"))

    def expired(self, now_ms: int) -> bool:
        return 0 < self.expiry <= now_ms


def check_properties(props: dict[str, Any]) -> dict[str, PropertyValue]:
    """User properties: non-empty str names, str/int/float/bool values (the CF's Lua msgpack keeps only those
    intact, integers within +-2^53), floats finite (NaN and infinity have no JSON form: the REST API could not
    return the message, nor any list holding it), at most cfemu.limits.MAX_PROPERTIES_LENGTH bytes packed (so that
    every descriptor fits its allowance). No properties (most messages have none) pack to one byte: nothing to check."""
    if not props:
        return {}
    for k, v in props.items():
        if not isinstance(k, str) or not k or not isinstance(v, str | int | float | bool):
            raise ValueError(f"message property {str(k)[:40]!r}: a non-empty name, and a value of str, int, "
                             "float or bool")
        if isinstance(v, int) and not isinstance(v, bool) and not -2**53 <= v <= 2**53:
            raise ValueError(f"message property {k[:40]!r}: integer out of range (Lua keeps +-2^53 exactly)")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"message property {k[:40]!r}: a float must be finite, not {v}")
    check_properties_length(props)
    return dict(props)
