"""The pids of this process's children, read from /proc (what the restore tests check is left behind)."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids() -> set[int]:
    """This process's children, over all its threads (a child is listed under the thread that started it). A
    thread may end between the listing of the tasks and the read of its file: it then has none to list (the CI
    run of a0d60d7 failed once on such a thread: FileNotFoundError)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids
