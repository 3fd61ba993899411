"""The bulk load: write a settled restore plan into the CF, once, pipelined.

Recovery owns the structure while it is RECOVERING (every CF script refuses work on it), so the load does not
keep the structure correct step by step (prior art IPCOM000013422): it deletes every key of the structure
except its header, writes only the survivors in pipelined batches, checks the counts, and only then rewrites
the header with state ACTIVE. A crash anywhere before that last step leaves the structure RECOVERING, and a
re-run starts again from the wipe: the load is idempotent.

Every batch is a transaction of the restore's claim (cfemu.bulk.Owner): it lands only while the header still
carries this restore's token, in the CF the claim was made on. A later restore or a purge that takes the
structure over, or a CF lost (or replaced) under the load, stops it at its next batch with bulk.NotOwnerError
(CFReplacedError), having written nothing more.

This module decides what is loaded, in which order and batches; the writes themselves (and the CF format they
write) are cfemu.bulk's.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cfemu import bulk, keys
from cfemu.admin import StructureDef
from cfemu.limits import CF_STEP_BYTES
from cfemu.progress import Progress, no_progress
from restore.engine import LOAD
from restore.interpreter import loading
from restore.partitioned import DEFAULT_MEMORY, Runs, SpilledPlan, merged_runs
from restore.plan import RestorePlan
from restore.settle import Settled
from restore.workers import Workers
from sqm.conversations.uowstatus import Control, is_control_queue
from sqm.core.failpoints import failpoint

BATCH = bulk.BATCH


class LoadVerifyError(RuntimeError):
    """The structure does not hold what the plan says after the load (it stays RECOVERING)."""


@dataclass
class LoadResult:
    entries: int = 0
    bytes: int = 0
    keys_deleted: int = 0
    batches: int = 0
    uows_in_doubt: int = 0
    seconds: float = 0.0
    # Where the load's seconds went (wall, in the loading thread): waiting for the next prepared batch, sending
    # batches (each a transaction of the owner), waiting to hand a batch's copies to the restore point's writer;
    # and the CPU seconds of the thread that prepared the batches (its source's reading included) and of the one
    # that wrote the point's copies.
    timings: dict[str, float] = field(default_factory=dict)


def batches(items: Iterable[Settled], size: int, max_bytes: int = 0) -> Iterator[list[Settled]]:
    """`items` in lists cut by the load's batch rule (cfemu.bulk.batch_full: `size` items, or fewer once their data
    reach `max_bytes`; the last list may be shorter): the load streams its survivors batch by batch."""
    chunk: list[Settled] = []
    held = 0
    for s in items:
        chunk.append(s)
        held += len(s.data)
        if bulk.batch_full(len(chunk), held, size, max_bytes):
            yield chunk
            chunk = []
            held = 0
    if chunk:
        yield chunk


def batch_bytes_for(memory: int) -> int:
    """The most message data one batch of a load holds when the restore may use `memory` bytes: about eight
    batches are held at once (DEPTH prepared ahead, bulk.LOAD_DEPTH being sent, the copies of two for the restore
    point (Beside: one being written, one waiting), and in a worker the one being made and its pickle), so a batch
    gets a sixteenth, 1 MiB at least, and at most cfemu.limits.CF_STEP_BYTES: a batch is one step of the CF, which
    no other client's call can pass while it copies the data in. Batches of a thousand messages of 4 MiB (a queue's default
    MAXMSGL) had been 4 GiB each, whatever the limit."""
    return min(max(1 << 20, memory // 16), CF_STEP_BYTES)


class Prepared:
    """The load's batches (bulk.Staged, each with the pseudo-clock floor so far: staged), made by a thread of
    their own while the previous batch is sent and applied, at most DEPTH batches ahead: the CF works on one
    batch while the next is prepared (here, or in a worker process whose output this thread reads). Iterate it in
    a `with`: leaving stops the thread."""

    DEPTH = 2

    def __init__(self, source: Iterator[tuple[bulk.Staged, int]]) -> None:
        self.source = source
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=self.DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="restore-load-prepare", daemon=True)
        self.waited_s = 0.0  # the consumer's wall seconds waiting for a batch
        self.cpu_s = 0.0  # the producing thread's CPU seconds, once it has ended

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self.source:
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the loading thread, which raises it
            self.cpu_s = time.thread_time()
            self._put(_Failed(e))
            return
        self.cpu_s = time.thread_time()
        self._put(_DONE)

    def __enter__(self) -> Prepared:
        self.thread.start()
        return self

    def __iter__(self) -> Iterator[tuple[bulk.Staged, int]]:
        while True:
            t0 = time.perf_counter()
            item = self.queue.get()
            self.waited_s += time.perf_counter() - t0
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


class Beside:
    """Hands each loaded batch's copies to `write` (the restore point's writer) in a thread of its own, at most
    DEPTH batches behind, so that the CF is sent the next batch while the point frames and checksums this one:
    done in the loading thread, between two batches, that work left the CF idle (BENCHMARKS.md, restore, seventh
    pass). Use it in a `with`: leaving it normally waits until every batch handed over is written, and raises the
    writer's failure; leaving it by an exception stops the thread after the write under way, without writing what
    is still pending. Either way the thread has ended when the `with` is left, however often Ctrl-C interrupts the
    wait: the caller aborts the point's writer next, which must not happen under a write. A failure of the writer
    also stops the load at the next batch handed over."""

    DEPTH = 1

    def __init__(self, write: Callable[[list[tuple[bytes, bytes]]], None]) -> None:
        self.write = write
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=self.DEPTH)
        self.failure: BaseException | None = None
        self.stop = threading.Event()
        # Set by the thread itself as it ends. Not Thread.join(): on Python 3.11 a join interrupted by Ctrl-C can
        # leave a thread that still runs reported as ended.
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._consume, name="restore-load-point", daemon=True)
        self.waited_s = 0.0  # the loading thread's wall seconds waiting to hand a batch over
        self.cpu_s = 0.0  # the writing thread's CPU seconds, once it has ended

    def _consume(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is _DONE or self.stop.is_set():
                    return
                if self.failure is None:
                    try:
                        self.write(item)
                    except BaseException as e:  # raised in the loading thread (put, __exit__)
                        self.failure = e
        finally:
            self.cpu_s = time.thread_time()
            self.ended.set()

    def put(self, copies: list[tuple[bytes, bytes]]) -> None:
        """Hand over one batch's copies, once the batch is in the CF (waits while DEPTH batches are pending)."""
        if self.failure is not None:
            raise self.failure
        t0 = time.perf_counter()
        self.queue.put(copies)
        self.waited_s += time.perf_counter() - t0

    def __enter__(self) -> Beside:
        self.thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._stop()
            return
        try:
            self.queue.put(_DONE)
            self.ended.wait()
            self.thread.join(1.0)  # it ends right after: what remains is its return
        except BaseException:  # Ctrl-C while the last batches are written: stop as on any other way out
            self._stop()
            raise
        if self.failure is not None:
            raise self.failure

    def _stop(self) -> None:
        """Stop the thread after the write under way, and wait until it has ended: an interrupt of the wait is
        raised once it has (the first one)."""
        self.stop.set()
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(_DONE)
        interrupted: BaseException | None = None
        while True:
            try:
                self.ended.wait()
                self.thread.join(1.0)
                break
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted


