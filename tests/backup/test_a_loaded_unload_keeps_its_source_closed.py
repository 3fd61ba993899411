"""A source whose unload was loaded is not reopened on the operator's --confirm alone (docs/migration.md, "Never
both"): the unload's directory records the store it was loaded into (backup.migrate_target), which serves its
messages; reopened, the source would serve them too. Only --target-given-up reopens it. Real redis-servers, a real
member's puts, the real command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from backup.migrate_target import TARGET_FILE
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from tests.support.group import start_qm

ROOT = Path(__file__).resolve().parents[2]
S = "APP1"


def _unloaded(url: str, tmp_path: Path) -> Path:
    Admin(connect(url)).ensure_structure(S, ("Q1",))
    qm = start_qm(url, tmp_path / "logs", "QM1", background=False)
    conn = qm.connect()
    for i in range(5):
        conn.put("Q1", b"m%d" % i)
    conn.commit()
    qm.stop()
    migrate.unload(connect(url), S, tmp_path / "mig")
    return tmp_path / "mig"


def _reopen_cli(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qsg.cli", "migrate", "reopen", S, "--confirm", S, "--redis-url",
                           url, *extra], capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ))


def test_a_loaded_unloads_source_is_reopened_only_with_its_target_given_up(fresh_redis: EmbeddedRedis,
                                                                            redis_factory: Any,
                                                                            tmp_path: Path) -> None:
    url = fresh_redis.url
    unload = _unloaded(url, tmp_path)
    target = redis_factory().client()
    migrate.load(target, unload, group="QSGB")

    with pytest.raises(migrate.LoadedElsewhereError,
                       match=rf"structure {S}'s unload .* is loaded into CF \w+ as structure {S} of group QSGB"):
        migrate.reopen(connect(url), S)
    refused = _reopen_cli(url)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert refused.stderr.count("\n") == 1 and "--target-given-up" in refused.stderr, refused.stderr
    # nothing changed: the source still serves nothing, its migration still recorded
    assert Admin(connect(url)).state(S) == migrate.MIGRATED
    assert S in migrate.group_repository(connect(url)).migrated()

    done = _reopen_cli(url, "--target-given-up", "--json")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert '"target_given_up"' in done.stdout and "QSGB" in done.stdout
    assert Admin(connect(url)).state(S) == "ACTIVE"
    assert S not in migrate.group_repository(connect(url)).migrated()


def test_an_unreadable_target_record_refuses_as_a_loaded_one(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """A target record that cannot be read refuses more, never less."""
    url = fresh_redis.url
    unload = _unloaded(url, tmp_path)
    (unload / TARGET_FILE).write_text("{not json")
    with pytest.raises(migrate.LoadedElsewhereError, match="--target-given-up"):
        migrate.reopen(connect(url), S)
    assert Admin(connect(url)).state(S) == migrate.MIGRATED


def test_an_unload_never_loaded_is_reopened_on_confirm_alone(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    url = fresh_redis.url
    _unloaded(url, tmp_path)
    st = migrate.reopen(connect(url), S)
    assert st["state"] == "ACTIVE" and st["target_given_up"] is None


def test_an_unload_whose_directory_is_not_there_refuses_as_a_loaded_one(fresh_redis: EmbeddedRedis,
                                                                         tmp_path: Path) -> None:
    """The unload's directory removed or its volume not mounted here: whether it was loaded elsewhere cannot be
    told, so --confirm alone does not reopen the source (a target may serve the messages); the directory back, or
    --target-given-up, reopens it."""
    url = fresh_redis.url
    unload = _unloaded(url, tmp_path)
    away = tmp_path / "unmounted"
    unload.rename(away)
    refused = _reopen_cli(url)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert refused.stderr.count("\n") == 1 and "cannot be told" in refused.stderr, refused.stderr
    assert "--target-given-up" in refused.stderr and "Traceback" not in refused.stderr
    assert Admin(connect(url)).state(S) == migrate.MIGRATED
    away.rename(unload)
    assert migrate.reopen(connect(url), S)["state"] == "ACTIVE"
