"""What a queue's attribute sets share (a service's UOW attributes, a topic's: cfemu.uow_attributes,
cfemu.topic_attributes): integer fields checked against their ranges, and a definition read from a stored map that
names no field the set does not have. One place, so that both refuse bad input with the same one-line errors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any, TypeVar

T = TypeVar("T")


def check_ranges(obj: object, kind: str, ranges: Iterable[tuple[str, int, int]]) -> None:
    """Each named field of ``obj`` an integer (not a bool) within its range, or a ValueError naming it."""
    for name, low, high in ranges:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{kind} attribute {name} must be an integer {low}-{high}, not {value!r}")


def known_fields(cls: type[T], d: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The fields of ``d`` that ``cls`` (a dataclass whose fields all have defaults) has; any other is refused."""
    known = {k: d[k] for k in asdict(cls()) if k in d}  # type: ignore[call-overload]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"unknown {kind} attribute(s): {', '.join(unknown)}")
    return known