def staged(structure: str, settled: Iterable[Settled], batch: int,
           batch_bytes: int = 0) -> Iterator[tuple[bulk.Staged, int]]:
    """The load's batches of `settled` (in load order, batches: `batch` entries or `batch_bytes` of data),
    prepared (bulk.prepare), each with the pseudo-clock floor of the batches so far (PseudoClockFloor)."""
    clock = PseudoClockFloor()
    for chunk in batches(clock.watch(settled), batch, batch_bytes):
        st = bulk.prepare(structure, chunk)
        del chunk
        yield st, clock.floor
        del st  # handed on: not held while the next batch is read and prepared (it holds its messages' data)


@runtime_checkable
class StagesBatches(Protocol):
    """A plan that prepares the load's batches itself (restore.engine_columnar's, in C): staged(structure,
    plan.in_load_order(), batch, batch_bytes)'s batches, byte for byte, made its own way."""

    def staged(self, structure: str, batch: int, batch_bytes: int) -> Iterator[tuple[bulk.Staged, int]]: ...


def _staged_runs(job: tuple[str, Runs, int, int]) -> Iterator[tuple[bulk.Staged, int]]:
    """staged() of a partitioned plan's runs: a worker's task (Workers.stream)."""
    structure, runs, batch, batch_bytes = job
    return staged(structure, merged_runs(runs), batch, batch_bytes)


