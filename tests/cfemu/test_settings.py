"""The one settings resolver (cfemu.settings): flag > environment > nearest cluster > `cfemu cf start` CF > default.

The layers are built by hand in a temporary directory: a cluster.json as qsg.local_group writes it and a CF
directory as `cfemu cf start` leaves it, each naming this test process's pid as the running CF (any live pid
will do: the resolver only asks whether it runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cfemu import credentials, settings
from cfemu.embedded import PID_NAME, STATE_NAME, URL_NAME
from cfemu.private_files import private_dir, write_private
from cfemu.settings import (
    CF_DIR,
    CLUSTER,
    CLUSTER_BACKUP_DIR,
    CLUSTER_CF,
    CLUSTER_CF_SOCKET,
    CLUSTER_FILE,
    CLUSTER_LOG_ARCHIVE_DIR,
    CLUSTER_LOG_ROOT,
    CLUSTER_REDIS_URL,
    DEFAULT,
    ENV,
    FLAG,
    operator_token,
    resolve,
)

LIVE_PID = os.getpid()
DEAD_PID = 2**22 + 1  # above the kernel's pid_max: never a live process


def write_cluster(d: Path, *, cf_pid: int | None = LIVE_PID) -> Path:
    d.mkdir(parents=True)
    (d / CLUSTER_FILE).write_text(json.dumps({
        CLUSTER_REDIS_URL: "redis://cluster:1/0", CLUSTER_LOG_ROOT: str(d / "logs"),
        CLUSTER_BACKUP_DIR: str(d / "backups"), CLUSTER_LOG_ARCHIVE_DIR: str(d / "archive"),
        CLUSTER_CF: {"pid": cf_pid}}))
    secrets_dir = d / credentials.SECRETS_DIR
    private_dir(secrets_dir)
    write_private(secrets_dir / "service.token", b"cluster-token")
    return d


def write_cf(d: Path, pid: int = LIVE_PID) -> Path:
    d.mkdir(parents=True)
    (d / URL_NAME).write_text("redis://cf-dir:2/0\n")
    (d / PID_NAME).write_text(f"{pid}\n")
    return d


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A working directory holding a cluster in var/cluster and a `cfemu cf start` CF in var/cf."""
    home = tmp_path / "home"
    write_cluster(home / "var" / "cluster")
    write_cf(home / "var" / "cf")
    return home


ENV_ALL = {"REDIS_URL": "redis://env:3/0", "CFEMU_LOG_ROOT": "/env/logs", "CFEMU_BACKUP_DIR": "/env/backups",
           "SQM_TOKEN": "env-token", "CFEMU_LOG_ARCHIVE_DIR": "/env/archive"}


def test_flag_beats_environment_beats_cluster(home: Path) -> None:
    flags = resolve(redis_url="redis://flag:4/0", log_root="/flag/logs", backup_dir="/flag/backups",
                    token="flag-token", log_archive_dir="/flag/archive", env=ENV_ALL, cwd=home)
    assert (flags.redis_url, flags.log_root, flags.backup_dir, flags.token) == (
        "redis://flag:4/0", Path("/flag/logs"), Path("/flag/backups"), "flag-token")
    assert set(flags.sources.values()) == {FLAG} and flags.log_archive_dir == Path("/flag/archive")

    env = resolve(env=ENV_ALL, cwd=home)
    assert (env.redis_url, env.log_root, env.backup_dir, env.token) == (
        "redis://env:3/0", Path("/env/logs"), Path("/env/backups"), "env-token")
    assert set(env.sources.values()) == {ENV} and env.log_archive_dir == Path("/env/archive")


def test_cluster_beats_cf_dir_beats_default(home: Path, tmp_path: Path) -> None:
    s = resolve(env={}, cwd=home)
    cluster = home / "var" / "cluster"
    assert (s.redis_url, s.log_root, s.backup_dir, s.token) == (
        "redis://cluster:1/0", cluster / "logs", cluster / "backups", "cluster-token")
    assert set(s.sources.values()) == {CLUSTER} and s.cluster_dir == cluster.resolve()
    assert s.log_archive_dir == cluster / "archive"

    (cluster / CLUSTER_FILE).unlink()
    s = resolve(env={}, cwd=home)
    assert s.redis_url == "redis://cf-dir:2/0" and s.sources["redis_url"] == CF_DIR
    assert (s.log_root, s.backup_dir, s.token) == (Path("var/logs"), Path("var/backups"), None)
    assert s.sources["log_root"] == s.sources["backup_dir"] == DEFAULT and s.cluster_dir is None
    assert s.log_archive_dir is None  # no default: each member archives into its own log directory

    empty = tmp_path / "empty"
    empty.mkdir()
    s = resolve(env={}, cwd=empty)
    assert s.redis_url is None and s.sources["redis_url"] == DEFAULT


