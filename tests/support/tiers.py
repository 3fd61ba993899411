"""A pytest plugin for the default suite's two tiers and their durations (tests/conftest.py loads it).

* ``--tier fast`` runs the tests not marked ``slow``, ``--tier slow`` the others, ``--tier timed`` the tests marked
  ``timed`` (they assert a response time or a throughput, so `make test` runs them last, one at a time, in one
  process: on workers they would measure the other workers' load); the fast and slow tiers leave the timed tests
  out. It narrows whatever ``-m``
  selects (by default addopts' ``-m``, which leaves out the opt-in markers), so that the two tiers of `make test`
  are exactly the default suite, split, and the list of opt-in markers stays in one place (pyproject.toml).
* ``--durations-file=PATH`` (one word: given as two, an existing PATH is taken by pytest, before this plugin is
  loaded, for the tests to run) writes every test's duration (setup, call and teardown together) to PATH, slowest
  first, under a header with the count and the sum. `make test` writes var/test-durations-fast.txt and
  var/test-durations-slow.txt; ``--durations=30`` in addopts prints the slowest of every run. Under pytest-xdist
  (``-n N``) the file is written by the controller alone, which gets every worker's reports; each row names the
  worker that ran the test, and the header the wall time, so that the sum and the wall time can be compared.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest

TIERS = ("fast", "slow", "timed")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default=None,
                     help="only the tests not marked slow (fast), only those marked slow (slow), or only those "
                          "marked timed (timed); fast and slow leave the timed ones out")
    parser.addoption("--durations-file", metavar="PATH", default=None,
                     help="write each test's duration (setup + call + teardown), slowest first, to PATH")


class _Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}
        self.worker: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.seconds[nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcome.setdefault(nodeid, report.outcome)
        node = getattr(report, "node", None)  # set by pytest-xdist on the reports a worker sends
        self.worker[nodeid] = getattr(getattr(node, "gateway", None), "id", "-")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        rows = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        total = sum(self.seconds.values())
        wall = time.monotonic() - self.started
        workers = len(set(self.worker.values()) - {"-"}) or 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as out:
            out.write(f"# {len(rows)} tests, {total:.1f} s in all (setup + call + teardown), {wall:.1f} s of wall "
                      f"time (collection included) on {workers} worker(s), slowest first\n")
            for nodeid, seconds in rows:
                out.write(f"{seconds:9.3f}  {self.outcome.get(nodeid, 'passed'):7}  {self.worker[nodeid]:4}  "
                          f"{nodeid}\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("durations_file")
    if path and not hasattr(config, "workerinput"):  # an xdist worker's reports reach the controller's recorder
        # Relative to where pytest was started (the tests may change their working directory).
        config.pluginmanager.register(_Recorder(config.invocation_params.dir / path), "durations-file")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("tier")
    if tier is None:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("timed") is not None:
            wanted = tier == "timed"
        else:
            wanted = tier != "timed" and (item.get_closest_marker("slow") is not None) == (tier == "slow")
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
