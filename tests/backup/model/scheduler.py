"""Stateless exhaustive search over the interleavings of a few actors.

An actor is a generator that announces each atomic step before taking it: it yields the step's label, and the
step runs when the scheduler resumes it (up to the next yield, or to the end of the generator). Between two
resumptions no other code runs, so each step is atomic with respect to the other actors.

The search is a depth-first walk of the tree of schedules without state capture (like CHESS): every run starts
from a fresh world (`start()` rebuilds it and returns fresh actors), replays a prefix of choices, then extends it
by always choosing the lowest-numbered actor that can go on; afterwards it backtracks to the deepest choice point
that has an untried actor. Actors must be deterministic given the schedule.

Without an independence relation every complete schedule is run exactly once. With one, the search uses sleep
sets (Godefroid, "Partial-Order Methods for the Verification of Concurrent Systems", 1996, chapter 5): two steps
of different actors are independent when running them in either order from any state gives the same state and
neither enables or disables the other. After the subtree of step t has been explored at a node, t sleeps in the
subtrees of its later siblings for as long as only steps independent of t are taken there: any schedule that
takes t there is a reordering of independent steps of one already run. So exactly one schedule per equivalence
class (Mazurkiewicz trace) of complete schedules is run, and every reachable state is still visited; a branch
where every unfinished actor sleeps is cut (it is counted, never checked: its completions were all run).

`sample` runs a given number of random complete schedules instead (each step: an actor that can go on, drawn from a
seeded generator), with the same callbacks: the default suite's smaller instance of a search whose every
interleaving the deep tier runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

Actor = Iterator[str]
Trace = list[str]


class ScheduleDivergedError(AssertionError):
    """A replayed prefix took a different path: an actor is not deterministic given the schedule."""


@dataclass
class Exploration:
    interleavings: int = 0  # complete schedules run (one per equivalence class with an independence relation)
    sleep_blocked: int = 0  # branches cut because every unfinished actor sleeps
    nodes: int = 0  # distinct intermediate states (tree nodes that are not leaves) visited
    steps: int = 0  # atomic steps executed, replays included
    longest: int = 0
    stopped: bool = False  # a callback asked to stop early
    first_leaves: list[Trace] = field(default_factory=list)


class Stop(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a callback to end the exploration early (e.g. at the first violation)."""


def explore(start: Callable[[], Sequence[tuple[str, Actor]]], *,
            on_leaf: Callable[[Trace], None],
            on_node: Callable[[Trace], None] | None = None,
            independent: Callable[[str, str], bool] | None = None,
            limit: int | None = None) -> Exploration:
    """Run every interleaving of the actors `start()` returns ((name, generator) pairs).

    independent(label_a, label_b): whether the announced next steps of two different actors commute (see the
    module docstring); None runs every interleaving.

    on_leaf(trace) runs after each complete schedule; on_node(trace) runs once per distinct intermediate state
    (the first time the search reaches that prefix), so a check there sees every reachable state once.
    A callback raises Stop to end the search; `limit` bounds the number of schedules (a safety net for tests).
    """
    result = Exploration()
    prefix: list[int] = []
    while True:
        pairs = list(start())
        names = [n for n, _ in pairs]
        actors = [a for _, a in pairs]
        labels: list[str | None] = [next(a, None) for a in actors]
        schedule: list[int] = []
        awake_at: list[list[int]] = []  # per depth: the actors that may be chosen there, in search order
        trace: Trace = []
        sleeping: set[int] = set()
        blocked = False
        try:
            while True:
                enabled = [i for i, lab in enumerate(labels) if lab is not None]
                if not enabled:
                    break
                awake = [i for i in enabled if i not in sleeping]
                if not awake:
                    blocked = True
                    break
                depth = len(schedule)
                if depth < len(prefix):
                    choice = prefix[depth]
                    if choice not in awake:
                        raise ScheduleDivergedError(f"replay of {trace} diverged: actor {choice} cannot go on")
                else:
                    choice = awake[0]
                if independent is not None:
                    # Siblings explored before `choice` (lower-numbered awake actors) sleep in its subtree too.
                    done_before = {i for i in awake if i < choice}
                    chosen = labels[choice]
                    assert chosen is not None
                    sleeping = {i for i in sleeping | done_before
                                if independent(labels[i] or "", chosen)}
                trace.append(f"{names[choice]}: {labels[choice]}")
                labels[choice] = next(actors[choice], None)
                result.steps += 1
                schedule.append(choice)
                awake_at.append(awake)
                new_node = len(schedule) >= len(prefix)
                if on_node is not None and new_node and any(lab is not None for lab in labels):
                    result.nodes += 1
                    on_node(trace)
            if blocked:
                result.sleep_blocked += 1
            else:
                result.interleavings += 1
                result.longest = max(result.longest, len(trace))
                if len(result.first_leaves) < 3:
                    result.first_leaves.append(list(trace))
                on_leaf(trace)
        except Stop:
            result.stopped = True
            return result
        finally:
            for a in actors:
                close = getattr(a, "close", None)
                if close is not None:
                    close()
        if limit is not None and result.interleavings >= limit:
            result.stopped = True
            return result
        # Backtrack: the deepest choice point with an untried (higher-numbered) awake actor.
        for depth in range(len(schedule) - 1, -1, -1):
            later = [i for i in awake_at[depth] if i > schedule[depth]]
            if later:
                prefix = schedule[:depth] + [later[0]]
                break
        else:
            return result


def sample(start: Callable[[], Sequence[tuple[str, Actor]]], *, schedules: int, seed: int,
           on_leaf: Callable[[Trace], None],
           on_node: Callable[[Trace], None] | None = None) -> Exploration:
    """Run `schedules` random complete schedules of the actors `start()` returns: at each step the actor to go on
    is drawn uniformly from those that can, by a generator seeded with `seed` (the same schedules every run).

    on_leaf(trace) runs after each distinct complete schedule (one drawn again is run, not checked again: it
    ends in the same state); on_node(trace) runs once per distinct intermediate state reached (the first time a
    schedule reaches that prefix). `interleavings` counts the distinct complete schedules."""
    result = Exploration()
    rnd = random.Random(seed)
    seen_nodes: set[tuple[str, ...]] = set()
    seen_leaves: set[tuple[str, ...]] = set()
    for _ in range(schedules):
        pairs = list(start())
        names = [n for n, _ in pairs]
        actors = [a for _, a in pairs]
        labels: list[str | None] = [next(a, None) for a in actors]
        trace: Trace = []
        try:
            while True:
                enabled = [i for i, lab in enumerate(labels) if lab is not None]
                if not enabled:
                    break
                choice = rnd.choice(enabled)
                trace.append(f"{names[choice]}: {labels[choice]}")
                labels[choice] = next(actors[choice], None)
                result.steps += 1
                if on_node is not None and any(lab is not None for lab in labels):
                    node = tuple(trace)
                    if node not in seen_nodes:
                        seen_nodes.add(node)
                        result.nodes += 1
                        on_node(trace)
            leaf = tuple(trace)
            if leaf in seen_leaves:  # drawn before: the same state, checked then
                continue
            seen_leaves.add(leaf)
            result.interleavings += 1
            result.longest = max(result.longest, len(trace))
            if len(result.first_leaves) < 3:
                result.first_leaves.append(list(trace))
            on_leaf(trace)
        except Stop:
            result.stopped = True
            return result
        finally:
            for a in actors:
                close = getattr(a, "close", None)
                if close is not None:
                    close()
    return result
