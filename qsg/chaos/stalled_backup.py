"""A `cfbackup` process that stalls inside its backup: `cfbackup run` as an operator runs it (backup.cli.main),
whose backup stops before its copy step 2 for a given time. Meanwhile the process is a running backup, its mark
set and its lease renewed: the window that the faults of a stuck backup (qsg.chaos.faults.cf_loss) and the tests of
the backup mark need."""

from __future__ import annotations

import select
import subprocess
import sys

# Run with `python -c`: says IN_STEP_2 on stdout when the backup reaches its step 2, then sleeps $STALL_S seconds.
SCRIPT = """
import os, sys, time
import backup.cli as cli
import backup.run as run

real = run.run_backup

def stalled(*args, **kwargs):
    def on_step(number, state):
        if number == 2:
            print("IN STEP 2", flush=True)
            time.sleep(float(os.environ["STALL_S"]))
    return real(*args, on_step=on_step, **kwargs)

cli.run_backup = stalled
sys.exit(cli.main(sys.argv[1:]))
"""
IN_STEP_2 = "IN STEP 2"


class StallError(RuntimeError):
    """The backup did not reach its step 2 in time (it failed, or hung before): the message holds what it said."""


def start_stalled_backup(args: list[str], env: dict[str, str], stall_s: float,
                         start_timeout_s: float = 60.0) -> subprocess.Popen[str]:
    """`cfbackup ARGS` (``["run", STRUCTURE, ...]``) in a process of its own, returned once its backup has reached
    step 2 and stalls there for ``stall_s`` seconds. One that does not say so within ``start_timeout_s`` is killed,
    and StallError says what it printed."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *args], env={**env, "STALL_S": str(stall_s)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != IN_STEP_2:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise StallError(f"the backup to stall did not reach its step 2: {line!r} {err[-300:]!r}")
    return proc


__all__ = ["IN_STEP_2", "SCRIPT", "StallError", "start_stalled_backup"]
