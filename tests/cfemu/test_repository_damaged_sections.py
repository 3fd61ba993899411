"""A group repository that is valid JSON but damaged inside (edited by hand, a section of the wrong type): every
member start, define and restore reads it, so the refusal must be one line naming the file and what is wrong, never
a traceback, and nothing may be written over it. A malformed single definition keeps its documented handling (a
queue's passed over, a structure's read as unlimited: cfemu.repository), whatever JSON value it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import QueueDef, StructureDef
from cfemu.repository import GroupRepository, RepositoryError


def _repo(tmp_path: Path, **sections: Any) -> GroupRepository:
    repo = GroupRepository(tmp_path / "logs")
    repo.record_structure(StructureDef("APP1"), 1)
    repo.record_queue(QueueDef("Q1", "APP1"), 1)
    repo.record_member("QM1", tmp_path / "logs" / "QM1")
    state = json.loads(repo.path.read_bytes())
    state.update(sections)
    repo.path.write_text(json.dumps(state))
    return repo


@pytest.mark.parametrize("section,value", [("structures", []), ("queues", "Q1"), ("members", None),
                                           ("members", {"QM1": "/logs/QM1"}), ("migrated", [])])
def test_a_section_of_the_wrong_type_is_refused_in_one_line_naming_the_file(tmp_path: Path, section: str,
                                                                            value: Any) -> None:
    repo = _repo(tmp_path, **{section: value})
    before = repo.path.read_bytes()
    for use in (repo.load, repo.members, lambda: repo.record_member("QM2", tmp_path / "logs" / "QM2"),
                lambda: repo.adopt([StructureDef("APP2")], []), repo.migrated):
        with pytest.raises(RepositoryError, match=rf"{repo.path}.*{section}") as e:
            use()
        assert "\n" not in str(e.value)
    assert repo.path.read_bytes() == before


def test_a_definition_that_is_not_an_object_keeps_its_documented_handling(tmp_path: Path) -> None:
    repo = _repo(tmp_path, structures={"APP1": "x"}, queues={"Q1": 7, "Q2": {"name": "Q2", "structure": "APP1"}})
    assert repo.structures() == {"APP1": StructureDef("APP1")}  # read as unlimited, never dropped
    assert repo.structure("APP1") == (StructureDef("APP1"), 0)  # made at an unknown LRSN: replayed from the start
    assert [q.name for q in repo.queues()] == ["Q2"]  # Q1 passed over
    repo.record_queue(QueueDef("Q1", "APP1"), 5)  # defined again over it
    repo.record_structure(StructureDef("APP1", max_entries=10), 5)
    assert [q.name for q in repo.queues()] == ["Q1", "Q2"]
    assert repo.structures()["APP1"].max_entries == 10
