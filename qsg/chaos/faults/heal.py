"""Healing after a fault, as an operator would: restart an SQM, wait for a peer to recover it, and restart one that
exited (fenced) or stopped serving once the fault healed; the history a fault that acts as a client records in."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any

from qsg.chaos.faults.kind import FaultError, Step
from qsg.chaos.group import ChaosGroup
from qsg.chaos.history import History


def restart(g: ChaosGroup, name: str, step: Step, timeout: float = 60.0, **kw: Any) -> float:
    t0 = time.monotonic()
    g.c.restart_manager(name, timeout=timeout, **kw)
    step(f"{name} restarted")
    return round(time.monotonic() - t0, 3)


def peer_recovery(g: ChaosGroup, name: str, step: Step, timeout: float = 60.0) -> float:
    if not g.wait_peer_recovered(name, timeout):
        raise FaultError(f"no peer recovered {name} within {timeout:g}s")
    return step(f"{name} recovered by a peer")


def after_heal(g: ChaosGroup, name: str, step: Step, grace: float = 8.0) -> dict[str, Any]:
    """Restart the SQM if it exited (fenced) or stopped serving (e.g. its log failed), as an operator would."""
    out: dict[str, Any] = {}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not g.running(name):
            break
        if g.probe(name, timeout=2.0):
            return out
        time.sleep(0.2)
    if g.running(name):
        out["forced_restart"] = "no service after healing: killed -9 and restarted"
        g.c.kill_manager(name, signal.SIGKILL)
        step(f"{name} not serving: killed")
        out["peer_recovery_s"] = peer_recovery(g, name, step)
    else:
        out["exit_code"] = g.c.wait_manager_exit(name, timeout=1.0)
        step(f"{name} exited with code {out['exit_code']}")
        with contextlib.suppress(FaultError):
            peer_recovery(g, name, step, timeout=30.0)
    out["restart_s"] = restart(g, name, step)
    return out


def history_of(g: ChaosGroup) -> History:
    if g.history is None:
        raise FaultError("this fault acts as a client and records its calls: the group has no history")
    return g.history


def client_ep(g: ChaosGroup, name: str) -> tuple[str, int]:
    """The SQM's address as clients see it: through its client proxy."""
    return "127.0.0.1", g.client_proxies[name].port


__all__ = ["after_heal", "client_ep", "history_of", "peer_recovery", "restart"]
