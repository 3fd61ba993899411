"""What the console remembers between snapshots: the samples its charts draw (each queue's depth, the group's
puts and gets per second) and the events it saw happen (a structure failing, a recovery starting or ending,
RECAUTO's counts moving, a backup beginning or ending, the duplexed CF's events, a member restarted or down).

Both are bounded (SAMPLES, EVENTS; each sample holds the depths of the QUEUES_SAMPLED deepest queues only, so that
a group of thousands of queues costs no more than one of a hundred) and live in this process only: the console shows what happened while it ran.
Events are found by comparing each snapshot with the one before it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

SAMPLES = 300  # at the default 2 s interval: the last 10 minutes
EVENTS = 200
QUEUES_SAMPLED = 100  # the deepest queues each sample remembers (the chart draws fewer: charts.MAX_SERIES)

RECAUTO_COUNTERS = {"structure_recoveries_started": "RECAUTO started",
                    "structure_recoveries_completed": "RECAUTO completed",
                    "structure_recoveries_failed": "RECAUTO FAILED"}


@dataclass
class Sample:
    at: float
    depths: dict[str, int]  # queue -> messages on it (committed and uncommitted)
    puts: int  # the members' counters, summed (a restarted member's counters start again at 0)
    gets: int


@dataclass
class Event:
    at: float
    kind: str  # structure, recovery, recauto, backup, duplex, member, cf, action
    text: str


@dataclass
class History:
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=EVENTS))
    _last: dict[str, Any] | None = None
    _last_cf: dict[str, Any] | None = None  # the last snapshot in which the CF answered

    def add(self, snap: dict[str, Any]) -> list[Event]:
        """Remember a snapshot: its sample, and the events since the previous one (returned)."""
        services = [m["service"] for m in snap["members"] if m.get("service")]
        if snap["cf"].get("ok"):
            depths = {q["name"]: sum(q["depth"].values()) for q in snap["queues"] if q.get("depth") is not None}
            self.samples.append(Sample(snap["at"], _deepest(depths, QUEUES_SAMPLED),
                                       sum(int(s.get("puts") or 0) for s in services),
                                       sum(int(s.get("gets") or 0) for s in services)))
        new = changes(self._last, snap, self._last_cf) if self._last is not None else []
        self.events.extend(new)
        self._last = snap
        if snap["cf"].get("ok"):
            self._last_cf = snap
        return new

    def note(self, kind: str, text: str) -> None:
        """An event the console knows of itself (an operator action starting or ending), not from a snapshot."""
        self.events.append(Event(time.time(), kind, text))

    def depth_series(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for s in self.samples:
            for q, d in s.depths.items():
                out.setdefault(q, []).append((s.at, float(d)))
        return out

    def rate_series(self) -> dict[str, list[tuple[float, float]]]:
        """Puts and gets per second between consecutive samples (a counter that went down, a member restarted,
        counts from 0)."""
        puts: list[tuple[float, float]] = []
        gets: list[tuple[float, float]] = []
        prev: Sample | None = None
        for s in self.samples:
            if prev is not None and s.at > prev.at:
                dt = s.at - prev.at
                puts.append((s.at, max(0, s.puts - prev.puts) / dt))
                gets.append((s.at, max(0, s.gets - prev.gets) / dt))
            prev = s
        return {"puts/s": puts, "gets/s": gets}


def _deepest(depths: dict[str, int], n: int) -> dict[str, int]:
    if len(depths) <= n:
        return depths
    return dict(sorted(depths.items(), key=lambda item: (-item[1], item[0]))[:n])


def changes(old: dict[str, Any], new: dict[str, Any], old_cf: dict[str, Any] | None = None) -> list[Event]:
    """The events between two snapshots. Structures are compared with old_cf, the last snapshot in which the CF
    answered (when given): a structure that was ACTIVE before the CF was lost is FAILED once it answers again."""
    at = new.get("at", time.time())
    out: list[Event] = []

    def ev(kind: str, text: str) -> None:
        out.append(Event(at, kind, text))

    if old["cf"].get("ok") != new["cf"].get("ok"):
        ev("cf", "the CF answers again" if new["cf"].get("ok") else "the CF does not answer")
    before = {s["name"]: s for s in (old_cf or old)["structures"]}
    for s in new["structures"] if new["cf"].get("ok") else ():
        was = before.get(s["name"])
        if was is None:
            continue
        if was["state"] != s["state"]:
            ev("structure", f"structure {s['name']}: {was['state']} -> {s['state']}")
        if s["recovering_by"] and not was["recovering_by"]:
            ev("recovery", f"structure {s['name']}: recovery by {s['recovering_by']} started")
        elif was["recovering_by"] and not s["recovering_by"]:
            ev("recovery", f"structure {s['name']}: recovery by {was['recovering_by']} ended")
        if s["backup_running"] and s["backup_running"] != was["backup_running"]:
            ev("backup", f"backup {s['backup_running']} of {s['name']} running")
        if s["last_backup"] and s["last_backup"] != was["last_backup"]:
            ev("backup", f"backup {s['last_backup']} of {s['name']} completed")
    members = {m["name"]: m for m in old["members"]}
    for m in new["members"]:
        was = members.get(m["name"])
        if was is None:
            continue
        if was.get("health") != m.get("health"):
            ev("member", f"member {m['name']}: {was.get('health')} -> {m.get('health')}")
        if was.get("epoch") is not None and m.get("epoch") is not None and m["epoch"] != was["epoch"]:
            ev("member", f"member {m['name']}: epoch {was['epoch']} -> {m['epoch']} (it joined again)")
        old_service, service = was.get("service") or {}, m.get("service") or {}
        for counter, what in RECAUTO_COUNTERS.items():
            n, n0 = service.get(counter), old_service.get(counter)
            if n is not None and n0 is not None and n > n0:
                ev("recauto", f"{what} on {m['name']} ({n - n0})")
    old_pair, pair = old.get("duplex") or {}, new.get("duplex") or {}
    if pair.get("last_event") and pair.get("last_event") != old_pair.get("last_event"):
        ev("duplex", str(pair["last_event"]))
    if pair and old_pair and pair.get("secondary_state") != old_pair.get("secondary_state"):
        ev("duplex", f"duplexed CF: secondary {old_pair.get('secondary_state')} -> {pair.get('secondary_state')}")
    procs = {p["process"]: p for p in old.get("processes", [])}
    for p in new.get("processes", []):
        was = procs.get(p["process"])
        if was is not None and (p.get("restarts") or 0) > (was.get("restarts") or 0):
            reason = (p.get("last_restart") or {}).get("reason", "")
            ev("cf" if p["process"].startswith("CF") else "member",
               f"{p['process']} restarted by the supervisor" + (f": {reason}" if reason else ""))
    return out


__all__ = ["EVENTS", "QUEUES_SAMPLED", "SAMPLES", "Event", "History", "Sample", "changes"]
