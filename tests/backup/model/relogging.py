"""Selective relogging and log pruning in the model (docs/log-management.md): the relog actor and the
checks that restore after the logs are pruned to what sqm.core.retention says CF recovery needs.

The relog actor is sqm.core.relog's pass, one CF call or one log append per step: begin (relog_begin.lua: the lock, B,
the floor raised to B), scan (relog_scan.lua, one atomic batch), the RELOG copies logged (a log-only step), the
copies marked (relog_end.lua), the CHECKPOINT record that completes the pass (its window w), the aged CPL stored.
Between any two of them any message step can run: a commit logged before B and applied after the scan (refused by
the floor and re-logged above it), a get applied between the scan and the mark, a backout of a copied get, ...

The pruning check: the real sqm.core.retention.structure_start picks where CF recovery starts (the backup's replay start
or the relog window, as restore.run.choose_start does); every record below it is dropped (record by record: more
than the product, which prunes whole segments, ever drops); the restore from that start must still rebuild exactly
what must survive. The logs-alone restore from the window (the empty base of the pass's generation) must too,
whichever start the choice made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from restore.reference import plan_local
from sqm.core import records
from sqm.core.relog import aged, fitted
from sqm.core.retention import structure_start
from tests.backup.model.actors import (
    BACKUP_ID,
    STRUCTURE,
    Row,
    Steps,
    World,
    cf_truth,
    compare,
    compare_ordered,
    expected_after_loss,
    restored_rows,
)

CPL_ENTRIES = 1


@dataclass
class RelogMutation:
    """For proving that the checks can fail: window_at_end claims the window starts at the pass's end (as if every
    live message had a copy after it), so pruning drops the only copy of a message put before the pass."""

    window_at_end: bool = False


def relog_actor(world: World, name: str = "QM1", mutation: RelogMutation | None = None) -> Steps:
    """One relog pass of `name` on the structure, completed by its CHECKPOINT record (world.relog_pass)."""
    m = world.members[name]
    s = m.s
    yield f"relog-pass begin by {name}"
    begun = s.relog_begin(m.caller, now_ms=world.now_ms, lease_ms=600_000)
    stored = begun.cpl if begun.cpl is not None and int(begun.cpl.get("g", -1)) == begun.gen else None
    old = (fitted(stored["p"], CPL_ENTRIES) if stored and stored.get("p")
           else [[begun.begin, begun.begin]] * CPL_ENTRIES)
    threshold = old[0][1]
    window = min(threshold, begun.first)
    yield f"relog-pass scan by {name}"
    batch = s.relog_scan(m.caller, threshold=threshold, cursor="0", count=10_000)
    assert batch.cursor == "0", "the model's structure is scanned in one batch"
    if batch.copies:
        yield f"log RELOG copies by {name}"
        lrsn = m.clock.now()
        for _entry, data, desc in batch.copies:
            m.log.append(records.relog(lrsn, structure=STRUCTURE, gen=begun.gen, entry=desc, data=data))
        yield f"relog-pass mark by {name}"
        s.relog_end(m.caller, relog_lrsn=lrsn, ids=[e.id for e, _, _ in batch.copies])
    yield f"log CHECKPOINT by {name}"
    end = m.clock.now()
    cpl = aged(old, [begun.begin, end], CPL_ENTRIES)
    if mutation is not None and mutation.window_at_end:
        window = end
    p = {"cpl": cpl, "gen": begun.gen, "w": window, "b": begun.begin, "e": end, "held": list(begun.carried)}
    m.log.append(records.checkpoint(end, uows={}, n=0, why="logload", passes={STRUCTURE: p}))
    world.relog_pass = (name, p)
    yield f"relog-pass store cpl by {name}"
    s.relog_end(m.caller, relog_lrsn=0, ids=(), cpl={"g": begun.gen, "p": cpl})


def _catalog(world: World, gen: int) -> list[dict[str, Any]]:
    b = world.backup
    if not b.ended:
        return []
    return [{"id": BACKUP_ID, "start_lrsn": b.start, "replay_from": b.floor, "gen": gen}]


def _restores(world: World) -> list[tuple[str, dict[str, list[Row]]]]:
    """(how, restored rows) of each restore the checks compare: logs alone from the window; the start the
    retention chooses, with every record below it pruned."""
    found = world.relog_pass
    assert found is not None
    member, p = found
    gen, w = int(p["gen"]), int(p["w"])

    def from_logs(start: int) -> dict[str, list[Row]]:
        return restored_rows(plan_local(STRUCTURE, [], world.records(start), now_ms=world.now_ms, gen=gen,
                                        carried=p["held"], lrsn=int(p["e"])))

    out = [(f"logs alone from the window {w}", from_logs(w))]
    start = structure_start(STRUCTURE, _catalog(world, gen), found)
    pruned = f"after pruning below {start.lrsn} ({start.why})"
    if "relog window" in start.why:
        out.append((pruned, from_logs(start.lrsn)))
    else:
        b = world.backup
        assert start.lrsn == b.floor
        out.append((pruned, restored_rows(plan_local(STRUCTURE, b.copies, world.records(start.lrsn),
                                                     now_ms=world.now_ms))))
    return out


def check_relogged_after_loss(world: World) -> None:
    """The CF lost now, the logs pruned to what retention keeps: each restore rebuilds what must survive."""
    if world.relog_pass is None:
        return
    want = expected_after_loss(world)
    for how, rows in _restores(world):
        try:
            compare(want, {row[0]: row for rs in rows.values() for row in rs})
        except AssertionError as v:
            raise type(v)(f"{how}: {v}") from None


def check_relogged_complete(world: World) -> None:
    """At the end of a schedule: each restore equals the CF's committed state, get order included."""
    truth = cf_truth(world)
    for how, rows in _restores(world):
        compare_ordered(truth, rows, how)


__all__ = ["CPL_ENTRIES", "RelogMutation", "check_relogged_after_loss", "check_relogged_complete", "relog_actor"]
