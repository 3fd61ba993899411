"""Worker processes of the local restore engine: where the partitions of a plan are settled side by side
(restore.partitioned), one partition at a time in each.

Each worker is `python -m restore.workers`, started by this process with the same interpreter and module path,
talking over its stdin and stdout: a task is a pickled (function, item) pair, framed by its length; the reply is
("ok", result) or ("error", exception). Tasks name module-level functions, so a worker imports only what the task
needs. Plain child processes rather than multiprocessing: a `spawn` or `forkserver` pool imports the caller's
main module again in every worker (a script without a main guard would start the restore again in each), and
`fork` would copy whatever locks this process's other threads hold (a progress display's, a logging handler's).
A worker ends when its stdin closes, so one whose parent died (even SIGKILLed) ends at its next read; the pipe
is private to the two processes, which is why pickle is safe here.

A worker's streams are the task channel only: a task's own writes to descriptor 1 (a C library, a child process)
go to stderr and its reads of descriptor 0 find /dev/null, so nothing a task does can break a frame (the parent would
read stray bytes as a frame's length and wait for ever). The workers are a process group of their own: Ctrl-C reaches
the terminal's whole process group, and the parent (cfrestore, or a member running RECAUTO, which handles SIGINT
itself) decides; it stops its workers when it leaves. (Not SIG_IGN in the worker: it raised each worker's peak
memory: BENCHMARKS.md, "restore in bounded memory", "Figures behind the restore's constants".) The worker's module
path is this process's (absolute), with `-P` so that the working directory is not put ahead of it: a msgpack.py or
restore/ lying there must not replace a module. """

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from types import GeneratorType
from typing import IO, Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_HEADER = 8
_STOP_WAIT_S = 10.0


class WorkerError(RuntimeError):
    """A worker process failed in a way that carries no exception of its own (it died, or its error could not be
    sent back)."""


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(_HEADER, "big"))
    stream.write(data)  # not joined to its header: a copy of the frame (a load's batch: all its messages' data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's bytes (None: the stream ended)."""
    head = stream.read(_HEADER)
    if len(head) < _HEADER:
        return None
    n = int.from_bytes(head, "big")
    data = stream.read(n)
    return data if len(data) == n else None


def _stopped(proc: subprocess.Popen[bytes], e: BaseException) -> WorkerError:
    return WorkerError(f"a restore worker process (pid {proc.pid}) stopped: {type(e).__name__} {e}".rstrip())


def _receive(stream: IO[bytes]) -> Any:
    data = _read_frame(stream)
    if data is None:
        raise EOFError
    return pickle.loads(data)


