"""Group CF calls: the CF calls that concurrent requests make at the same moment go to the CF as one pipelined
round trip (cfemu.cf.CF.run_many), as the log's group commit makes their records one write and one fsync.

Every CF call of a queue manager goes through ``CF.run`` (cfemu.cf.Structure builds each script's arguments and
reads its reply). In ``GroupedCF.run`` a call made while none of the member's calls is on its way goes at once, by
the plain path (``CF.run``): one client pays nothing for the grouping. A call made while one is on its way queues,
and its request gives its request slot up (sqm.request_slots.before_wait), so that other requests run and queue
beside it. When the round trip in flight ends, the first queued call's thread leads the next one: it takes every
call queued, sends them in one pipeline, hands each caller its own reply (or the error ``run`` would have raised for
it) and wakes it; the first call queued meanwhile leads the one after. N concurrent requests so share round trips,
socket reads and writes, and the CF's event-loop turns.

What a call means does not change:
- each script still runs atomically on the CF (a pipeline is not a transaction: each script is its own);
- a caller's calls stay in its order: its thread makes its next call only once the previous one answered;
- a call's refusal is its own (the other calls of the round trip still run), and so is an argument of it that no
  command carries (refused before anything of it is sent); a connection that fails is every caller's failure,
  raised to each as ``run`` raises it (redis-py's ConnectionError or TimeoutError, the same words, so
  sqm.core.cfcall.reply_lost still tells a lost reply from a refused connect: a reply lost is an unknown outcome
  for every caller of the round trip, as it would have been for each alone);
- who may write does not change: each script checks its caller's epoch itself (fencing), whatever round trip
  carries it;
- nothing that blocks is grouped: every call here is a Lua script, which never blocks the CF; a duplexed CF (whose
  calls each wait for the copy, WAIT) or a Redis Cluster, which CF.run_many drives one call at a time, is not
  grouped, nor is a connection that would send a call again on its own (a shared round trip is never sent again).
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Sequence
from typing import Any

import redis

from cfemu.cf import CF
from cfemu.redis_internals import one_attempt
from sqm.core.failpoints import failpoint
from sqm.request_slots import before_wait


class _Call:
    """One caller's call, waiting in the queue: its reply, or its error, once its round trip ended; or, woken
    without either, the lead of the next round trip."""

    __slots__ = ("op", "structure", "args", "reply", "error", "done", "lead", "wake")

    def __init__(self, op: str, structure: str, args: Sequence[Any]) -> None:
        self.op = op
        self.structure = structure
        self.args = args
        self.reply: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.lead = False
        self.wake = _thread.allocate_lock()  # held until the call is answered or handed the lead
        self.wake.acquire()


def _copy_failure(e: BaseException) -> BaseException:
    """The failure of a round trip as each of its callers gets it: an exception of its own (each thread raises and
    extends its own traceback), of the same class and words."""
    try:
        return type(e)(*e.args)
    except Exception:  # an exception class that cannot be made again from its args: the same object
        return e


# Set (to anything but ""), a member's CF calls each go in a round trip of their own: the baseline the benchmarks
# measure the grouping against (bench/bench_peers.py's sqm-service-ungrouped). Not a user's setting: grouping costs
# a lone call nothing.
UNGROUPED_ENV = "SQM_BENCH_CF_UNGROUPED"


class GroupedCF(CF):
    """A CF whose concurrent calls share round trips (see the module). ``round_trips`` and ``calls`` count what
    went to the CF this way: calls / round_trips is how many calls one round trip carried on average."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        # A connection that sends a call again on its own (a retry policy of more than one attempt: never the
        # member's, cfemu.connection) is not grouped: a shared round trip is never sent again, so each call goes
        # alone, retried as it was.
        self.groups = (self._pair is None and not self._cluster and one_attempt(client.get_retry())
                       and not os.environ.get(UNGROUPED_ENV))
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._leading = False
        self._leader = 0  # the thread inside a round trip's CF.run_many, while it is
        self.round_trips = 0
        self.calls = 0
        self.largest = 0  # the most calls one round trip carried

    def run(self, op: str, structure: str, args: Sequence[Any]) -> Any:
        if not self.groups:  # each call a round trip of its own (counted alike, unlocked: a metric)
            self.round_trips += 1
            self.calls += 1
            return super().run(op, structure, args)
        if self._leader == threading.get_ident():
            # The leader's own calls inside its round trip (CF.run_many makes a call again through run when the CF
            # had lost its script) go at once: queued, they would wait for the round trip they are part of.
            return super().run(op, structure, args)
        with self._lock:
            if self._leading:  # a round trip is in flight: wait for the next one
                queued = _Call(op, structure, args)
                self._queue.append(queued)
                call: _Call | None = queued
            else:
                self._leading = True
                call = None
        if call is None:  # nothing in flight: the plain path, at once, then whatever queued meanwhile
            try:
                return self._one(op, structure, args)
            finally:
                self._hand_on()
        before_wait()  # a service request's slot goes to another request, whose calls may join this round trip
        call.wake.acquire()  # released by the leader of its round trip, or to hand it the lead
        if not call.done:
            assert call.lead
            self._lead()
        if call.error is not None:
            raise call.error
        return call.reply

    def run_many(self, calls: Sequence[tuple[str, str, Sequence[Any]]]) -> list[Any]:
        """CF.run_many (one round trip of its own for a batch's calls), counted."""
        self.round_trips += 1
        self.calls += len(calls)
        self.largest = max(self.largest, len(calls))
        return super().run_many(calls)

    def _one(self, op: str, structure: str, args: Sequence[Any]) -> Any:
        self.round_trips += 1
        self.calls += 1
        self.largest = max(self.largest, 1)
        return super().run(op, structure, args)

    def _lead(self) -> None:
        """Run every queued call (the caller's among them) in one round trip, answer each, hand the lead on."""
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            self.round_trips += 1
            self.calls += len(batch)
            self.largest = max(self.largest, len(batch))
            self._leader = threading.get_ident()
            try:
                replies = CF.run_many(self, [(c.op, c.structure, c.args) for c in batch])  # counted above
            except BaseException as e:  # the connection failed: which calls ran is unknown, to each of them
                for c in batch:
                    c.error = _copy_failure(e)
            else:
                if len(batch) > 1:  # the CF applied every script of a shared round trip; none of its callers knows
                    failpoint("shared-cf-round-trip")
                for c, r in zip(batch, replies, strict=True):
                    if isinstance(r, BaseException):
                        c.error = r
                    else:
                        c.reply = r
        finally:  # every caller of the round trip is answered, whatever happened
            self._leader = 0
            for c in batch:
                c.done = True
                if not c.lead:  # the leader's own call: its thread is here, awake
                    c.wake.release()
            self._hand_on()

    def _hand_on(self) -> None:
        """After a round trip: the first call queued meanwhile leads the next one; with none, nobody leads."""
        with self._lock:
            if self._queue:
                nxt = self._queue[0]
                nxt.lead = True
                nxt.wake.release()
            else:
                self._leading = False


__all__ = ["UNGROUPED_ENV", "GroupedCF"]
