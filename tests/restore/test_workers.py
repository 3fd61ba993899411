"""The local restore engine's worker processes (restore.workers): tasks run in real child processes, every result
comes back, a failure in a task is raised here as itself, a worker that dies is a clear error, a script without a
main guard can use them, no worker outlives its parent (SIGKILLed), and the setting is one clear line when bad."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.settings import MAX_RESTORE_WORKERS, default_workers, parse_workers, resolve
from restore.engine import LocalEngine, get_engine
from restore.workers import WorkerError, Workers

ROOT = Path(__file__).resolve().parents[2]


def square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is refused")
    return x


def die(x: int) -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    return x


def counted(n: int) -> Iterator[tuple[int, int]]:
    for i in range(n):
        yield i, os.getpid()


def counted_then_fail(n: int) -> Iterator[int]:
    yield from range(n)
    raise ValueError(f"failed after {n}")


def endless(_: int) -> Iterator[bytes]:
    while True:
        yield bytes(1 << 16)


def test_a_stream_comes_in_order_from_one_worker_and_its_error_after_its_items() -> None:
    with Workers(1, processes=1) as pool:
        assert len(pool.procs) == 1
        out = list(pool.stream(counted, 500))
        assert [i for i, _ in out] == list(range(500))
        assert {pid for _, pid in out} == {pool.procs[0].pid}
        got: list[int] = []
        with pytest.raises(ValueError, match="failed after 3"):
            got.extend(pool.stream(counted_then_fail, 3))
        assert got == [0, 1, 2]
        assert [i for i, _ in pool.stream(counted, 2)] == [0, 1]  # the worker goes on after a failed stream
    with Workers(1) as pool:  # no worker process: the stream runs here
        assert {pid for _, pid in pool.stream(counted, 3)} == {os.getpid()}


def test_a_stream_left_unfinished_does_not_keep_its_worker() -> None:
    """The load stops after a batch (another restore took the structure over): the worker, blocked writing what
    nobody reads, is stopped when the pool is left, at once."""
    with Workers(1, processes=1) as pool:
        proc = pool.procs[0]
        stream = pool.stream(endless, 0)
        next(stream)
        left = time.monotonic()  # timed from here: a worker's start on a loaded machine is not what is asked
    assert proc.poll() is not None and time.monotonic() - left < 5


def test_every_result_comes_back_from_other_processes() -> None:
    with Workers(3) as pool:
        out = list(pool.map(square_and_pid, range(40)))
        pids = {p.pid for p in pool.procs}
    assert sorted(v for v, _ in out) == [x * x for x in range(40)]
    assert {pid for _, pid in out} <= pids and os.getpid() not in {pid for _, pid in out}
    assert len({pid for _, pid in out}) >= 2  # the tasks were shared out


def test_a_map_begun_after_the_workers_stopped_is_refused_not_run_here() -> None:
    """A map created inside the `with` but first iterated after it (by another thread: the partitioned plan's
    reader of the logs, restore.partitioned._Background) must not run every task in this process instead."""
    with Workers(2) as pool:
        late = pool.map(square_and_pid, range(3))
    with pytest.raises(WorkerError, match="stopped before their tasks began"):
        next(late)


def test_workers_left_on_an_error_are_killed_not_waited_for() -> None:
    """Leaving the `with` on an error (a restore's backup failing at its first frame, before a task was handed out)
    kills the workers at once: waiting for them to reach their end of file would wait for their interpreters to
    start, seconds on a busy machine."""
    with pytest.raises(RuntimeError, match="the backup failed"), Workers(2) as pool:
        procs = list(pool.procs)
        raise RuntimeError("the backup failed")
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


def test_one_worker_is_this_process() -> None:
    with Workers(1) as pool:
        assert [pid for _, pid in pool.map(square_and_pid, range(3))] == [os.getpid()] * 3
        assert pool.procs == []


def test_a_task_error_is_raised_here_as_itself() -> None:
    with Workers(2) as pool, pytest.raises(ValueError, match="three is refused"):
        list(pool.map(fail_on_three, range(10)))


def test_a_worker_that_dies_is_a_clear_error_and_none_is_left() -> None:
    with Workers(2) as pool:
        procs = list(pool.procs)
        with pytest.raises(WorkerError, match="restore worker process .* stopped"):
            list(pool.map(die, range(4)))
    assert all(p.poll() is not None for p in procs)


def test_workers_end_with_their_parent_even_when_it_is_sigkilled(tmp_path: Path) -> None:
    """A parent SIGKILLed in the middle of a plan leaves no worker behind: each ends at its next read."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from restore.workers import Workers
        with Workers(2) as pool:
            print(" ".join(str(p.pid) for p in pool.procs), flush=True)
            time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by init) has ended too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_script_without_a_main_guard_can_plan_with_workers(tmp_path: Path) -> None:
    """A multiprocessing pool (spawn, forkserver) would run such a script again in each worker, which then fails;
    the engine's workers import only the task's own module."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.restore.test_workers import square_and_pid
        from restore.workers import Workers
        with Workers(2) as pool:
            print(sorted(v for v, _ in pool.map(square_and_pid, range(5))))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4, 9, 16]"


def test_the_workers_setting() -> None:
    assert 1 <= default_workers() <= 4
    assert parse_workers(None) == parse_workers("") == default_workers()
    assert parse_workers("3") == 3
    for bad, why in (("0", "between 1"), ("x", "not a number"), (str(MAX_RESTORE_WORKERS + 1), "between 1")):
        with pytest.raises(ValueError, match=why) as e:
            parse_workers(bad, what="--workers")
        assert "\n" not in str(e.value) and "--workers" in str(e.value)
    assert resolve(workers="2", env={}).restore_workers() == 2
    assert resolve(env={"CFEMU_RESTORE_WORKERS": "3"}).restore_workers() == 3
    with pytest.raises(ValueError, match=r"\$CFEMU_RESTORE_WORKERS"):
        resolve(env={"CFEMU_RESTORE_WORKERS": "many"}).restore_workers()
    with pytest.raises(ValueError, match="at least 1"):
        LocalEngine(workers=0)


@pytest.mark.parametrize("engine", ["local", "columnar"])
def test_an_engine_in_bounded_memory_refuses_no_memory_or_no_workers(engine: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^the restore memory limit must be positive, not 0$"):
        get_engine(engine, memory=0)
    with pytest.raises(ValueError, match="^the restore workers must be at least 1, not -1$"):
        get_engine(engine, workers=-1)
    made = get_engine(engine, memory=1 << 20, work_dir=tmp_path, workers=None)
    assert (made.memory, made.work_dir, made.workers) == (1 << 20, tmp_path, default_workers())


def test_cfrestore_refuses_bad_workers_in_one_line(tmp_path: Path) -> None:
    """Refused before it connects or reads anything: one line on stderr, exit status 2."""
    out = subprocess.run([sys.executable, "-m", "restore.cli", "run", "APP1", "--workers", "0",
                          "--redis-url", "redis://127.0.0.1:1", "--log-root", str(tmp_path / "l"),
                          "--backup-dir", str(tmp_path / "b")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "--workers: '0' is not between 1 and" in out.stderr
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------ the workers under adverse conditions


def scribble_then_square(x: int) -> int:
    """A task that writes to file descriptor 1 below sys.stdout (as a C library or a child process would) and
    reads descriptor 0: neither may reach the task stream."""
    os.write(1, b"stray output from a task\n")
    os.read(0, 64)
    return x * x


def test_a_task_writing_to_fd_1_or_reading_fd_0_breaks_no_stream() -> None:
    # In a process of its own: a broken stream hangs the parent (a stray 8 bytes read as a frame's length).
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.restore.test_workers import scribble_then_square
        from restore.workers import Workers
        with Workers(2) as pool:
            print(sorted(pool.map(scribble_then_square, range(6))))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4, 9, 16, 25]"
    assert "stray output from a task" in out.stderr  # went to stderr, where a worker's diagnostics go


def where_is_msgpack(_: int) -> str:
    import msgpack
    return str(msgpack.__file__)


def test_a_file_in_the_working_directory_shadows_no_module_in_a_worker(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working directory first on a worker's path: a msgpack.py (or restore/) lying in the
    directory a restore runs in must not replace the module this process uses."""
    import msgpack
    (tmp_path / "msgpack.py").write_text("raise ImportError('the msgpack.py of the working directory')\n")
    # What `-m` adds, not what this process has: a pytest-xdist worker runs with '' (its working directory) on its
    # own path, which the workers rightly inherit; a program started as a script or with -m has no such entry.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p])
    monkeypatch.chdir(tmp_path)
    with Workers(2) as pool:
        assert set(pool.map(where_is_msgpack, range(4))) == {msgpack.__file__}


