"""The bulk load: write a settled restore plan into the CF, once, pipelined.

Recovery owns the structure while it is RECOVERING (every CF script refuses work on it), so the load does not
keep the structure correct step by step (prior art IPCOM000013422): it deletes every key of the structure
except its header, writes only the survivors in pipelined batches, checks the counts, and only then rewrites
the header with state ACTIVE. A crash anywhere before that last step leaves the structure RECOVERING, and a
re-run starts again from the wipe: the load is idempotent.

This module decides what is loaded, in which order and batches; the writes themselves (and the CF format they
write) are cfemu.bulk's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from cfemu import bulk
from cfemu.admin import StructureDef
from restore.engine import LOAD, Progress, no_progress
from restore.plan import RestorePlan, owner_of
from restore.settle import BACKOUT, Settled, fifo_key
from sqm.failpoints import failpoint

BATCH = bulk.BATCH


class LoadVerifyError(RuntimeError):
    """The structure does not hold what the plan says after the load (it stays RECOVERING)."""


@dataclass
class LoadResult:
    entries: int = 0
    bytes: int = 0
    keys_deleted: int = 0
    batches: int = 0
    uows_in_doubt: int = 0
    seconds: float = 0.0


def load_order(settled: list[Settled]) -> list[Settled]:
    """Loaded entries grouped by the list they go on, each list in the CF's order: committed puts by priority
    then FIFO (settle.fifo_key), uncommitted puts in put order, uncommitted gets in get order."""
    def key(s: Settled) -> tuple[Any, ...]:
        e = s.entry
        assert e is not None
        if e["st"] == "CP":
            return (e["q"], 0, *fifo_key(e), s.id)
        if e["st"] == "UP":
            return (e["q"], 1, int(e.get("o2", 0)), 0, 0, s.id)
        return (e["q"], 2, int(e["l"]), 0, 0, s.id)
    return sorted((s for s in settled if s.entry is not None), key=key)


def restore_owned_uows(plan: RestorePlan) -> dict[str, str]:
    """Tombstones: 'C' for committed UOWs whose owner may still be completing them (its retry is then a
    no-op), 'B' for in-flight UOWs restore backed out (now or in an earlier run: a re-run writes the same)."""
    tomb = {u: "C" for u in plan.in_commit}
    for u, o in plan.outcomes.items():
        if o.kind == BACKOUT and o.decided_by == "restore":
            tomb[u] = "B"
    return tomb


def loaded_tombstones(plan: RestorePlan, base_tombstones: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tombstones a load writes (and its restore point keeps): those the base carried, and the plan's own,
    which win."""
    return {**(base_tombstones or {}), **restore_owned_uows(plan)}


def load_plan(client: redis.Redis, plan: RestorePlan, sdef: StructureDef, queues: list[str], *,
              batch: int = BATCH, progress: Progress = no_progress, restored_from: str = "",
              base_tombstones: Mapping[str, str] | None = None, before_activate: Callable[[], None] | None = None,
              last_backup: str = "") -> LoadResult:
    """Replace the structure's content with the plan's survivors and make it ACTIVE (see the module doc).
    The header must already say RECOVERING. base_tombstones: those the base carried (the plan's own win).
    before_activate: called once the load is verified, before the structure is ACTIVE (restore writes its
    restore point there, `last_backup`: the header names it)."""
    t0 = time.monotonic()
    S = plan.structure
    result = LoadResult()
    result.keys_deleted = bulk.reset(client, sdef, batch=batch)

    ordered = load_order(plan.settled)
    loader = bulk.Loader(client, S, gen=plan.restore_lrsn)
    progress(LOAD, 0, len(ordered))
    for start in range(0, len(ordered), batch):
        chunk = ordered[start:start + batch]
        loader.write(chunk)
        result.entries += len(chunk)
        result.batches += 1
        progress(LOAD, result.entries, len(ordered))
        failpoint("restore-load-batch")  # tests: SQM_FAILPOINTS=restore-load-batch=N dies after batch N
    result.bytes = loader.bytes
    result.uows_in_doubt = loader.finish(queues, owner=lambda u: uow_owner(plan, u),
                                         tomb=loaded_tombstones(plan, base_tombstones))

    problems = bulk.verify(client, S, ordered)
    if problems:
        raise LoadVerifyError(f"structure {S} after the load: {'; '.join(problems)} (left RECOVERING)")
    if before_activate is not None:
        before_activate()
    bulk.activate(client, sdef, gen=plan.restore_lrsn, clock=plan.restore_lrsn + 1, floor=plan.restore_lrsn,
                  entries=result.entries, nbytes=result.bytes, restored_from=restored_from, last_backup=last_backup)
    result.seconds = time.monotonic() - t0
    return result


def uow_owner(plan: RestorePlan, uow: str) -> str:
    """The member that owns an in-doubt UOW: the one that logged its PREPARE (UOW ids start with it too)."""
    o = plan.outcomes.get(uow)
    return o.decided_by if o is not None and o.decided_by else owner_of(uow)