def test_a_cluster_or_cf_directory_that_records_its_cfs_socket_gives_the_socket(home: Path) -> None:
    """A process that finds the CF through its cluster or its `cfemu cf start` directory runs on the CF's host:
    it takes the CF's Unix-domain socket where the CF recorded one (cfemu.embedded, unix_socket)."""
    cluster = home / "var" / "cluster"
    state = json.loads((cluster / CLUSTER_FILE).read_text())
    state[CLUSTER_CF][CLUSTER_CF_SOCKET] = "/run/group/cf.sock"
    (cluster / CLUSTER_FILE).write_text(json.dumps(state))
    assert resolve(env={}, cwd=home).redis_url == "unix:///run/group/cf.sock?db=0"
    (cluster / CLUSTER_FILE).unlink()
    (home / "var" / "cf" / STATE_NAME).write_text(json.dumps({"unix_socket": "/run/cf/cf.sock"}))
    s = resolve(env={}, cwd=home)
    assert s.redis_url == "unix:///run/cf/cf.sock?db=0" and s.sources["redis_url"] == CF_DIR


def test_the_directory_asked_about_is_the_only_one_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve(cwd=D) finds nothing that is not in D or above it: not the cluster and CF of the process's own
    working directory (a checkout where the README's `cfemu cluster up` was run)."""
    here = tmp_path / "checkout"
    write_cluster(here / "var" / "cluster")
    write_cf(here / "var" / "cf")
    monkeypatch.chdir(here)
    empty = tmp_path / "empty"
    empty.mkdir()
    s = resolve(env={}, cwd=empty)
    assert (s.redis_url, s.cluster_dir, s.secrets_dir, s.token) == (None, None, None, None)
    assert resolve(env={}).redis_url == "redis://cluster:1/0"  # from where it runs: the nearest cluster, as before


def test_a_stopped_cluster_gives_its_logs_and_backups_but_not_its_cf(tmp_path: Path) -> None:
    write_cluster(tmp_path / "var" / "cluster", cf_pid=None)
    s = resolve(env={}, cwd=tmp_path)
    assert s.redis_url is None
    assert s.log_root == tmp_path / "var" / "cluster" / "logs"
    write_cf(tmp_path / "var" / "cf", pid=DEAD_PID)  # a CF that died without cleaning up: not found either
    assert resolve(env={}, cwd=tmp_path).redis_url is None


def test_the_nearest_cluster_is_found_from_below(home: Path) -> None:
    below = home / "a" / "b"
    below.mkdir(parents=True)
    s = resolve(env={}, cwd=below)
    assert s.redis_url == "redis://cluster:1/0" and s.cluster_dir == (home / "var" / "cluster").resolve()


def test_cluster_dir_by_flag_or_environment(home: Path, tmp_path: Path) -> None:
    other = write_cluster(tmp_path / "elsewhere")
    assert resolve(cluster_dir=other, env={}, cwd=home).log_root == other / "logs"
    assert resolve(env={"CFEMU_CLUSTER_DIR": str(other)}, cwd=home).log_root == other / "logs"
    # A named directory without a cluster is no cluster: the next layers answer, not var/cluster.
    s = resolve(cluster_dir=tmp_path / "nothing", env={}, cwd=home)
    assert s.sources["log_root"] == DEFAULT and s.redis_url == "redis://cf-dir:2/0"
    cf = write_cf(tmp_path / "cf2")
    (cf / URL_NAME).write_text("redis://cf2:5/0")
    assert resolve(cluster_dir=tmp_path / "nothing", cf_dir=cf, env={}, cwd=home).redis_url == "redis://cf2:5/0"
    assert resolve(cluster_dir=tmp_path / "nothing", env={"CFEMU_CF_DIR": str(cf)}, cwd=home).redis_url == (
        "redis://cf2:5/0")


def test_settings_env_hands_the_same_settings_to_a_child(home: Path, tmp_path: Path) -> None:
    mine = resolve(backup_dir="/flag/backups", env={}, cwd=home)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    child = resolve(env=mine.env(), cwd=elsewhere)  # a child started anywhere resolves what its parent did
    assert (child.redis_url, child.log_root, child.backup_dir, child.token, child.cluster_dir) == (
        mine.redis_url, mine.log_root, mine.backup_dir, mine.token, mine.cluster_dir)


def test_defaults_agree_with_every_cli() -> None:
    from backup import cli as backup_cli
    from restore import cli as restore_cli
    from sqm import cli as sqm_cli

    for parser, argv in ((backup_cli.build_parser(), ["run", "S"]), (restore_cli.build_parser(), ["run", "S"]),
                         (sqm_cli.build_parser(), ["log", "print", "--all"]),
                         (sqm_cli.build_parser(), ["run", "--name", "QM1"])):
        args = parser.parse_args(argv)
        # No CLI decides a default of its own: an absent flag is None and the resolver decides.
        assert all(getattr(args, name, None) is None for name in ("redis_url", "log_root", "backup_dir"))
    assert Path("var/logs") == settings.DEFAULT_LOG_ROOT and Path("var/backups") == settings.DEFAULT_BACKUP_DIR


def test_each_command_finds_the_service_token_of_its_role(home: Path) -> None:
    """cfemu (the operator's CF role) takes the operator's token, every other command the application's; cfemu
    falls back to the application's, with its rights, when no operator token is to be found."""
    secrets_dir = home / "var" / "cluster" / credentials.SECRETS_DIR
    assert (resolve(env={}, cwd=home).token, resolve(env={}, cwd=home).token_role) == ("cluster-token",
                                                                                       "application")
    write_private(secrets_dir / "operator.token", b"operator-token")
    ops = resolve(env={}, cwd=home)
    assert (ops.token, ops.token_role) == ("operator-token", "operator")
    assert ops.env()["SQM_OPERATOR_TOKEN"] == "operator-token" and "SQM_TOKEN" not in ops.env()
    app = resolve(role="member", env={}, cwd=home)
    assert (app.token, app.token_role) == ("cluster-token", "application")
    assert operator_token(app, env={}) == "operator-token"
    assert resolve(env={"SQM_OPERATOR_TOKEN": "env-op"}, cwd=home).token == "env-op"
    assert resolve(role="backup", env={"SQM_OPERATOR_TOKEN": "env-op", "SQM_TOKEN": "env-app"},
                   cwd=home).token == "env-app"


def test_the_spark_master_is_the_flag_else_the_environment_else_the_clusters_running_master(tmp_path: Path) -> None:
    """cfrestore --engine spark finds the Spark master of `cfemu cluster up --spark N` while it runs."""
    from cfemu.settings import CLUSTER_SPARK, ENV_SPARK_MASTER

    home = tmp_path / "home"
    d = write_cluster(home / "var" / "cluster")
    state = json.loads((d / CLUSTER_FILE).read_text())
    assert resolve(env={}, cwd=home).spark_master is None
    assert "spark_master" not in resolve(env={}, cwd=home).sources
    state[CLUSTER_SPARK] = {"master_url": "spark://127.0.0.1:7077", "master_pid": LIVE_PID}
    (d / CLUSTER_FILE).write_text(json.dumps(state))
    found = resolve(env={}, cwd=home)
    assert (found.spark_master, found.sources["spark_master"]) == ("spark://127.0.0.1:7077", CLUSTER)
    assert found.env()[ENV_SPARK_MASTER] == "spark://127.0.0.1:7077"  # handed to child processes
    env = {ENV_SPARK_MASTER: "spark://env:7077"}
    assert resolve(env=env, cwd=home).spark_master == "spark://env:7077"
    assert resolve(spark_master="local[1]", env=env, cwd=home).spark_master == "local[1]"
    state[CLUSTER_SPARK]["master_pid"] = None  # stopped by `cfemu cluster down`
    (d / CLUSTER_FILE).write_text(json.dumps(state))
    assert resolve(env={}, cwd=home).spark_master is None
