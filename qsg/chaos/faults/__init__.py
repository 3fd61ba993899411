"""Fault kinds, each a real mechanism against the running group, and the seeded schedule that picks them.

A kind is one row (qsg.chaos.faults.kind.FaultKind: its function, number, cost, parameter draw, tags, places in
the short runs, doc line), registered under its function in its family's module:

    cf_loss.py   the CF (or a structure, or one node) lost and restored; restores racing; backups
    links.py     the fault proxies between an SQM and the CF, and between the clients and an SQM
    members.py   an SQM killed, paused, its disk full, its clock (or its peers') skewed, a stray member
    clients.py   clients that leave while their get waits; messages near and over the size limits
    pstore.py    a structure's persistent store disconnected, or its new units of work refused

``KINDS``, ``FAULTS``, ``COST_S``, the kind lists and ``schedule()``'s draws are derived from the rows here.
docs/chaos.md holds the table of the kinds, one row each with the row's doc line (tests/qsg/chaos/
test_fault_kinds.py holds them equal); ``cfemu chaos kinds`` prints it.

After a fault heals, an SQM that exited (fenced) or no longer serves (its log failed) is restarted, as an operator
would; the report says so. Every CF loss records each queue's get order on the live CF just before the loss and
right after the restore (fault steps with live_order / restored_order): the checker holds them equal. Every fault
records its timings: to peer recovery, to restart, the restore, and to full service (every SQM passes a probe: a
persistent put, commit, get, commit).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from qsg.chaos.faults import cf_loss, clients, links, members, pstore
from qsg.chaos.faults.heal import after_heal
from qsg.chaos.faults.kind import (
    CF_LINK,
    DUPLEX,
    Draw,
    Fault,
    FaultError,
    FaultKind,
    FaultSpec,
    Step,
    rows,
)
from qsg.chaos.faults.pstore import reconnect_pstores
from qsg.chaos.faults.restores import (
    RESTORE_ENGINES,
    ensure_backups,
    failed_structures,
    order_snapshot,
    restore_all,
    restore_engine,
)

FAMILIES = (cf_loss, clients, links, members, pstore)  # each registers its kinds' rows when imported

ROWS: dict[str, FaultKind] = dict(sorted(rows().items(), key=lambda kv: kv[1].number))
KINDS = tuple(ROWS)  # in number order: 'all' rotates them by the seed, so a number never changes
FAULTS: dict[str, Fault] = {k: r.run for k, r in ROWS.items()}
COST_S = {k: r.cost_s for k, r in ROWS.items()}  # rough seconds from injection to full service


def _in(place: Callable[[FaultKind], int | None]) -> tuple[str, ...]:
    """The kinds that have a place in a run, in that order."""
    return tuple(k for k, r in sorted(ROWS.items(), key=lambda kv: place(kv[1]) or 0) if place(r) is not None)


SHORT_KINDS = _in(lambda r: r.short)
# Against a Redis Cluster CF (--redis-cluster): no kind that needs a proxy between an SQM and the CF (a cluster client
# follows the cluster's redirections to the nodes themselves), and a node kill instead.
CLUSTER_SHORT_KINDS = _in(lambda r: r.cluster_short)
CF_LINK_KINDS = tuple(k for k, r in ROWS.items() if CF_LINK in r.tags)
# Kinds that need a duplexed group (the runner starts one when a run has them): left out of 'all', which runs the
# group simplex, so that every other kind keeps meeting the CF it was written for.
DUPLEX_KINDS = tuple(k for k, r in ROWS.items() if DUPLEX in r.tags)


def parse_kinds(text: str) -> tuple[str, ...]:
    """'all', 'short', 'none' or a comma-separated list of kinds; an unknown kind is a ValueError naming it."""
    if text == "all":
        return tuple(k for k in KINDS if k not in DUPLEX_KINDS)
    if text == "short":
        return SHORT_KINDS
    if text in ("none", ""):
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind {', '.join(unknown)}; known: {', '.join(KINDS)}")
    return kinds


def schedule(seed: int, kinds: tuple[str, ...], duration: float, managers: list[str], *, lease_ms: int,
             warmup: float = 3.0) -> list[FaultSpec]:
    """The fault schedule of a seed: one fault at a time, kinds in turn from where the seed before it stopped (seed 1
    from the first), so that consecutive seeds go on through the kinds and a soak of seeds 1 to N covers every kind
    as soon as their faults together are as many as the kinds; targets and parameters drawn from the seed by each
    kind's row. (A fixed stride between the seeds' first kinds left kinds out of a 20-seed soak whenever a kind was
    added: which ones depended on the number of kinds.) A contract: tests/qsg/chaos/schedules.json holds the
    schedules of many seeds."""
    if not kinds:
        return []
    start = 0
    for earlier in range(1, seed):  # where each seed before it stopped (seeds below 1 start at the first kind)
        start = (start + len(_drawn(earlier, kinds, start, duration, managers, lease_ms, warmup))) % len(kinds)
    return _drawn(seed, kinds, start, duration, managers, lease_ms, warmup)


def _drawn(seed: int, kinds: tuple[str, ...], start: int, duration: float, managers: list[str], lease_ms: int,
           warmup: float) -> list[FaultSpec]:
    rnd = random.Random(f"faults-{seed}")
    order = kinds[start:] + kinds[:start]
    out: list[FaultSpec] = []
    t = warmup + rnd.uniform(0, 1.5)
    i = 0
    while t < duration - 2.0:
        row = ROWS[order[i % len(order)]]
        target = row.target(rnd, managers)
        hold, params = row.draw(Draw(rnd, target, managers, lease_ms))
        out.append(FaultSpec(len(out) + 1, round(t, 2), row.name, target, hold, params))
        t += hold + row.cost_s + rnd.uniform(1.0, 3.0)
        i += 1
    return out


def docs_table() -> str:
    """The kinds as docs/chaos.md's table holds them: one row each, in number order."""
    lines = ["| kind | mechanism |", "|---|---|"]
    lines += [f"| `{r.name}` | {r.doc} |" for r in ROWS.values()]
    return "\n".join(lines)


__all__ = ["CF_LINK_KINDS", "CLUSTER_SHORT_KINDS", "COST_S", "DUPLEX_KINDS", "FAMILIES", "FAULTS", "FaultError",
           "FaultKind", "FaultSpec", "KINDS", "RESTORE_ENGINES", "ROWS", "SHORT_KINDS", "Step", "after_heal",
           "docs_table", "ensure_backups", "failed_structures", "order_snapshot", "parse_kinds", "reconnect_pstores", "restore_all",
           "restore_engine", "schedule"]
