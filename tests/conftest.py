"""Shared fixtures: a real redis-server as the coupling facility.

* ``redis_server`` (session): an ``EmbeddedRedis`` -- or, if ``$REDIS_URL`` is set, an
  ``ExternalRedis`` for that server (same ``.url``/``.client()``; its ``kill()`` skips the test).
* ``redis_url`` (function): URL of the session server, FLUSHALLed before the test.
* ``redis_factory`` (function): ``redis_factory(**EmbeddedRedis_kwargs)`` starts a private
  server (data dir under pytest's tmp dir); all are stopped after the test.
* ``fresh_redis`` (function): a private, started ``EmbeddedRedis`` for tests that kill it.
* ``group_backup_key`` (session, autouse): the tests' group's backup key (cfemu.credentials.BackupKeys), found
  by every backup writer and reader of the suite, in-process or a command line, as a deployment's are:
  through $CFEMU_SECRETS_DIR. That directory holds the backup key only, so that nothing else the settings
  resolver finds changes (no CF password is put into a URL, no service token found). A test that runs a group
  of its own (a cluster) takes the variable out of its commands' environment: the cluster's secrets hold its key.
* ``settings_env_cleared`` (session, autouse) and ``own_working_directory`` (autouse): the suite is hermetic
  against the checkout and the shell it runs in. The settings variables of cfemu.settings are taken out of the
  environment, and the tests (their in-process resolvers and every command they start) run in an empty working
  directory of their own, so that a cluster the README's `cfemu cluster up` left in the checkout's var/ (running
  or stopped, with its logs and backups) is never found and never written to. The checkout's root is put on
  $PYTHONPATH for the commands that run ``python -m tests.support...``.
* ``started_processes_killed`` (autouse): a `sqm run` child a test started and left running (it failed before its
  stop) is killed by its pid after the test (tests.support.started_procs).
* ``signal_handlers_kept`` (autouse): a test that leaves a SIGINT or SIGTERM handler of its own (or of code it ran
  in-process) in the process fails, and the handlers it found are put back.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu import credentials, settings
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.private_files import private_dir
from tests.support.harness import HARNESS
from tests.support.started_procs import STARTED, kill_left_running

pytest_plugins = ["tests.support.tiers", "tests.support.workers"]

ROOT = Path(__file__).resolve().parents[1]
WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the handlers a test must leave as it found them

# What cfemu.settings reads from the environment, but for $REDIS_URL (this suite's own switch to an external
# server, above) and $CFEMU_SECRETS_DIR (set below, for the group's backup key).
SETTINGS_ENV = (settings.ENV_LOG_ROOT, settings.ENV_BACKUP_DIR, settings.ENV_LOG_ARCHIVE_DIR, settings.ENV_TOKEN,
                settings.ENV_OPERATOR_TOKEN, settings.ENV_CLUSTER_DIR, settings.ENV_CF_DIR,
                settings.ENV_SPARK_MASTER, settings.ENV_MEMORY_LIMIT, settings.ENV_BACKUP_SHARE,
                settings.ENV_RESTORE_WORKERS)


class ExternalRedis:
    """An externally managed server named by ``$REDIS_URL`` (not started/stopped by us)."""

    external = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.pid: int | None = None

    def client(self, **kw: Any) -> redis.Redis:
        return connect(self.url, **kw)

    def kill(self) -> None:
        pytest.skip("cannot kill an external Redis server ($REDIS_URL is set)")

    def stop(self) -> None:
        pass


class GroupCF(EmbeddedRedis):
    """The session CF, secured as the product secures a group's CF (cfemu.credentials): the default user off and
    one user per role. Tests connect as a member, the role with the fewest rights (``url``), so that a product
    command a member may not run fails here first; ``client()`` is a harness user that may FLUSHALL between tests."""

    def __init__(self, secrets_dir: Path) -> None:
        self.passwords = credentials.create(secrets_dir)
        self.harness_password = self.passwords["operator"] + "-harness"
        super().__init__(acl_users=[*credentials.acl_lines(self.passwords),
                                    f"user qsg-harness on >{self.harness_password} ~* &* +@all"])

    @property
    def url(self) -> str:
        return credentials.with_user(super().url, "member", self.passwords["member"])

    def client(self, **kwargs: Any) -> redis.Redis:
        return super().client(**{"username": "qsg-harness", "password": self.harness_password, **kwargs})


@pytest.fixture(scope="session", autouse=True)
def settings_env_cleared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Yields the directory under which each test gets its working directory."""
    with pytest.MonkeyPatch.context() as mp:
        for name in SETTINGS_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
        if str(ROOT) not in sys.path:
            mp.syspath_prepend(str(ROOT))
        cwd = tmp_path_factory.mktemp("cwd")
        mp.chdir(cwd)  # where the module and session fixtures run
        yield cwd


@pytest.fixture(autouse=True)
def own_working_directory(settings_env_cleared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tempfile.mkdtemp(prefix="test-", dir=settings_env_cleared))


@pytest.fixture(scope="session", autouse=True)
def group_backup_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[credentials.BackupKeys]:
    directory = private_dir(tmp_path_factory.mktemp("backup-key") / credentials.SECRETS_DIR)
    credentials.create_backup_key(directory)
    before = os.environ.get(credentials.ENV_SECRETS_DIR)
    os.environ[credentials.ENV_SECRETS_DIR] = str(directory)
    try:
        yield credentials.backup_keys(directory)
    finally:
        if before is None:
            os.environ.pop(credentials.ENV_SECRETS_DIR, None)
        else:
            os.environ[credentials.ENV_SECRETS_DIR] = before


@pytest.fixture(autouse=True)
def started_processes_killed() -> Iterator[None]:
    since = len(STARTED)
    yield
    kill_left_running(since)


@pytest.fixture(autouse=True)
def signal_handlers_kept() -> Iterator[None]:
    """A test (or code it runs in-process: a command's main, a scheduler) leaves the SIGINT and SIGTERM handlers
    of the process as it found them: a handler left behind turns a later test's Ctrl-C into nothing. The handlers
    are put back, and the test that changed them fails."""
    before = {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}
    yield
    changed = {sig: handler for sig, handler in before.items() if signal.getsignal(sig) is not handler}
    for sig, handler in changed.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if changed:
        pytest.fail(f"the test left its own handler of {', '.join(sig.name for sig in changed)} in the process: "
                    "put back what was there (cfemu.signals.handling)", pytrace=False)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler for the test (KeyboardInterrupt), whatever the process had: a worker that ran
    a Spark test keeps PySpark's (SparkContext installs one that cancels the context's jobs first, and with the
    context stopped that call waits longer than a test does). The process's handler is put back."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis | ExternalRedis]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield ExternalRedis(url)
        return
    srv = GroupCF(tmp_path_factory.mktemp("group") / credentials.SECRETS_DIR)
    try:
        srv.start()
        HARNESS[f"{srv.host}:{srv.port}"] = ("qsg-harness", srv.harness_password)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis | ExternalRedis) -> str:
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedRedis]]:
    started: list[EmbeddedRedis] = []

    def make(**kwargs: Any) -> EmbeddedRedis:
        kwargs.setdefault("data_dir", tmp_path_factory.mktemp("cf"))
        srv = EmbeddedRedis(**kwargs)
        started.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for srv in reversed(started):
            srv.stop()


@pytest.fixture
def fresh_redis(redis_factory: Callable[..., EmbeddedRedis]) -> EmbeddedRedis:
    return redis_factory()
