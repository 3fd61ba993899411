"""Network faults on the fault proxies (qsg/chaos/proxy.py): between one SQM and the CF (``cf-link-*``), and between
the clients and one SQM (``client-link-*``). Each heals the link and then restarts the SQM if it exited (fenced) or
stopped serving, as an operator would."""

from __future__ import annotations

import time
from typing import Any

from qsg.chaos.faults.heal import after_heal
from qsg.chaos.faults.kind import CF_LINK, Draw, Fault, FaultKind, FaultSpec, Step, register
from qsg.chaos.group import ChaosGroup


def _link(which: str, mode: str) -> Fault:
    def fault(g: ChaosGroup, f: FaultSpec, step: Step) -> dict[str, Any]:
        proxy = (g.cf_proxies if which == "cf" else g.client_proxies)[f.target]
        if mode == "cut":
            proxy.cut()
        elif mode == "reply-loss":
            proxy.lose_replies()
        elif mode == "delay":
            proxy.delay(f.params.get("delay_ms", 100) / 1000)
        else:
            proxy.half_open()
        step(f"{which} link {mode}")
        time.sleep(f.hold)
        if mode == "reply-loss":
            proxy.cut()  # the SQM's calls waiting for a reply learn that it is lost (a reset)
        proxy.heal()
        step("heal")
        return after_heal(g, f.target, step)
    return fault


def _blip_or_fence(d: Draw) -> tuple[float, dict[str, Any]]:
    """Sometimes past the lease (the SQM is fenced and must restart), sometimes a short blip."""
    return d.rnd.choice((1.0, 2.0, round(d.lease_ms / 1000 * 1.6 + 1.0, 1))), {}


def _replies_lost(d: Draw) -> tuple[float, dict[str, Any]]:
    return d.rnd.choice((0.3, 1.0, 2.0)), {}  # shorter than the lease: the SQM stays, its calls' replies do not


def _delay(d: Draw) -> tuple[float, dict[str, Any]]:
    hold = d.rnd.choice((2.0, 3.0))
    return hold, {"delay_ms": d.rnd.choice((50, 150, 400))}


CUT = ("closes every connection with a reset and refuses new ones (its listener is closed) for 1, 2 or 1.6 x lease "
       "+ 1 s; the longest gets the SQM fenced by its peers (it exits with code 3 and is restarted)")
DELAY = "50, 150 or 400 ms added to every chunk in each direction for 2-3 s"
HALFOPEN = ("forwards nothing and closes nothing (new connections are accepted and hang too); what it held is "
            "delivered when healed, as TCP would retransmit it")

register(FaultKind("cf-link-cut", _link("cf", "cut"), number=6, cost_s=4.0, draw=_blip_or_fence,
                   tags=frozenset({CF_LINK}), short=3, doc=f"the proxy between one SQM and the CF {CUT}"))
register(FaultKind("cf-link-delay", _link("cf", "delay"), number=7, cost_s=4.0, draw=_delay,
                   tags=frozenset({CF_LINK}), doc=f"on the proxy between one SQM and the CF, {DELAY}"))
register(FaultKind("cf-link-halfopen", _link("cf", "halfopen"), number=8, cost_s=4.0, draw=_blip_or_fence,
                   tags=frozenset({CF_LINK}), doc=f"the proxy between one SQM and the CF {HALFOPEN}"))
register(FaultKind(
    "cf-link-reply-loss", _link("cf", "reply-loss"), number=9, cost_s=4.0, draw=_replies_lost,
    tags=frozenset({CF_LINK}), short=5,
    doc="the proxy between one SQM and the CF forwards the SQM's requests and drops every reply for 0.3, 1 or 2 s, "
        "then resets the connections: CF scripts that ran while the SQM cannot know it (the window a cut opens "
        "between a request's arrival and its reply, held open). A UOW must keep a get or put whose reply was lost "
        "(forgotten, its entry stays locked for good: the checker's `stuck`)"))
register(FaultKind("client-link-cut", _link("client", "cut"), number=10, cost_s=4.0, draw=_blip_or_fence,
                   doc=f"the proxy between the clients and one SQM {CUT}"))
register(FaultKind("client-link-delay", _link("client", "delay"), number=11, cost_s=4.0, draw=_delay,
                   doc=f"on the proxy between the clients and one SQM, {DELAY}"))
register(FaultKind("client-link-halfopen", _link("client", "halfopen"), number=12, cost_s=4.0,
                   draw=_blip_or_fence, short=4, cluster_short=4,
                   doc=f"the proxy between the clients and one SQM {HALFOPEN}"))


__all__: list[str] = []
