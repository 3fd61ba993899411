"""A seed's fault schedule is a contract: the same seed gives the same faults, targets, holds and parameters,
whatever file a kind's row lives in. schedules.json holds the schedules of the cases below as the code before
the fault kinds became rows (qsg/chaos/faults/) drew them; regenerate it only for a change that means to alter
schedules (``python -m tests.qsg.chaos.test_fault_schedule``), and say so in the commit."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from qsg.chaos.faults import CF_LINK_KINDS, CLUSTER_SHORT_KINDS, KINDS, SHORT_KINDS, parse_kinds, schedule

GOLDEN = Path(__file__).with_name("schedules.json")
THREE = ["QM1", "QM2", "QM3"]

# (case name, seeds, kinds, duration, managers, lease_ms)
Case = tuple[str, range, tuple[str, ...], float, list[str], int]


def cases() -> list[Case]:
    out: list[Case] = [
        ("all", range(1, 21), parse_kinds("all"), 120.0, THREE, 3000),
        ("every-kind-lease-5000", range(1, 6), KINDS, 90.0, THREE, 5000),
        ("short", range(1, 4), SHORT_KINDS, 22.0, THREE, 3000),
        ("cluster-short", range(1, 4), CLUSTER_SHORT_KINDS, 25.0, THREE, 3000),
        ("no-cf-link", range(1, 4), tuple(k for k in KINDS if k not in CF_LINK_KINDS), 60.0, THREE, 3000),
        ("one-member", range(1, 4), parse_kinds("all"), 60.0, ["QM1"], 3000),
        ("two-members", range(1, 4), parse_kinds("all"), 60.0, ["QM1", "QM2"], 3000),
        ("five-members", range(1, 4), parse_kinds("all"), 60.0, ["QM1", "QM2", "QM3", "QM4", "QM5"], 4000),
    ]
    out += [(f"only-{k}", range(1, 4), (k,), 40.0, ["QM1", "QM2", "QM3", "QM4"], 3000) for k in KINDS]
    return out


def drawn(case: Case) -> dict[str, list[list[Any]]]:
    _, seeds, kinds, duration, managers, lease_ms = case
    return {str(seed): [[f.n, f.at, f.kind, f.target, f.hold, f.params]
                        for f in schedule(seed, kinds, duration, managers, lease_ms=lease_ms)] for seed in seeds}


def test_every_case_draws_the_schedule_it_drew_before() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(c[0] for c in cases()), "a case without its golden schedules, or the reverse"
    for case in cases():
        assert json.loads(json.dumps(drawn(case))) == golden[case[0]], case[0]


def test_the_golden_schedules_cover_every_kind_and_parameter() -> None:
    golden = json.loads(GOLDEN.read_text())
    seen = {f[2] for by_seed in golden.values() for faults in by_seed.values() for f in faults}
    assert seen == set(KINDS)
    params = {p for by_seed in golden.values() for faults in by_seed.values() for f in faults for p in f[5]}
    assert {"delay_ms", "skew_ms", "then_kill", "idle", "commit", "step", "structure", "where", "live_s"} <= params


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({c[0]: drawn(c) for c in cases()}, separators=(",", ":"), sort_keys=True) + "\n")
    sys.exit(0)
