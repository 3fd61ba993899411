"""What a fault kind is: one ``FaultKind`` row, registered by its family's module right under its function.

A row holds every fact about the kind: the function that injects and heals it, its cost in the schedule, how the
schedule draws its target and parameters from the seed, which runs it belongs to, and its one line of docs (the
same line docs/chaos.md's table holds; tests/qsg/chaos/test_fault_kinds.py compares them). Everything else about
the kinds (``KINDS``, ``FAULTS``, ``COST_S``, the kind lists, the schedule) is derived from the rows in
qsg.chaos.faults.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qsg.chaos.group import ChaosGroup


class FaultError(RuntimeError):
    """A fault could not be injected or healed as planned (the report shows it; the run goes on)."""


@dataclass(frozen=True)
class FaultSpec:
    n: int
    at: float  # seconds after the workload started
    kind: str
    target: str
    hold: float
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.n, "at": self.at, "kind": self.kind, "target": self.target, "hold": self.hold,
                **self.params}


# step(phase, **fields) records a phase of the fault (a history event, with any fields the checker reads);
# returns seconds since inject.
Step = Callable[..., float]
Fault = Callable[["ChaosGroup", FaultSpec, Step], dict[str, Any]]


@dataclass(frozen=True)
class Draw:
    """What a kind's parameter draw may read: the seed's generator (draw in a fixed order: the schedule is a
    contract, tests/qsg/chaos/schedules.json), the fault's target, the group's members and its lease."""

    rnd: random.Random
    target: str
    managers: Sequence[str]
    lease_ms: int


# A kind's parameter draw: (hold seconds, params).
DrawParams = Callable[[Draw], tuple[float, dict[str, Any]]]


def any_member(rnd: random.Random, managers: Sequence[str]) -> str:
    return rnd.choice(managers)


def last_member(rnd: random.Random, managers: Sequence[str]) -> str:
    """The last SQM: the one whose log the group puts on a small disk of its own (ChaosGroup.disk)."""
    return managers[-1]


def no_params(d: Draw) -> tuple[float, dict[str, Any]]:
    return 0.0, {}


# Tags: what a kind needs of the group.
CF_LINK = "cf-link"  # a proxy between an SQM and the CF: impossible against a Redis Cluster CF, whose clients
# follow the cluster's redirections to the nodes themselves
DUPLEX = "duplex"  # a duplexed CF: the runner starts one when a run names the kind; left out of 'all'
TAGS = (CF_LINK, DUPLEX)


@dataclass(frozen=True)
class FaultKind:
    """One fault kind. ``number`` is its place in ``KINDS`` (and so in the order the seeds go through): a kind keeps
    its number for good, as a seed's schedule depends on it; a new kind takes the next. ``short`` and
    ``cluster_short``: its place in the short run (``--faults short``) against one redis-server, and against a
    Redis Cluster CF (``--redis-cluster``), from 1; None: not in it. ``cost_s``: rough seconds from injection to
    full service, which space the schedule. ``serve_s``: seconds its members may take to serve again after its heal
    beyond the group's bound (the checker's ``liveness``: the runner writes each fault's bound into the history)."""

    name: str
    run: Fault
    number: int
    cost_s: float
    doc: str
    draw: DrawParams = no_params
    target: Callable[[random.Random, Sequence[str]], str] = any_member
    tags: frozenset[str] = frozenset()
    short: int | None = None
    cluster_short: int | None = None
    serve_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = self.tags - set(TAGS)
        if unknown:
            raise ValueError(f"fault kind {self.name}: unknown tags {sorted(unknown)}; known: {', '.join(TAGS)}")


_ROWS: dict[str, FaultKind] = {}


def register(kind: FaultKind) -> FaultKind:
    """Add a kind's row (at import of its family's module); a name or number taken twice is an error."""
    if kind.name in _ROWS:
        raise ValueError(f"fault kind {kind.name} registered twice")
    clash = next((k.name for k in _ROWS.values() if k.number == kind.number), None)
    if clash:
        raise ValueError(f"fault kinds {clash} and {kind.name} both have number {kind.number}")
    _ROWS[kind.name] = kind
    return kind


def rows() -> Mapping[str, FaultKind]:
    """Every registered row, by name."""
    return _ROWS


__all__ = ["CF_LINK", "DUPLEX", "TAGS", "Draw", "DrawParams", "Fault", "FaultError", "FaultKind", "FaultSpec",
           "Step", "any_member", "last_member", "no_params", "register", "rows"]
