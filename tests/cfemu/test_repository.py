"""The group repository (cfemu.repository) against real files and a real redis-server: what it records, how it
is written (owner-only, atomically, under a lock), how a bad one is refused, and how the CF tells a member
whether its log root is the group's."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from cfemu import keys, repository
from cfemu.admin import Admin, AdminError, StructureDef
from cfemu.connection import connect
from cfemu.limits import MAX_DEFINED
from cfemu.repository import GroupRepository, RepositoryError, open_group_repository
from tests.support.harness import lose_cf


def test_definitions_and_members_are_recorded_owner_only_and_atomically(tmp_path: Path) -> None:
    repo = GroupRepository(tmp_path / "logs")
    assert not repo.exists() and repo.load() is None and repo.members() == {}
    repo.record_structure(StructureDef("APP1", 10, 0), lrsn=123)
    repo.record_structure(StructureDef("APP1", 20, 0), lrsn=999)  # replaced: the first LRSN stays
    repo.record_member("QM1", tmp_path / "logs" / "QM1")
    assert repo.structure("APP1") == (StructureDef("APP1", 20, 0), 123)
    assert repo.members() == {"QM1": str(tmp_path / "logs" / "QM1")}
    assert stat.S_IMODE(repo.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(repo.directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in repo.directory.iterdir()) == ["lock", "repository.json"]  # no temp file left


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    repo = GroupRepository(tmp_path)
    threads = [threading.Thread(target=lambda i=i: repo.record_member(f"QM{i}", tmp_path / f"QM{i}"))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(repo.members()) == sorted(f"QM{i}" for i in range(16))


@pytest.mark.parametrize(("content", "why"), [
    (b"{not json", "is not valid JSON"),
    (b'{"format": "something else", "id": "x"}', "is not a group repository"),
    (b'{"format": "cfemu-group-repository", "version": 9, "id": "x"}', "has version 9"),
])
def test_a_bad_repository_is_refused_by_name_and_left_as_it_is(tmp_path: Path, content: bytes, why: str) -> None:
    repo = GroupRepository(tmp_path)
    repo.directory.mkdir()
    repo.path.write_bytes(content)
    with pytest.raises(RepositoryError, match=why) as e:
        repo.record_member("QM1", tmp_path / "QM1")
    assert str(repo.path) in str(e.value)
    assert repo.path.read_bytes() == content


def test_the_cf_records_the_groups_repository_and_refuses_another_log_root(redis_url: str, tmp_path: Path) -> None:
    admin = Admin(connect(redis_url))
    mine = open_group_repository(admin, tmp_path / "logs", who="QM1")
    assert admin.repository() == {"id": mine.id, "path": str(mine.path)}
    assert open_group_repository(admin, tmp_path / "logs", who="QM2").id == mine.id
    with pytest.raises(RepositoryError, match=r"QM3: the log root .*elsewhere is not the group's: .* does not exist"):
        open_group_repository(admin, tmp_path / "elsewhere", who="QM3")
    assert not (tmp_path / "elsewhere").exists()
    GroupRepository(tmp_path / "other").ensure()
    with pytest.raises(RepositoryError, match="is another one"):
        open_group_repository(admin, tmp_path / "other", who="QM4")


def test_a_lost_cf_learns_the_repository_again_from_the_first_member(redis_url: str, tmp_path: Path) -> None:
    client = connect(redis_url)
    first = open_group_repository(Admin(client), tmp_path / "logs", who="QM1").id
    lose_cf(client)
    assert open_group_repository(Admin(client), tmp_path / "logs", who="QM1").id == first
    assert Admin(client).repository() is not None


def test_a_structure_starts_its_clock_at_its_definition_and_is_never_defined_again_over_its_history(
        redis_url: str, tmp_path: Path) -> None:
    client = connect(redis_url)
    admin = Admin(client)
    repo = open_group_repository(admin, tmp_path, who="test")
    repository.define_structure(admin, repo, "APP1")
    repository.define_queue(admin, repo, "Q1", "APP1", backout_threshold=2)
    known = repo.structure("APP1")
    assert known is not None
    assert int(client.hget(keys.meta("APP1"), "clock") or 0) == known[1] > 0
    assert [q.name for q in repo.queues("APP1")] == ["Q1"] and repo.queues("APP1")[0].backout_threshold == 2
    lose_cf(client)  # the CF is lost
    with pytest.raises(RepositoryError, match="restore it with 'cfrestore run APP1'"):
        repository.define_structure(admin, repo, "APP1")
    assert admin.structures() == []


def test_definitions_made_without_the_repository_are_adopted_from_the_beginning_of_the_logs(
        redis_url: str, tmp_path: Path) -> None:
    admin = Admin(connect(redis_url))
    admin.define_structure("OLD")
    admin.define_queue("QOLD", "OLD")
    repo = open_group_repository(admin, tmp_path, who="QM1")
    assert repo.structure("OLD") == (StructureDef("OLD"), 0)  # LRSN 0: replayed from the start of every log
    state = json.loads(repo.path.read_text())
    assert set(state["queues"]) == {"QOLD"} and state["queues"]["QOLD"]["lrsn"] == 0


def test_survivors_are_defined_again_with_their_uow_and_topic_attributes(redis_url: str, tmp_path: Path) -> None:
    """A Redis Cluster CF that lost its {ADMIN} master: the structures on the other masters are defined again from
    the repository, each queue with every attribute. The fields were listed one by one, and a service and a topic
    came back as plain queues (the chaos run on a Redis Cluster CF: every subscriber's receive refused "not a
    topic", and every publication lost to them)."""
    admin = Admin(connect(redis_url))
    repo = open_group_repository(admin, tmp_path / "logs", who="test")
    repository.define_structure(admin, repo, "APP1")
    repository.define_queue(admin, repo, "SVC", "APP1", uow={"status_lifetime": 2}, backout_queue="BQ")
    repository.define_queue(admin, repo, "NEWS", "APP1", topic={"lifetime_s": 60})
    admin.redis.delete(keys.queue_defs(), keys.structure_defs())  # {ADMIN} lost, APP1's own keys not
    assert repository.redefine_survivors(admin, repo) == ["APP1"]
    svc, news = admin.queue_def("SVC"), admin.queue_def("NEWS")
    assert svc.uow["status_lifetime"] == 2 and svc.backout_queue == "BQ" and news.topic["lifetime_s"] == 60
    assert {"SVC.UOWCTL", "SVC.UOWDATA", "NEWS.PUB", "NEWS.SUB"} <= {q.name for q in admin.queues()}


@pytest.mark.parametrize("in_cf", [True, False], ids=["in-the-cf", "lost-with-the-cf"])
def test_a_capacity_beyond_what_the_cf_holds_is_refused_and_written_nowhere(redis_url: str, tmp_path: Path,
                                                                              in_cf: bool) -> None:
    """ALTER of a structure the CF lost changes the repository alone: a capacity of 20 digits was written there
    unchecked, and every later open of the repository (each member's start, restore, purge, define, put) failed
    on it with msgpack's OverflowError, the alter that would undo it too."""
    client = connect(redis_url)
    admin = Admin(client)
    repo = open_group_repository(admin, tmp_path / "logs", who="test")
    repository.define_structure(admin, repo, "APP1", max_entries=10)
    repository.define_queue(admin, repo, "Q1", "APP1")
    if not in_cf:
        lose_cf(client)
    before = repo.path.read_bytes()
    with pytest.raises(AdminError, match=r"^structure APP1: max_entries must be between 0 and 9007199254740991, "
                                         r"not 99999999999999999999$"):
        repository.alter_structure(admin, repo, "APP1", max_entries=99999999999999999999)
    with pytest.raises(AdminError, match="max_bytes must be between"):
        repository.alter_structure(admin, repo, "APP1", max_bytes=MAX_DEFINED + 1)
    if in_cf:  # (a queue is defined only in a structure the CF holds)
        with pytest.raises(AdminError, match="backout_threshold must be between"):
            repository.define_queue(admin, repo, "Q2", "APP1", backout_threshold=2**64)
    assert repo.path.read_bytes() == before
    assert repository.alter_structure(admin, repo, "APP1", max_entries=MAX_DEFINED).max_entries == MAX_DEFINED


def test_a_repository_edited_by_hand_to_a_capacity_out_of_range_still_opens(redis_url: str, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A definition no command writes any more (a hand edit, an older version): read as unlimited with a warning,
    never dropped (its structure has a history in the logs); the members still start and the alter mends it."""
    client = connect(redis_url)
    admin = Admin(client)
    repo = open_group_repository(admin, tmp_path / "logs", who="test")
    repository.define_structure(admin, repo, "APP1", max_entries=10)
    repository.define_queue(admin, repo, "Q1", "APP1", backout_threshold=3)
    state = json.loads(repo.path.read_text())
    state["structures"]["APP1"]["max_entries"] = 99999999999999999999
    state["queues"]["Q1"]["backout_threshold"] = -1
    repo.path.write_text(json.dumps(state))
    admin.redis.delete(keys.queue_defs(), keys.structure_defs())  # as a survivor: defined again from the repository
    with caplog.at_level("WARNING", logger="cfemu.repository"):
        assert open_group_repository(admin, tmp_path / "logs", who="QM1").id == repo.id
    assert repo.structure("APP1") == (StructureDef("APP1"), state["structures"]["APP1"]["lrsn"])
    assert [q.name for q in repo.queues()] == []
    assert "structure APP1 is malformed" in caplog.text and "queue Q1 is malformed" in caplog.text
    assert repository.alter_structure(admin, repo, "APP1", max_entries=5).max_entries == 5
    assert json.loads(repo.path.read_text())["structures"]["APP1"]["max_entries"] == 5
