"""The columnar plan's batches made in C (restore.columnar_staged, ColumnarPlan.staged) against the Python path
(restore.load.staged of plan.in_load_order(): the survivors decoded, bulk.prepare): the same batches, byte for
byte, with the same pseudo-clock floor, on the generators' histories and on one with control entries; and a whole
restore through it (run_restore: load_plan asks the plan for its batches) leaves the CF as the local engine does."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backup.files import Backup, BackupWriter, read_backup
from cfemu import bulk
from cfemu.entry import Entry
from cfemu.uow_attributes import CONTROL_SUFFIX
from restore import columnar_staged, engine_columnar, load
from restore.engine_columnar import ColumnarEngine, ColumnarPlan
from sqm.conversations.uowstatus import Control
from tests.restore.test_engine_spark import NOW_MS, S, simulate, write_history


def _plan(backup: Backup, log_dirs: list[Path], replay_from: int, work: Path) -> ColumnarPlan:
    work.mkdir(exist_ok=True)
    plan = ColumnarEngine(work_dir=work, workers=1).plan(S, backup, log_dirs, replay_from, NOW_MS)
    assert isinstance(plan, ColumnarPlan)
    return plan


def _described(batches: Iterator[tuple[bulk.Staged, int]]) -> list[tuple[Any, ...]]:
    return [(st.entries, st.commands.data(), st.commands.count, st.copies, st.lists, st.held, st.queues, st.bytes,
             floor) for st, floor in batches]


@pytest.fixture
def python_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the batches the C path left to bulk.prepare."""
    sizes: list[int] = []
    prepare = bulk.prepare

    def counted(structure: str, batch: Any) -> bulk.Staged:
        sizes.append(len(batch))
        return prepare(structure, batch)

    monkeypatch.setattr(columnar_staged.bulk, "prepare", counted)
    return sizes


def _same_as_python(plan: ColumnarPlan, batch: int, batch_bytes: int, python_batches: list[int]) -> int:
    """Compare the plan's batches with the Python path's; returns how many the C path made."""
    got = _described(plan.staged(S, batch, batch_bytes))
    in_c = len(got) - len(python_batches)
    python_batches.clear()
    assert got == _described(load.staged(S, plan.in_load_order(), batch, batch_bytes))
    return in_c


@pytest.mark.parametrize(("seed", "fetch_rows", "batch", "batch_bytes"),
                         [(1, 7, 5, 0), (2, 4096, 1000, 0), (3, 3, 10, 40), (4, 11, 1, 0)])
def test_the_plans_batches_are_the_python_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                python_batches: list[int], seed: int, fetch_rows: int, batch: int,
                                                batch_bytes: int) -> None:
    """Batches cut across the query's record batches (fetch_rows rows each), by count and by bytes."""
    monkeypatch.setattr(engine_columnar, "FETCH_ROWS", fetch_rows)
    h = simulate(random.Random(seed), 300, carry=seed % 2 == 0)
    backup, log_dirs = write_history(h, tmp_path)
    plan = _plan(backup, log_dirs, h.replay_from, tmp_path / "work")
    try:
        assert plan.loaded_count > 0
        assert _same_as_python(plan, batch, batch_bytes, python_batches) > 0
    finally:
        plan.close()


def test_a_control_entrys_batch_goes_to_python_and_sets_the_pseudo_clock_floor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_batches: list[int]) -> None:
    """A survivor on a control queue: its batch is prepared by bulk.prepare (the floor reads its data), the others
    in C, and the floor is the newest control's stamp."""
    monkeypatch.setattr(engine_columnar, "FETCH_ROWS", 4)
    R = 10**6
    w = BackupWriter(tmp_path / "b")
    n = 0
    for i in range(12):
        w.add(1, Entry(f"c{i}", "Q1", state="CP", lrsn=R - 90 + i, order=(R - 99 + i, R - 99 + i),
                       msgid=f"m{i}", properties={"k": i, "s": "é"}).wire(), b"x" * i)
        n += 1
    for pc in (5_000, 7_000):
        ctl = Control(uow=f"{pc:x}", service="SVC", status="ACCEPTED", changed_pc=pc)
        w.add(1, Entry(f"u{pc}", "SVC" + CONTROL_SUFFIX, state="CP", lrsn=R - 50, order=(R - 60, R - 60)).wire(),
              ctl.pack())
        n += 1
    w.finish({"id": "b", "group": "G", "structure": S, "entries": n, "bytes": 0, "replay_from": R, "gen": 1})
    plan = _plan(read_backup(tmp_path / "b"), [], R, tmp_path / "work")
    try:
        assert plan.loaded_count == n
        batches = list(plan.staged(S, 3, 0))
        assert batches[-1][1] == 7_000
        assert 0 < sum(python_batches) < n  # some batches in C, the control entries' in Python
        python_batches.clear()
        assert _same_as_python(plan, 3, 0, python_batches) > 0
    finally:
        plan.close()


def test_the_fold_fields_are_those_the_c_path_sets() -> None:
    assert [name for name, _ in engine_columnar.FIELDS] == list(bulk.OVERRIDES)
    with pytest.raises(ValueError, match="not those cfemu.bulk.OVERRIDES names"):
        list(columnar_staged.staged(S, [], None, lambda *_: [], (("st", 2),), 10))  # type: ignore[arg-type]


def test_without_the_extension_every_batch_is_prepared_in_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   python_batches: list[int]) -> None:
    """Where cfemu._bulk was not built, the plan's batches are still the Python path's, each made by it."""
    monkeypatch.setattr(engine_columnar, "FETCH_ROWS", 7)
    h = simulate(random.Random(5), 200)
    backup, log_dirs = write_history(h, tmp_path)
    plan = _plan(backup, log_dirs, h.replay_from, tmp_path / "work")
    try:
        monkeypatch.setattr(bulk, "_bulk", None)
        assert _same_as_python(plan, 5, 0, python_batches) == 0
    finally:
        plan.close()
