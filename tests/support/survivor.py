"""An entry to load as the tests of cfemu.bulk give one (cfemu.bulk.Survivor's shape, as restore.settle.Settled
has it): its id, its final descriptor in wire form (None: not loaded) and its data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Survivor:
    id: str
    entry: dict[str, Any] | None
    data: bytes