# Messages of this size or more, on average, are loaded from a thread of this process, never through a worker:
# the worker's batches come through a pipe, each message's data pickled, written, read and unpickled: from 4 KiB
# on, the worker gains nothing on a quiet machine and loses beside other work (BENCHMARKS.md, "restore in bounded
# memory", "Fifth pass").
STREAM_BELOW = 4 << 10
# Below this many entries the load's batches are made in a thread too: a worker process first costs its start (an
# interpreter and the restore's imports), which a small load never wins back (BENCHMARKS.md, "restore in bounded
# memory", "Fifth pass" and "Small restores"). Every restore of a few queues (RECAUTO after a CF loss, most of
# all) would pay that start.
STREAM_FROM = 50_000


def streams(plan: SpilledPlan) -> bool:
    """Whether the load merges and packs `plan`'s batches in a worker process, beside this one sending them (a
    thread here would share the GIL with the sending): a plan settled by worker processes, of STREAM_FROM small
    messages or more."""
    return (plan.workers > 1 and plan.loaded_count >= STREAM_FROM
            and plan.loaded_bytes < STREAM_BELOW * max(1, plan.loaded_count))


def restore_owned_uows(plan: RestorePlan) -> dict[str, str]:
    """Tombstones: 'C' for committed UOWs whose owner may still be completing them (its retry is then a
    no-op), 'B' for in-flight UOWs restore backed out (now or in an earlier run: a re-run writes the same)."""
    tomb = {u: "C" for u in plan.in_commit}
    tomb.update(dict.fromkeys(plan.backed_out_by_restore(), "B"))
    return tomb


