"""What the chaos run counts as left behind after the drain (qsg.chaos.runner.settled_leftovers): an entry a
member's sweeper holds for a moment is not stuck; one held for the whole settle time is."""

from __future__ import annotations

from collections.abc import Iterator

from qsg.chaos.conversations import service_queues
from qsg.chaos.runner import settled_leftovers

CONTROL = service_queues()[1]
HELD = {CONTROL: {"UP": 0, "UG": 1, "EX": 0, "CP": 327}}


def looks(*answers: dict[str, dict[str, int]]) -> Iterator[dict[str, dict[str, int]]]:
    yield from answers
    while True:
        yield answers[-1]


def test_a_control_a_sweeper_held_for_a_moment_is_not_left_behind() -> None:
    it = looks(HELD, HELD, {})
    assert settled_leftovers(lambda: next(it), settle_s=5.0, interval_s=0.01) == {}


def test_a_control_held_for_the_whole_settle_time_is_left_behind() -> None:
    it = looks(HELD)
    assert settled_leftovers(lambda: next(it), settle_s=0.2, interval_s=0.01) == HELD


def test_the_workload_s_own_queues_count_at_the_first_look() -> None:
    undrained = {"Q1": {"UP": 0, "UG": 0, "EX": 0, "CP": 3}}
    it = looks(undrained, {})
    assert settled_leftovers(lambda: next(it), settle_s=5.0, interval_s=0.01) == undrained
