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
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
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
    stream.write(len(data).to_bytes(_HEADER, "big") + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER)
    if len(head) < _HEADER:
        raise EOFError
    n = int.from_bytes(head, "big")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class Workers:
    """`n` worker processes (n <= 1: none, and map() runs in this process). Use in a `with`: leaving stops them."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Workers:
        if self.n > 1:
            # The same modules as here, however this process found them (a source tree on sys.path, a venv).
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            try:
                for _ in range(self.n):
                    self.procs.append(subprocess.Popen([sys.executable, "-m", "restore.workers"],
                                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
            except BaseException:
                self.__exit__()
                raise
        return self

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """fn(item) for every item, in the workers, results as they finish (not in the items' order). The first
        failure is raised (the other workers finish their task in hand; no new task is handed out)."""
        if not self.procs:
            yield from map(fn, items)
            return
        tasks = iter(items)
        lock = threading.Lock()
        results: queue.Queue[tuple[str, Any]] = queue.Queue()
        failed = threading.Event()

        def next_task() -> tuple[bool, Any]:
            with lock:
                if failed.is_set():
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
            except (EOFError, OSError, pickle.PickleError) as e:
                failed.set()
                results.put(("error", WorkerError(f"a restore worker process (pid {proc.pid}) stopped: "
                                                  f"{type(e).__name__} {e}".rstrip())))
            results.put(("done", None))

        threads = [threading.Thread(target=drive, args=(p,), name=f"restore-worker-{p.pid}", daemon=True)
                   for p in self.procs]
        for t in threads:
            t.start()
        running = len(threads)
        error: BaseException | None = None
        while running:
            status, value = results.get()
            if status == "done":
                running -= 1
            elif status == "ok":
                if error is None:
                    yield value
            elif error is None:
                error = value if isinstance(value, BaseException) else WorkerError(str(value))
        for t in threads:
            t.join()
        if error is not None:
            raise error

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()  # the worker's signal to end
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []


def main() -> int:
    """A worker: run the tasks read from stdin until it closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not break the reply stream
    while True:
        try:
            fn, item = _receive(inp)
        except EOFError:
            return 0
        try:
            reply: tuple[str, Any] = ("ok", fn(item))
        except BaseException as e:  # sent back and raised there; this worker goes on
            reply = ("error", e)
        try:
            _send(out, reply)
        except (pickle.PickleError, TypeError, AttributeError):
            _send(out, ("error", WorkerError(f"{reply[0]}: {reply[1]!r} could not be sent back: "
                                             f"{traceback.format_exc(limit=1).strip()}")))


if __name__ == "__main__":
    sys.exit(main())
