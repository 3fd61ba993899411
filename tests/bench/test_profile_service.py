"""bench/profile_service.py runs, with the batched lifecycle (--batch: figures per message) and the per-thread CPU
profile of the server (--cprofile: a pstats file that pstats reads). The figures are not checked: on a loaded
machine they mean nothing at this length. Run from a copy of bench/ so that its work files stay out of the tree."""

from __future__ import annotations

import json
import os
import pstats
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_servers_context_switches_keep_those_of_threads_that_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that switched and then ended between two readings still counts: the difference of two readings
    is never negative (a server's threads come and go during a profile)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import profile_service

    switched, release = threading.Event(), threading.Event()

    def switch_often() -> None:
        for _ in range(100):
            time.sleep(0.0005)  # each sleep is a voluntary switch of this thread
        switched.set()
        release.wait()

    thread = threading.Thread(target=switch_often)
    thread.start()
    switched.wait(30)
    while_alive = profile_service.context_switches()
    release.set()
    thread.join()
    assert profile_service.context_switches() >= while_alive


@pytest.mark.slow
def test_the_batched_lifecycle_is_profiled_per_message_with_the_servers_cpu_profile(tmp_path: Path) -> None:
    copy = tmp_path / "bench"
    shutil.copytree(REPO / "bench", copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
    out = tmp_path / "server.pstats"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(copy / "profile_service.py"), "--seconds", "0.5", "--clients", "1",
                          "--batch", "3", "--slots", "2", "--cprofile", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["batch"] == 3 and figures["per"] == "message" and figures["slots"] == 2
    assert figures["lifecycles_per_s"] > 0 and figures["server_context_switches"] >= 0
    assert figures["pythonpath"] == str(REPO)
    assert figures["tree"] == str(REPO.resolve())  # the tree profiled is PYTHONPATH's, not the script's copy's
    functions = {name for (_, _, name) in pstats.Stats(str(out)).stats}  # type: ignore[attr-defined]
    assert "put_batch" in functions and "get_batch" in functions


@pytest.mark.slow
def test_the_ungrouped_baseline_sends_each_cf_call_alone(tmp_path: Path) -> None:
    """--ungrouped: the member's concurrent requests' CF calls are not grouped (the baseline of sqm.core.cfgroup),
    so no call shares a round trip with another; by default they may."""
    copy = tmp_path / "bench"
    shutil.copytree(REPO / "bench", copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    figures = []
    for flags in (["--ungrouped"], []):
        run = subprocess.run([sys.executable, str(copy / "profile_service.py"), "--seconds", "0.5", "--clients", "4",
                              *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]
        figures.append(json.loads(run.stdout.strip().splitlines()[-1]))
    ungrouped, grouped = figures
    assert (ungrouped["grouped"], ungrouped["cf_largest_round_trip"]) == (False, 0)  # no call went with another
    assert grouped["grouped"] and grouped["cf_largest_round_trip"] >= 1
    assert ungrouped["cf_round_trips"] > 0 and grouped["cf_round_trips"] > 0


def test_each_thread_is_counted_under_its_own_name_per_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads: a thread that burns CPU shows under its Python name, with its CPU per lifecycle; the digits that
    number threads of one kind are dropped, so that they add up."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import profile_service

    started, release = threading.Event(), threading.Event()

    def burn() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        started.set()
        release.wait()

    before = profile_service.thread_clocks()
    workers = [threading.Thread(target=burn, name=f"burner-{i}") for i in range(2)]
    for w in workers:
        w.start()
    started.wait(30)
    while not all(t.native_id in profile_service.thread_clocks() for t in workers):
        time.sleep(0.01)
    after = profile_service.thread_clocks()
    release.set()
    for w in workers:
        w.join()
    rows = profile_service.per_thread(before, after, 10)
    assert "burner" in rows, rows  # both threads under one name
    assert rows["burner"]["user_us"] + rows["burner"]["system_us"] >= 0.3 / 10 * 1e6  # at least 2 x 0.2 s less slack


@pytest.mark.slow
def test_the_servers_event_loop_thread_is_profiled_by_name(tmp_path: Path) -> None:
    copy = tmp_path / "bench"
    shutil.copytree(REPO / "bench", copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(copy / "profile_service.py"), "--seconds", "0.5", "--clients", "1",
                          "--one-call", "--threads"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    loop = figures["server_threads"]["QM1-loop"]  # one client: the loop begins and finishes its batches itself
    assert loop["user_us"] + loop["system_us"] > 0 and loop["voluntary"] > 0
