"""A pytest plugin for runs spread over pytest-xdist workers (`make test` runs each tier with ``-n N``;
tests/conftest.py loads it).

Under ``-n N`` (xdist's default ``--dist load``) the tests are handed out by ``GroupScheduling``, in units: one unit
per group, one per test otherwise. A test is in a group

* named by its ``xdist_group`` mark: the tests that need one expensive thing set up in their worker's process (the
  in-process Spark session: starting a JVM and warming it up costs about a minute of CPU on a loaded machine,
  for each worker that would otherwise start one);
* or named after its module, when it uses a fixture wider than one test but narrower than the session (scope
  module, class or package: a group of processes, a server, every benchmark run at once), so that the fixture is
  set up once, as in a serial run, instead of once on every worker that gets one of its tests.

Units are handed out as workers free up, the longest first: a unit's length is the sum of its tests' durations in
the tier's durations file of the previous run (``--durations-file``, tests/support/tiers.py; a test it does not name
counts as the mean of those it does), so that no worker is left alone with a long test at the end of the run while
the others stand idle. Without that file: the larger units first (xdist's scope scheduling), then the single tests in
their collection order. Each worker has its own session fixtures (the group's CF), temporary directories and so
ports.

(xdist's own ``--dist loadgroup`` reads the same mark, but with pytest 9.2 it groups nothing: it renames the node
id through an attribute that pytest no longer reads. Here each worker writes the groups it collected to a file that
the controller names, and the controller's scheduler reads it.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

GROUPS_FILE = "tests_groups_file"  # the workerinput key naming the file
SHARED_SCOPES = ("module", "class", "package")
_groups_path = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str | None:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if names:
        return "+".join(names)
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(d.scope in SHARED_SCOPES for defs in info.name2fixturedefs.values() for d in defs):
        return item.nodeid.split("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook sends the collection to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = getattr(session.config, "workerinput", None)
    if not workerinput or GROUPS_FILE not in workerinput:
        return
    path = Path(workerinput[GROUPS_FILE])
    groups = {item.nodeid: g for item in session.items if (g := group_of(item)) is not None}
    tmp = path.with_name(f"{path.name}.{workerinput['workerid']}")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # every worker collects the same tests: any one's file will do


def previous_durations(config: pytest.Config) -> dict[str, float]:
    """Node id -> seconds, from the durations file this run will write, as the previous run left it (empty when
    there is none, or it cannot be read)."""
    path = config.getoption("durations_file", None)
    if not path:
        return {}
    durations: dict[str, float] = {}
    try:
        with (config.invocation_params.dir / path).open() as f:
            for line in f:
                fields = line.split(None, 3)  # seconds, outcome, worker, node id (which may hold spaces)
                if len(fields) == 4 and not line.startswith("#"):
                    durations[fields[3].rstrip("\n")] = float(fields[0])
    except (OSError, ValueError):
        return {}
    return durations


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_groups_path, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # xdist not installed: nothing more to do
    pass
else:
    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with the units above."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.groups_path = config.stash[_groups_path]
            self.groups: dict[str, str] | None = None
            self.ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(self.groups_path.read_text()) if self.groups_path.exists() else {}
            group = self.groups.get(nodeid)
            return nodeid if group is None else f"group:{group}"

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first call: every unit is in the queue
                self.ordered = True
                expected = previous_durations(self.config)
                if expected:
                    unknown = sum(expected.values()) / len(expected)
                    units = sorted(self.workqueue.items(),  # stable: equal lengths keep xdist's order
                                   key=lambda unit: -sum(expected.get(t, unknown) for t in unit[1]))
                    self.workqueue.clear()
                    self.workqueue.update(units)
            super()._assign_work_unit(node)

    def pytest_configure_node(node: Any) -> None:
        config = node.config
        if _groups_path not in config.stash:
            config.stash[_groups_path] = Path(tempfile.mkdtemp(prefix="pytest-groups-")) / "groups.json"
        node.workerinput[GROUPS_FILE] = str(config.stash[_groups_path])

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "load":
            return None  # an explicit --dist other than load is xdist's own
        return GroupScheduling(config, log)
