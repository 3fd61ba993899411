"""Every benchmark in bench/ runs: each script in its quickest mode, side by side, so that a stale one (one that
still calls an API or a protocol the product has since changed) fails the default suite instead of waiting for
someone to run it. The figures are not checked: on a loaded machine they mean nothing at this length.

The scripts run from a copy of bench/ in a temporary directory, so their result lines and work files stay out of
the repository; peers that would need installing (bench_peers.py's PostgreSQL and RabbitMQ) are skipped by the
script itself (--no-install) with a message and no figure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

# Each script's quickest run (default: --quick). Keep the whole test well under a minute on 2 cores.
QUICKEST: dict[str, list[str]] = {
    "bench_lifecycle.py": ["--quick", "--seconds", "0.3", "--duplex", "--socket"],
    "bench_service.py": ["--quick", "--seconds", "0.5", "--clients", "1", "2"],
    "bench_backup.py": ["--quick", "--messages", "2000", "--seconds", "0.5"],
    "bench_restore.py": ["--quick", "--sizes", "2000:4000", "--calibration-records", "2000"],
    "bench_restore_overlap.py": ["--quick", "--size", "2000:4000"],
    "bench_spark.py": ["--quick", "--sizes", "5000", "--masters", "--workers"],  # the local engine only: no JVM
    "bench_spark_floor.py": ["--quick", "--engines", "duckdb"],  # no JVM
    "bench_peers.py": ["--quick", "--seconds", "0.5", "--clients", "1", "--client-procs", "1", "--no-install"],
    "bench_uow.py": ["--quick", "--seconds", "0.3"],  # --quick is 1 round; the windows shorter still
    "bench_pubsub.py": ["--quick", "--seconds", "0.2", "--subscribers", "1", "3"],
}
TIMEOUT_S = 240


def scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("bench_*.py"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, float]]:
    """Run every script at once (each mostly waits on servers and fsyncs); name -> (exit code, output, seconds)."""
    copy = tmp_path_factory.mktemp("bench-run") / "bench"
    shutil.copytree(BENCH, copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "160"}
    procs = {}
    for name in scripts():
        out = open(copy / f"{name}.out", "wb")  # noqa: SIM115  (closed below)
        procs[name] = (subprocess.Popen([sys.executable, str(copy / name), *QUICKEST.get(name, ["--quick"])],
                                        cwd=copy.parent, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True), out, time.monotonic())
    results = {}
    deadline = time.monotonic() + TIMEOUT_S
    for name, (proc, out, t0) in procs.items():
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        out.close()
        results[name] = (rc, (copy / f"{name}.out").read_text(errors="replace"), time.monotonic() - t0)
    return results


def test_every_benchmark_has_a_quickest_mode() -> None:
    assert set(QUICKEST) <= set(scripts()), f"QUICKEST names a script that is gone: {set(QUICKEST) - set(scripts())}"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", scripts())
def test_benchmark_runs(name: str, runs: dict[str, tuple[int, str, float]]) -> None:
    rc, output, seconds = runs[name]
    assert rc == 0, f"{name} {' '.join(QUICKEST.get(name, ['--quick']))} exited {rc} after {seconds:.0f} s:\n{output[-4000:]}"


@pytest.mark.e2e
@pytest.mark.slow
def test_installed_peers_can_reach_their_files(runs: dict[str, tuple[int, str, float]]) -> None:
    """PostgreSQL and RabbitMQ run as their own users: a work directory under a private (0700) parent, as the
    repository's var/ is, made both fail to start ('Permission denied', the Erlang cookie's 'eacces'), and the
    benchmark reported them skipped instead of measuring them. An installed peer must start; one that is not
    installed is skipped with --no-install, which says so."""
    output = runs["bench_peers.py"][1]
    assert "Permission denied" not in output and "eacces" not in output, output[-4000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_benchmarks_quick_mode_keeps_the_sizes_given_with_it(runs: dict[str, tuple[int, str, float]]) -> None:
    """--quick shortens only what the command line leaves to the defaults: bench_backup runs the 2000 messages
    QUICKEST gives it, not --quick's 20k (which had made it the longest script here, three times over)."""
    assert "backup benchmark, 2000 x 1024 B" in runs["bench_backup.py"][1], runs["bench_backup.py"][1][-2000:]


def test_a_peer_that_cannot_be_had_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not installed and --no-install (or not root): Unavailable, with the reason; bench_peers then reports the
    peer as skipped, with no figure."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_peers

    monkeypatch.setattr(bench_peers.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(bench_peers.shutil, "which", lambda name: None)
    monkeypatch.setattr(bench_peers, "Path", lambda p: Path("/nonexistent") / str(p).lstrip("/"))
    with pytest.raises(bench_peers.Unavailable, match="--no-install"):
        bench_peers.pg_bin(False)
    with pytest.raises(bench_peers.Unavailable, match="--no-install"):
        bench_peers.rabbit_bin(False)
    monkeypatch.setattr(bench_peers.os, "geteuid", lambda: 1000)
    with pytest.raises(bench_peers.Unavailable, match="does not allow installing"):
        bench_peers.pg_bin(True)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_peers_benchmark_shows_the_redis_servers_own_cpu(runs: dict[str, tuple[int, str, float]]) -> None:
    """The CPU a lifecycle costs in redis-server alone (the SQM's CF, durable Redis's server) is shown apart: the
    work Redis itself does for one lifecycle, below which the SQM cannot go on the same cores (BENCHMARKS.md,
    peers). A figure for each contender with a redis-server, none for the others."""
    output = runs["bench_peers.py"][1]
    lines = output.splitlines()
    title = next(i for i, line in enumerate(lines) if "of which redis-server" in line)
    header = next(line for line in lines[title:] if line.startswith("┃"))
    row = next(line for line in lines[title:] if line.startswith("│"))
    cells = dict(zip([c.strip() for c in header.strip("┃").split("┃")],
                     [c.strip() for c in row.strip("│").split("│")], strict=True))
    assert cells["clients"] == "1"
    for name, value in cells.items():
        if name in ("redis-aof", "sqm-inproc", "sqm-service", "sqm-service-1"):
            assert value.isdigit() and int(value) > 0, (name, value)
        elif name in ("postgres", "rabbitmq"):
            assert value == "-", (name, value)
