"""The plugins of `make test` in a pytest run of their own: the tier split and the durations file (tests/support/
tiers.py), also when pytest-xdist spreads the tests over workers, and the tests that share a module fixture kept on
one worker (tests/support/workers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

@pytest.mark.slow
@pytest.mark.parametrize("n", range(3))
def test_slow(n):
    pass

@pytest.mark.parametrize("n", range(5))
def test_fast(n):
    assert n != 4

@pytest.mark.slow
@pytest.mark.xdist_group("expensive")
@pytest.mark.parametrize("n", range(2))
def test_grouped_here(n, expensive):
    pass
"""

# A module fixture, and a session fixture its group's tests need in two modules: each counts its set-ups, and
# under xdist each must be set up once. (The scope is filled in when the file is written: this module's own text
# must not read as one that shares a fixture.)
SHARED = """
import os
import pytest

@pytest.fixture(scope=SCOPE)
def shared():
    with open(os.environ["SETUPS"] + ".module", "a") as f:
        f.write(f"{os.getpid()}\\n")

@pytest.mark.slow
@pytest.mark.parametrize("n", range(6))
def test_sharing(n, shared):
    pass

@pytest.mark.slow
@pytest.mark.xdist_group("expensive")
@pytest.mark.parametrize("n", range(2))
def test_grouped_there(n, expensive):
    pass
"""

CONFTEST = """
import os
import pytest

@pytest.fixture(scope="session")
def expensive():
    with open(os.environ["SETUPS"] + ".session", "a") as f:
        f.write(f"{os.getpid()}\\n")
"""


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    xdist_group: group\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_shared.py").write_text(SHARED.replace("SCOPE", repr("module")))
    env = {**os.environ, "SETUPS": str(tmp_path / "setups"),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.tiers", "-p", "tests.support.workers",
                           "-p", "no:cacheprovider", "--durations-file=durations.txt", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    path = tmp_path / "durations.txt"
    return done, path.read_text().splitlines() if path.exists() else []


def test_the_fast_tier_leaves_out_the_slow_tests_and_records_each_test_it_ran(tmp_path: Path) -> None:
    done, lines = run(tmp_path, "--tier", "fast")
    assert done.returncode == 1 and "1 failed, 4 passed, 13 deselected" in done.stdout, done.stdout
    assert lines[0].startswith("# 5 tests,") and "on 1 worker(s)" in lines[0], lines
    rows = [line.split() for line in lines[1:]]
    assert sorted(r[3] for r in rows) == [f"test_sample.py::test_fast[{n}]" for n in range(5)]
    assert [r[1] for r in rows].count("failed") == 1


def test_under_xdist_every_workers_tests_are_recorded_once_and_groups_share_their_fixtures(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    done, lines = run(tmp_path, "-n", "3", "--tier", "slow")
    assert done.returncode == 0 and "13 passed" in done.stdout, done.stdout
    assert lines[0].startswith("# 13 tests,") and "wall time" in lines[0], lines
    rows = [line.split() for line in lines[1:]]
    assert sorted(r[3] for r in rows) == sorted(
        [f"test_sample.py::test_slow[{n}]" for n in range(3)] + [f"test_sample.py::test_grouped_here[{n}]"
                                                                 for n in range(2)]
        + [f"test_shared.py::test_sharing[{n}]" for n in range(6)] + [f"test_shared.py::test_grouped_there[{n}]"
                                                                      for n in range(2)])
    assert len({r[2] for r in rows}) > 1 and all(r[1] == "passed" for r in rows)
    # The module fixture and the group's session fixture were each set up once: their tests ran on one worker.
    assert len((tmp_path / "setups.module").read_text().split()) == 1
    assert len((tmp_path / "setups.session").read_text().split()) == 1
    assert len({r[2] for r in rows if "test_sharing" in r[3]}) == 1
    assert len({r[2] for r in rows if "test_grouped" in r[3]}) == 1


ORDERED = """
import os
import pytest

@pytest.mark.parametrize("n", range(4))
def test_order(n):
    with open(os.environ["ORDER"], "a") as f:
        f.write(f"{n}\\n")
"""


@pytest.mark.parametrize("previous", [None, {3: 50.0, 1: 2.0, 2: 1.0}])
def test_under_xdist_the_tests_longest_in_the_previous_run_are_handed_out_first(
        tmp_path: Path, previous: dict[int, float] | None) -> None:
    """The order tests are handed out in, on one worker: the previous run's durations file, longest first; a test
    it does not name counts as the mean of those it names; without one, collection order."""
    pytest.importorskip("xdist")
    (tmp_path / "test_ordered.py").write_text(ORDERED)
    if previous is not None:
        (tmp_path / "durations.txt").write_text("# header\n" + "".join(
            f"{s:9.3f}  passed   gw0   test_ordered.py::test_order[{n}]\n" for n, s in previous.items()))
    env = {**os.environ, "ORDER": str(tmp_path / "order"),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.tiers", "-p", "tests.support.workers",
                           "-p", "no:cacheprovider", "-n", "1", "--durations-file=durations.txt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout + done.stderr
    order = [int(n) for n in (tmp_path / "order").read_text().split()]
    assert order == ([0, 1, 2, 3] if previous is None else [3, 0, 1, 2])  # 0: the mean, 17.7 s
