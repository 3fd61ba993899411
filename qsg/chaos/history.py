"""The chaos run's history: every client invocation and its completion, and every fault, as JSON lines.

Each line is written and flushed as it happens, so the file survives a crash of the runner and can be read
while the run goes on. Lines (``t`` is seconds since the run started, monotonic):

    {"type": "meta", "seed": 7, "started_at": "2025-...", ...}
    {"type": "invoke", "id": 12, "t": 1.2345, "client": "c3", "op": "put", "uow": "c3.4", "msg": "7-3-9", ...}
    {"type": "ok" | "fail" | "unknown", "id": 12, "t": 1.2401, ...}     fail carries "reason" (MQRC name)
    {"type": "fault", "t": 5.0, "phase": "inject" | "heal" | "recovered", "fault": 2, "kind": "sqm-kill", ...}

Operations: put, get, commit, backout, prepare, resolve, drain (a get outside syncpoint after healing).

Read back, an invocation joined with its completion is an ``Op`` (pair_ops): what every checker reads, so that
the checkers (qsg.chaos.checker, uowcheck, pubsubcheck) are siblings over one history and none imports another.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"
OUTCOMES = (OK, FAIL, UNKNOWN)


class History:
    """Append-only JSONL history, safe to share between client threads."""

    def __init__(self, path: str | os.PathLike[str], **meta: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.t0 = time.monotonic()
        self._write({"type": "meta", "started_at": datetime.now(UTC).isoformat(timespec="milliseconds"), **meta})

    def now(self) -> float:
        """Seconds since the run started (the ``t`` of every line)."""
        return round(time.monotonic() - self.t0, 4)

    def _write(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def invoke(self, client: str, op: str, **args: Any) -> int:
        op_id = next(self._ids)
        self._write({"type": "invoke", "id": op_id, "t": self.now(), "client": client, "op": op, **args})
        return op_id

    def complete(self, op_id: int, outcome: str, **result: Any) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {outcome!r}")
        self._write({"type": outcome, "id": op_id, "t": self.now(), **result})

    def fault(self, phase: str, **fields: Any) -> None:
        self._write({"type": "fault", "t": self.now(), "phase": phase, **fields})

    def note(self, **fields: Any) -> None:
        """Anything else worth keeping in time order (phases of the run, probes)."""
        self._write({"type": "note", "t": self.now(), **fields})

    def close(self) -> None:
        with self._lock:
            self._file.close()


def load_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a history file; a torn last line (the runner was killed mid-write) is left out. A file that
    holds no event, or a line that is not one (a JSON object with its "type"), is not a history: ValueError, never
    a check that finds nothing in it."""
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if n >= len(lines) - 1 and events:
                break
            raise ValueError(f"{path}: line {n} is not JSON: not a chaos history") from None
        if not isinstance(event, dict) or "type" not in event:
            raise ValueError(f"{path}: line {n} is not an event of a chaos history (a JSON object with its \"type\")")
        events.append(event)
    if not events:
        raise ValueError(f"{path}: no event in it: not a chaos history (a run's history.jsonl)")
    return events


@dataclass
class Op:
    id: int
    client: str
    op: str
    t0: float
    t1: float | None
    outcome: str  # ok, fail, unknown (no completion recorded: unknown)
    args: dict[str, Any]
    result: dict[str, Any]


def pair_ops(events: Iterable[dict[str, Any]]) -> tuple[list[Op], list[dict[str, Any]]]:
    """Invocations joined with their completions (in invocation order), and the fault events (the run's notes
    too, with type "note")."""
    ops: dict[int, Op] = {}
    faults = []
    for e in events:
        kind = e.get("type")
        if kind == "invoke":
            args = {k: v for k, v in e.items() if k not in ("type", "id", "t", "client", "op")}
            ops[e["id"]] = Op(e["id"], e["client"], e["op"], e["t"], None, "unknown", args, {})
        elif kind in ("ok", "fail", "unknown") and e.get("id") in ops:
            o = ops[e["id"]]
            o.t1, o.outcome = e["t"], kind
            o.result = {k: v for k, v in e.items() if k not in ("type", "id", "t")}
        elif kind in ("fault", "note"):
            faults.append(e)
    return sorted(ops.values(), key=lambda o: o.id), faults


# How a checker reports a finding: find(kind, message ids, detail, uow key).
Find = Callable[[str, Iterable[str], str, str], None]


__all__ = ["FAIL", "Find", "History", "OK", "OUTCOMES", "Op", "UNKNOWN", "load_history", "pair_ops"]
