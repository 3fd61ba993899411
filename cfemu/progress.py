"""The progress port: how library code on every floor reports progress without knowing who draws it.

    progress(phase, done, total)   `done` units of `phase` finished so far; total is None while unknown

Library code (backup.run, restore's engines and load, restore.archive) calls a ``Progress``; the command lines
draw it (cfemu.clitools.PhaseBars, rich bars on a terminal) and tests record it. Phases come one after another.
Nothing below the command lines imports rich.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int | None], None]


def no_progress(phase: str, done: int, total: int | None) -> None:
    """The default progress callback: report nothing."""
