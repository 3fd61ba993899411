"""The persistent store's availability (docs/pstore.md): a structure's persistent store disconnected, or its new
units of work refused, under load; and healing's safety net that connects them all again."""

from __future__ import annotations

import time
from typing import Any

import redis

from cfemu.cf import CF, PstoreStatus
from cfemu.errors import MQError
from qsg.chaos.faults.kind import Draw, Fault, FaultError, FaultKind, FaultSpec, Step, register
from qsg.chaos.group import STRUCTURES, ChaosGroup


def _pstore(g: ChaosGroup, structure: str, action: str) -> PstoreStatus:
    client = g.cf()
    try:
        return CF(client).structure(structure).pstore(action)
    finally:
        client.close()


def _pstore_off(on: str, off: str, what: str) -> Fault:
    """A structure's persistent store disconnected (or its new units of work refused) for the fault's hold, under
    load, then back: what the members refused meanwhile are FAIL outcomes, and nothing may be lost or twice."""
    def fault(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
        structure = str(f.params["structure"])
        _pstore(g, structure, on)
        t = step(f"{structure}: {what}")
        try:
            time.sleep(f.hold)
        finally:
            after = _pstore(g, structure, off)
        out = {"structure": structure, "off_s": round(step("heal") - t, 3)}
        if not after.connected or after.no_new_uows:
            raise FaultError(f"{structure} still unavailable after {off}: connected={after.connected}, "
                             f"no new UOWs={after.no_new_uows or 'no'}")
        return out
    return fault


def _off_a_while(d: Draw) -> tuple[float, dict[str, Any]]:
    hold = d.rnd.choice((2.0, 3.0, 5.0))
    return hold, {"structure": d.rnd.choice(("APP1", "APP1", "APP2"))}  # APP1 holds the topic too


register(FaultKind(
    "pstore-disconnect", _pstore_off("disconnect", "connect", "persistent store disconnected"), number=27,
    cost_s=2.0, draw=_off_a_while,
    doc="DISCONNECT-PSTORE of a structure (APP1 two seeds in three, else APP2: `Structure.pstore(\"disconnect\")`, as "
        "`cfemu pstore disconnect` does) for 2, 3 or 5 s under load, then CONNECT-PSTORE. Persistent puts, gets of "
        "persistent messages, commits of persistent work, receives for a durable subscriber and persistent "
        "publications are refused meanwhile: FAIL outcomes with the reason (`PstoreUnavailableError`, or "
        "`BackedOutError` for a refused commit); non-persistent work goes on. Healing connects any structure a failed "
        "fault left disconnected"))
register(FaultKind(
    "no-new-uows", _pstore_off("nonew-on", "nonew-off", "no new units of work"), number=28, cost_s=2.0,
    draw=_off_a_while,
    doc="the structure takes no new units of work (`nonew-on`, `cfemu pstore no-new-uows --on`) for 2, 3 or 5 s: "
        "every put is refused (`NoNewUowsError`) except a replacement (a subscription's position, a UOW status), "
        "consuming work goes on; then `nonew-off`"))


def reconnect_pstores(g: ChaosGroup) -> list[str]:
    """The safety net of healing: every structure's persistent store connected and taking new units of work (a
    fault that failed midway may have left one off). A structure the CF does not hold is skipped."""
    done = []
    for s in STRUCTURES:
        try:
            st = _pstore(g, s, "status")
            if not st.connected and st.started != "WARM":
                _pstore(g, s, "connect")
                done.append(f"{s} persistent store connected")
            if st.no_new_uows == "OPERATOR":
                _pstore(g, s, "nonew-off")
                done.append(f"{s} takes new units of work")
        except (MQError, redis.RedisError):
            continue
    return done


__all__ = ["reconnect_pstores"]
