"""The local restore engine's worker processes (restore.workers): tasks run in real child processes, every result
comes back, a failure in a task is raised here as itself, a worker that dies is a clear error, a script without a
main guard can use them, no worker outlives its parent (SIGKILLed), and the setting is one clear line when bad."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cfemu.settings import MAX_RESTORE_WORKERS, default_workers, parse_workers, resolve
from restore.engine import LocalEngine
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


def test_every_result_comes_back_from_other_processes() -> None:
    with Workers(3) as pool:
        out = list(pool.map(square_and_pid, range(40)))
        pids = {p.pid for p in pool.procs}
    assert sorted(v for v, _ in out) == [x * x for x in range(40)]
    assert {pid for _, pid in out} <= pids and os.getpid() not in {pid for _, pid in out}
    assert len({pid for _, pid in out}) >= 2  # the tasks were shared out


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