class Workers:
    """`n` worker processes (n <= 1: none, and map() runs in this process; `processes` says otherwise: one worker
    for a stream is Workers(1, processes=1)). Use in a `with`: leaving stops them."""

    def __init__(self, n: int, *, processes: int | None = None) -> None:
        self.n = max(1, n)
        self.processes = (self.n if self.n > 1 else 0) if processes is None else processes
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()  # set when leaving: no task is handed out after it
        self._threads: list[threading.Thread] = []
        self._streaming = False

    def __enter__(self) -> Workers:
        if self.processes:
            # The same modules as here, however this process found them (a source tree on sys.path, a venv), as
            # absolute paths ('' is this process's working directory; an entry that is no path, such as an
            # editable install's path hook, stays as it is), and only those: -P keeps `-m` from putting the
            # worker's working directory first.
            path = dict.fromkeys(os.getcwd() if not p else os.path.abspath(p) if os.path.exists(p) else p
                                 for p in sys.path)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
            self._stop.clear()
            try:
                for _ in range(self.processes):
                    self.procs.append(subprocess.Popen([sys.executable, "-P", "-m", "restore.workers"],
                                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                                       process_group=0))
            except BaseException:
                self.__exit__()
                raise
        return self

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """fn(item) for every item, in the workers, results as they finish (not in the items' order). The first
        failure is raised (the other workers finish their task in hand; no new task is handed out)."""
        if not self.procs:
            if self.processes and self._stop.is_set():
                # Its processes were stopped (the `with` left) before this map began (a map consumed by another
                # thread: restore.partitioned._Background): not every task run here, in this process, instead.
                raise WorkerError("the restore's worker processes were stopped before their tasks began")
            yield from map(fn, items)
            return
        tasks = iter(items)
        lock = threading.Lock()
        results: queue.Queue[tuple[str, Any]] = queue.Queue()
        failed = threading.Event()
        stop = self._stop

        def next_task() -> tuple[bool, Any]:
            with lock:
                if failed.is_set() or stop.is_set():
                    return False, None
                for item in tasks:
                    return True, item
                return False, None

        def drive(proc: subprocess.Popen[bytes]) -> None:
            assert proc.stdin is not None and proc.stdout is not None
            try:
                while True:
                    more, item = next_task()
                    if not more:
                        break
                    _send(proc.stdin, (fn, item))
                    status, value = _receive(proc.stdout)
                    if status != "ok":
                        failed.set()
                    results.put((status, value))
                    if status != "ok":
                        break
            except BaseException as e:  # whatever it is (a dead worker, a closed pipe, a reply that does not
                # unpickle), the map must hear of it: a thread that died silently would leave it waiting for ever
                failed.set()
                results.put(("error", WorkerError(f"a restore worker process (pid {proc.pid}) stopped: "
                                                  f"{type(e).__name__} {e}".rstrip())))
            finally:
                results.put(("done", None))

        threads = [threading.Thread(target=drive, args=(p,), name=f"restore-worker-{p.pid}", daemon=True)
                   for p in self.procs]
        # Only started threads are published: leaving the `with` may run in another thread at any moment (a
        # restore's backup reader failing beside the map) and joins what it finds here
        started: list[threading.Thread] = []
        self._threads = started
        for t in threads:
            t.start()
            started.append(t)
        running = len(threads)
        error: BaseException | None = None
        try:
            while running:
                status, value = results.get()
                if status == "done":
                    running -= 1
                elif status == "ok":
                    if error is None:
                        yield value
                elif error is None:
                    error = value if isinstance(value, BaseException) else WorkerError(str(value))
        finally:
            # Also when the caller stops early (it raised, or was interrupted, while this was suspended): no new
            # task; leaving the `with` stops the workers still at one.
            failed.set()
        for t in threads:
            t.join()
        if error is not None:
            raise error

    def stream(self, fn: Callable[[T], Iterator[R]], item: T) -> Iterator[R]:
        """The items of the generator fn(item), produced in the first worker as they are read here (the pipe
        between them holds the worker back when this side does not keep up: a frame or two ahead, not the whole
        output). A failure in fn is raised here. Without workers, fn runs in this process."""
        if not self.procs:
            yield from fn(item)
            return
        proc = self.procs[0]
        assert proc.stdin is not None and proc.stdout is not None
        self._streaming = True  # until the worker says it is done: leaving early kills it (its output goes unread)
        try:
            _send(proc.stdin, (fn, item))
        except OSError as e:  # it died before the task reached it (at its start, say): a broken pipe
            raise _stopped(proc, e) from None
        while True:
            try:
                status, value = _receive(proc.stdout)
            except Exception as e:  # it died, or its pipe broke
                raise _stopped(proc, e) from None
            if status == "item":
                yield value
                continue
            self._streaming = False
            if status == "ok":
                return
            raise value if isinstance(value, BaseException) else WorkerError(str(value))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            # Left on an error, or with a map still running (its caller raised, or was interrupted, or stopped
            # reading): the workers' results would go unread, so they are not waited for (a task can take minutes,
            # and a worker still starting its interpreter on a busy machine, seconds).
            if (exc and exc[0] is not None) or self._streaming or any(t.is_alive() for t in self._threads):
                for p in self.procs:
                    p.kill()
            for p in self.procs:
                if p.stdin is not None:
                    try:
                        p.stdin.close()  # the worker's signal to end
                    except (OSError, ValueError):
                        pass
            for p in self.procs:
                try:
                    p.wait(_STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            for p in self.procs:  # interrupted while waiting: none is left running, none a zombie
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for t in self._threads:  # each ends at its worker's end of file
                if t.ident is not None:  # a thread not started yet is never joined (RuntimeError)
                    t.join(_STOP_WAIT_S)
            for p in self.procs:
                if p.stdout is not None:
                    p.stdout.close()
            self.procs, self._threads, self._streaming = [], [], False


def main() -> int:
    """A worker: run the tasks read from stdin until it closes."""
    # The task channel on descriptors of its own (not inherited by a task's children); descriptor 1 becomes
    # stderr and 0 /dev/null, so that a stray write or read (a print, a C library, a child) misses the channel.
    # A descriptor 0-2 its parent had closed (a daemon without stderr) is /dev/null first: else the duplicates
    # below would take its number, and descriptor 1 would become a copy of the task channel.
    while (fd := os.open(os.devnull, os.O_RDWR)) <= 2:
        pass
    os.close(fd)
    inp, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    if sys.stderr is None:  # Python found no descriptor 2 at its start
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115  # the process's own, for its life
    sys.stdout = sys.stderr
    while True:
        data = _read_frame(inp)
        if data is None:
            return 0
        try:
            fn, item = pickle.loads(data)  # a task naming a module this worker cannot import fails here
            del data
            result = fn(item)
            if isinstance(result, GeneratorType):  # a stream (Workers.stream): each item as it is made
                for x in result:
                    _send(out, ("item", x))
                    del x  # sent: not held while the next item is made (a load's batch: its messages' data)
                result = None
            reply: tuple[str, Any] = ("ok", result)
        except BaseException as e:  # sent back and raised there; this worker goes on
            reply = ("error", e)
        try:
            _send(out, reply)
        except (pickle.PickleError, TypeError, AttributeError):
            _send(out, ("error", WorkerError(f"{reply[0]}: {reply[1]!r} could not be sent back: "
                                             f"{traceback.format_exc(limit=1).strip()}")))


if __name__ == "__main__":
    sys.exit(main())
