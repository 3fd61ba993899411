"""An unload is loaded into one store only (backup.migrate_target; docs/migration.md, "Never both"): loaded into two,
its messages would be served by both and applications would receive them twice. Real redis-servers, a real member's
puts, loads side by side in two threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from cfemu.admin import Admin
from cfemu.connection import connect
from tests.support.group import start_qm


def _unloaded(url: str, logs: Path, to: Path) -> None:
    Admin(connect(url)).ensure_structure("APP1", ("Q1",))
    qm = start_qm(url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(5):
        conn.put("Q1", b"m%d" % i)
    conn.commit()
    qm.stop()
    migrate.unload(connect(url), "APP1", to)


def test_an_unload_loaded_once_is_refused_by_another_store(redis_url: str, redis_factory: Any,
                                                            tmp_path: Path) -> None:
    _unloaded(redis_url, tmp_path / "logs", tmp_path / "mig")
    first, second = redis_factory().client(), redis_factory().client()
    migrate.load(first, tmp_path / "mig", group="QSGA")
    with pytest.raises(migrate.LoadedElsewhereError, match=r"is loaded into CF \w+ as structure APP1 of group QSGA"):
        migrate.load(second, tmp_path / "mig", group="QSGB", report=tmp_path / "elsewhere.jsonl")
    assert second.dbsize() == 0  # refused before anything was written
    assert not (tmp_path / "elsewhere.jsonl").exists()
    assert Admin(first).state("APP1") == "ACTIVE"


def test_two_loads_at_once_into_two_stores_load_it_once(redis_url: str, redis_factory: Any, tmp_path: Path) -> None:
    _unloaded(redis_url, tmp_path / "logs", tmp_path / "mig")
    targets = {"QSGA": redis_factory().client(), "QSGB": redis_factory().client()}
    outcomes: dict[str, str] = {}
    start = threading.Barrier(2)

    def load(group: str) -> None:
        start.wait()
        try:
            migrate.load(targets[group], tmp_path / "mig", group=group, report=tmp_path / f"{group}.jsonl")
            outcomes[group] = "loaded"
        except migrate.MigrationError as e:
            outcomes[group] = type(e).__name__

    threads = [threading.Thread(target=load, args=(g,)) for g in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == ["LoadedElsewhereError", "loaded"], outcomes
    [refused] = [g for g, how in outcomes.items() if how != "loaded"]
    assert targets[refused].dbsize() == 0