def quick_first_then_slow(x: int) -> int:
    if x:
        time.sleep(30)
    return x


class _Stop(Exception):
    pass


def test_a_consumer_that_stops_early_stops_the_workers_at_once_and_leaves_no_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller raises on the first result (an interrupt, a failed step): the workers still at a task are not
    waited for, none is handed another task, and no thread of the map is left or dies with an error."""
    import threading
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: thread_errors.append(a.exc_value))
    with pytest.raises(_Stop):
        with Workers(2) as pool:
            procs = list(pool.procs)
            for _ in pool.map(quick_first_then_slow, range(8)):
                stopped = time.monotonic()  # timed from here: the workers' start is not what is asked
                raise _Stop
    assert time.monotonic() - stopped < 8  # not the 30 s of the task still running
    assert all(p.poll() is not None for p in procs)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.name.startswith("restore-worker-") for t in threading.enumerate()):
        time.sleep(0.05)
    assert [t for t in threading.enumerate() if t.name.startswith("restore-worker-")] == []
    assert thread_errors == []


def test_ctrl_c_at_the_parent_is_left_to_the_parent() -> None:
    """Ctrl-C reaches the terminal's whole process group, and a member (sqm run) that runs RECAUTO handles SIGINT
    itself: the workers must not turn it into a KeyboardInterrupt raised in the parent's restore."""
    script = textwrap.dedent(f"""
        import signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        signal.signal(signal.SIGINT, lambda *_: print("parent: SIGINT, handled", file=sys.stderr))
        from restore.workers import Workers
        with Workers(2) as pool:
            print("started", flush=True)
            print(list(pool.map(time.sleep, [1.5] * 4)), flush=True)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "started"
        time.sleep(0.5)
        os.killpg(parent.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
        out, err = parent.communicate(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 0, err
    assert out.strip() == "[None, None, None, None]" and "KeyboardInterrupt" not in err


def passed_through(x: object) -> object:
    return x


def test_a_task_that_cannot_be_unpickled_is_an_error_and_the_worker_goes_on() -> None:
    """An item naming a module only this process has: the worker answers with the import error (it does not die
    with a traceback and leave a bare 'stopped')."""
    only_here = types.ModuleType("restore_review_only_here")
    only_here._thing = _thing  # type: ignore[attr-defined]
    _thing.__module__ = only_here.__name__
    sys.modules[only_here.__name__] = only_here
    try:
        with Workers(2) as pool:
            procs = list(pool.procs)
            with pytest.raises(ImportError, match="restore_review_only_here"):
                list(pool.map(passed_through, [_thing]))
            assert all(p.poll() is None for p in procs)  # still there for the next map
            assert sorted(v for v, _ in pool.map(square_and_pid, range(4))) == [0, 1, 4, 9]
    finally:
        del sys.modules[only_here.__name__]


def _thing() -> None:
    pass


@pytest.mark.slow
def test_workers_of_a_parent_without_stderr_still_work() -> None:
    """A parent started with descriptor 2 closed (a daemon): its workers start and answer all the same."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.restore.test_workers import scribble_then_square
        from restore.workers import Workers
        with Workers(2) as pool:
            print(sorted(pool.map(scribble_then_square, range(4))))
    """)
    out = subprocess.run(["sh", "-c", 'exec "$0" -c "$1" 2>&-', sys.executable, script], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0
    assert out.stdout.strip() == "[0, 1, 4, 9]"


def test_leaving_while_another_thread_still_starts_the_map_s_threads_joins_only_those_started() -> None:
    """A restore's backup reader fails beside a map that is still starting its threads: leaving the `with` (in the
    reader's thread) meets a thread not started yet, and must not raise joining it (RuntimeError) over the
    reader's own error."""
    pool = Workers(2)
    with pool:
        pool._threads = [threading.Thread(target=lambda: None, name="restore-worker-not-started")]
    assert pool._threads == [] and pool.procs == []