def loaded_tombstones(plan: RestorePlan, base_tombstones: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tombstones a load writes (and its restore point keeps): those the base carried, and the plan's own,
    which win."""
    return {**(base_tombstones or {}), **restore_owned_uows(plan)}


class PseudoClockFloor:
    """The newest pseudo-clock stamp among the UOW statuses the load writes (sqm.conversations.uowstatus.Control.changed_pc),
    written as the structure's pseudo-clock before it is ACTIVE: a structure came back with its clock at 0 until a
    member's first sweep raised it, and a UOW sent meanwhile was stamped as made at 0 and timed out at that sweep
    (helper B's finding). The up-time between the last status change and the CF's loss is not counted."""

    def __init__(self) -> None:
        self.floor = 0

    def watch(self, settled: Iterable[Settled]) -> Iterator[Settled]:
        for s in settled:
            if s.entry is not None and is_control_queue(str(s.entry.get("q", ""))):
                with contextlib.suppress(Exception):  # a foreign entry there: restored as it is, no stamp
                    self.floor = max(self.floor, Control.unpack(s.data).changed_pc)
            yield s

    def write(self, owner: bulk.Owner, structure: str) -> None:
        if self.floor:  # w = 0: the first tick adds no gap, it only starts counting
            owner.transaction(lambda pipe: pipe.hset(keys.pclock(structure), mapping={"v": self.floor, "w": 0}))


def load_plan(owner: bulk.Owner, plan: RestorePlan, sdef: StructureDef, queues: list[str], *,
              batch: int = BATCH, batch_bytes: int = batch_bytes_for(DEFAULT_MEMORY),
              progress: Progress = no_progress, restored_from: str = "",
              base_tombstones: Mapping[str, str] | None = None, before_activate: Callable[[], None] | None = None,
              last_backup: str = "", copies_to: Callable[[list[tuple[bytes, bytes]]], None] | None = None
              ) -> LoadResult:
    """Replace the structure's content with the plan's survivors and make it ACTIVE (see the module doc), as
    `owner`, the restore's claim on the structure (cfemu.bulk.claim: the header says RECOVERING).
    base_tombstones: those the base carried (the plan's own win). before_activate: called once the load is
    verified, before the structure is ACTIVE (restore writes its restore point there, `last_backup`: the header
    names it). copies_to: given each batch's entries as loaded (descriptor as the CF holds it, data), once the
    batch is in (restore writes its restore point so, as the load goes). A batch is `batch` entries, or fewer
    once their data reach `batch_bytes` (batch_bytes_for the restore's memory limit)."""
    t0 = time.monotonic()
    S = plan.structure
    result = LoadResult()
    total = plan.loaded_total()
    expected: Counter[str] = Counter()  # list -> entries written to it (for the verify step)
    try:
        result.keys_deleted = bulk.reset(owner, sdef, batch=batch)
        loader = bulk.Loader(owner, gen=plan.restore_lrsn)
        progress(LOAD, 0, total)
        clock = PseudoClockFloor()
        spilled = plan if isinstance(plan, SpilledPlan) and streams(plan) else None
        with Workers(1, processes=1 if spilled is not None else 0) as pool, loading():
            if spilled is not None:
                source = pool.stream(_staged_runs, (S, spilled.runs(), batch, batch_bytes))
            elif isinstance(plan, StagesBatches):
                source = plan.staged(S, batch, batch_bytes)
            else:
                source = staged(S, plan.in_load_order(), batch, batch_bytes)
            point = Beside(copies_to) if copies_to is not None else None  # no thread when no point is written
            sending = 0.0

            def landed(batches: list[bulk.Staged]) -> None:
                """After each batch is in the CF: its copies to the restore point, its counts."""
                for b in batches:
                    if point is not None:
                        point.put(b.copies)
                    expected.update(b.lists)
                    result.entries += b.entries
                    result.batches += 1
                    progress(LOAD, result.entries, total)
                    failpoint("restore-load-batch")  # tests: SQM_FAILPOINTS=restore-load-batch=N dies after N

            with Prepared(source) as prepared, point or contextlib.nullcontext():
                for staged_batch, floor in prepared:
                    clock.floor = max(clock.floor, floor)
                    t_send = time.perf_counter()
                    done = loader.send(staged_batch)  # the batch may still be in flight (bulk.LOAD_DEPTH)
                    sending += time.perf_counter() - t_send
                    landed(done)
                t_send = time.perf_counter()
                done = loader.flush()
                sending += time.perf_counter() - t_send
                landed(done)
            result.timings = {"waiting_for_batches_s": prepared.waited_s, "sending_s": sending,
                              "waiting_for_point_s": point.waited_s if point is not None else 0.0,
                              "preparing_cpu_s": prepared.cpu_s, "point_cpu_s": point.cpu_s if point is not None else 0.0}
        if result.entries != total:  # a sorted run lost or cut short under the load: its merge just ends early
            raise LoadVerifyError(f"structure {S}: the load read {result.entries} entries, {total} entries in the "
                                  f"plan (left RECOVERING)")
        result.bytes = loader.bytes
        # In-doubt UOWs the structure holds though none of their work on it survived (non-persistent only) are
        # registered too, at their PREPARE's LRSN (a later backup's floor keeps it in the replay): their commit or
        # backout then completes here as a no-op instead of being refused as lost with the CF (a UOW across
        # structures stays atomic: docs/architecture.md, "Decisions that differ from the design notes").
        held = plan.in_doubt_uows()
        for u in held.keys() - loader.held.keys():
            loader.held[u] = plan.outcomes[u].lrsn
        result.uows_in_doubt = loader.finish(queues, owner=held.__getitem__,
                                             tomb=loaded_tombstones(plan, base_tombstones))
        problems = bulk.verify_counts(owner, result.entries, expected, uows=held.keys() | loader.held.keys())
        if problems:
            raise LoadVerifyError(f"structure {S} after the load: {'; '.join(problems)} (left RECOVERING)")
        if before_activate is not None:
            before_activate()
        clock.write(owner, S)
        bulk.activate(owner, sdef, gen=plan.restore_lrsn, clock=plan.restore_lrsn + 1, floor=plan.restore_lrsn,
                      entries=result.entries, nbytes=result.bytes, restored_from=restored_from,
                      last_backup=last_backup)
    except bulk.NotOwnerError as e:  # say how far the load had come
        raise type(e)(f"{e}; it had loaded {result.entries} of {total} entries") from e
    result.seconds = time.monotonic() - t0
    return result

