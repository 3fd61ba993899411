"""An entry body that is a dataclass, stored in msgpack (a conversation's record, a UOW's control entry, a
subscription): one way to pack it and to read it back."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Self

import msgpack


class PackedBody:
    """Mixed into a dataclass: ``pack()`` its fields into msgpack, and ``unpack()`` them again. A field the
    body does not hold (written before the field existed) keeps its default, and one the class does not know is
    ignored."""

    def pack(self) -> bytes:
        body: bytes = msgpack.packb(asdict(self), use_bin_type=True)  # type: ignore[call-overload]
        return body

    @classmethod
    def unpack(cls, raw: bytes) -> Self:
        d: dict[str, Any] = msgpack.unpackb(raw, raw=False)
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})  # type: ignore[arg-type]


__all__ = ["PackedBody"]
