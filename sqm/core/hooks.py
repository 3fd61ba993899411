"""Where features plug into a queue manager's life, so that the core runs them without importing them.

A feature (a wing: sqm.conversations, sqm.pubsub) registers, when it is installed on a queue manager:
- housekeeping tasks (``every``): run by the queue manager's housekeeping thread, after its own work of the round
  (pending outcomes, peer recovery, RECAUTO, checkpoints, expiry), in the order they were registered. The tasks due
  in a round all have their next time set before the first runs; a task's error ends the round (housekeeping logs
  it) and the tasks after it run when next due;
- "member recovered" listeners (``on_member_recovered``): called by restart once its backward recovery is done
  (before the start checkpoint), and by peer recovery once the failed member's units of work are decided (before
  the member is forgotten). A listener returns a line for the restart report ("" for none).

``state`` keeps what a wing holds per queue manager (its sweeper, say), for the wing's own look-ups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

Task = Callable[[], object]
Listener = Callable[[str], str]  # the recovered member's name -> a line for the restart report, or ""


T = TypeVar("T")


class Sweeping(Protocol):
    def sweep(self) -> object: ...


@dataclass
class _Every:
    interval_s: float
    task: Task
    next_at: float = 0.0


@dataclass
class Hooks:
    _tasks: list[_Every] = field(default_factory=list)
    _recovered: list[Listener] = field(default_factory=list)
    state: dict[str, object] = field(default_factory=dict)

    def every(self, interval_s: float, task: Task) -> None:
        """Run ``task`` from housekeeping every ``interval_s`` seconds, the first time at its first round."""
        self._tasks.append(_Every(interval_s, task))

    def add_sweeper(self, key: str, sweeper: Sweeping, interval_ms: int) -> None:
        """Keep a wing's sweeper in ``state`` under ``key``, and run its sweep from housekeeping every
        ``interval_ms`` (0: never; QueueManagerConfig.uow_sweep_interval_ms)."""
        self.state[key] = sweeper
        if interval_ms:
            self.every(interval_ms / 1000, sweeper.sweep)

    def kept(self, key: str, kind: type[T]) -> T | None:
        """What a wing keeps in ``state`` under ``key``, when it is a ``kind`` (None: the wing is not installed)."""
        found = self.state.get(key)
        return found if isinstance(found, kind) else None

    def on_member_recovered(self, listener: Listener) -> None:
        self._recovered.append(listener)

    def run_due(self, now: float) -> None:
        """Housekeeping's round of the registered tasks (the module's docstring)."""
        due = [t for t in self._tasks if now >= t.next_at]
        for t in due:
            t.next_at = now + t.interval_s
        for t in due:
            t.task()

    def member_recovered(self, member: str) -> list[str]:
        """Tell every listener that ``member`` was recovered; the lines they return for the restart report."""
        return [said for listener in self._recovered if (said := listener(member))]


__all__ = ["Hooks", "Listener", "Sweeping", "Task"]
