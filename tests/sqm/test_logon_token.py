"""Logon tokens kept as a keyed hash (sqm.core.logon_token): the group's key is one file on the log root, made once,
0600, shared by every member and process of the group, refused when others may read it, and still there after a CF
loss (the restored entries match their owners); entries made before tokens were sealed still match their owners
and are sealed when they change."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import NoMessageError, UnknownObjectError, UnknownUowError, UowStatusError
from restore.run import run_restore
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import Conversation
from sqm.conversations.uowstatus import ACCEPTED, Control
from sqm.core import logon_token
from sqm.core.manager import QueueManager
from sqm.pubsub import pubsub as ps
from tests.support.group import start_qm
from tests.support.harness import lose_cf

S, SVC, T = "APP1", "SVC", "NEWS"


@pytest.fixture
def qm(redis_url: str, tmp_path: Path) -> Iterator[QueueManager]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(SVC, S, uow={"status_lifetime": 2})
    admin.define_queue(T, S, topic={})
    q = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield q
    q.stop()


def test_the_key_is_made_once_0600_on_the_log_root_and_every_process_finds_the_same(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    code = "import sys; from sqm.core import logon_token; print(logon_token.group_key(sys.argv[1]).hex())"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE) for _ in range(6)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(keys) == 1 and all(p.returncode == 0 for p in procs)
    path = root / repository.DIRECTORY / logon_token.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [logon_token.KEY_FILE]  # no temporary file left
    assert logon_token.group_key(root).hex().encode() == keys.pop()


def test_a_key_others_may_read_is_refused(tmp_path: Path) -> None:
    path = logon_token.key_path(tmp_path / "logs")
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text(os.urandom(32).hex())
    path.chmod(0o644)
    with pytest.raises(logon_token.LogonKeyError, match="chmod 600"):
        logon_token.group_key(tmp_path / "logs")


def test_a_lost_key_file_is_not_replaced_by_another_key_and_a_running_member_writes_it_back(
        redis_url: str, tmp_path: Path) -> None:
    """The key was read at a member's first logon with a token and made when missing: deleted while the group ran,
    the next member to need it made another, and each member then found only its own users' work. A member now
    opens the key when it starts, against the fingerprint the group repository records: a missing file where the
    group has a key refuses the start in one line, and a running member writes the file back."""
    root = tmp_path / "logs"
    qm1 = start_qm(redis_url, root, "QM1", background=False)
    try:
        path = logon_token.key_path(root)
        original = path.read_bytes()
        path.unlink()
        with pytest.raises(logon_token.LogonKeyError, match="is missing, and the group has a logon key") as refused:
            start_qm(redis_url, root, "QM2", background=False)
        assert "\n" not in str(refused.value)
        assert not path.exists()  # no other key made
        assert logon_token.restore_key_file(root)  # what QM1's housekeeping does
        assert path.read_bytes() == original and stat.S_IMODE(path.stat().st_mode) == 0o600
        qm2 = start_qm(redis_url, root, "QM2", background=False)
        qm2.stop()
        path.unlink()
        path.write_text(os.urandom(32).hex())  # another key in its place
        path.chmod(0o600)
        with pytest.raises(logon_token.LogonKeyError, match="is not the group's logon key"):
            start_qm(redis_url, root, "QM2", background=False)
        path.unlink()
        path.mkdir()
        with pytest.raises(logon_token.LogonKeyError, match="is not a regular file"):
            start_qm(redis_url, root, "QM2", background=False)
        path.rmdir()
    finally:
        qm1.stop()


def test_a_fingerprint_section_edited_into_something_else_is_recorded_again(tmp_path: Path) -> None:
    repo = repository.GroupRepository(tmp_path / "logs")
    repo.update(lambda state: state.update({repository.LOGON_KEY: "edited by hand"}))
    assert repo.logon_key_fingerprint() is None
    assert repo.record_logon_key_fingerprint("f" * 32) == "f" * 32 == repo.logon_key_fingerprint()
    assert repo.record_logon_key_fingerprint("0" * 32) == "f" * 32  # one recorded: kept


def test_a_key_file_that_is_a_link_to_the_key_is_read_through(tmp_path: Path) -> None:
    """A key kept in a secrets mount and linked into the log root is the group's key; only what the link reaches
    must be a regular file."""
    root = tmp_path / "logs"
    repo = repository.GroupRepository(root)
    key = logon_token.open_group_key(root, repo)
    path = logon_token.key_path(root)
    kept = tmp_path / "secrets" / "logon.key"
    kept.parent.mkdir(mode=0o700)
    path.rename(kept)
    path.symlink_to(kept)
    assert logon_token.open_group_key(root, repo) == key


def test_a_running_members_housekeeping_writes_the_key_file_back(redis_url: str, tmp_path: Path) -> None:
    root = tmp_path / "logs"
    qm = start_qm(redis_url, root, "QM1")
    try:
        path = logon_token.key_path(root)
        original = path.read_bytes()
        path.unlink()
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.read_bytes() == original
    finally:
        qm.stop()


def test_sealed_tokens_are_keyed_bound_to_the_user_and_never_the_token() -> None:
    key, other = os.urandom(32), os.urandom(32)
    sealed = logon_token.seal_with(key, "alice", "t0k")
    assert logon_token.is_sealed(sealed) and "t0k" not in sealed
    assert sealed not in (logon_token.seal_with(other, "alice", "t0k"), logon_token.seal_with(key, "bob", "t0k"))
    assert logon_token.seal_with(key, "alice", "") == ""
    assert logon_token.matches(sealed, "t0k", sealed) and not logon_token.matches(sealed, "t0k", "")
    assert logon_token.matches("t0k", "t0k", sealed)  # an entry made before tokens were sealed
    assert not logon_token.matches("t0k", "other", logon_token.seal_with(key, "alice", "other"))


def test_an_entry_made_before_tokens_were_sealed_still_matches_and_is_sealed_when_it_changes(
        qm: QueueManager) -> None:
    """A control entry and a LAST pointer holding the token itself (as before): LAST, SETUSTATUS and CANCEL of its
    sender work, another token is refused, and the kept status is sealed by the change."""
    svc = ctl.service(qm, SVC)
    uow = os.urandom(16).hex()
    c = Control(uow=uow, service=SVC, status=ACCEPTED, sender="alice", token="old-tok", status_mult=2,
                lifetime_ms=3_600_000, messages=1)
    conn = qm.connect()
    conn.put(svc.control, c.pack(), persistent=True, syncpoint=True, msgid=bytes.fromhex(uow), correlid=b"A")
    conn.put(svc.control, msgpack.packb({"uow": uow, "at": 1}), persistent=True, syncpoint=True,
             msgid=ctl.last_pointer_id("alice", "old-tok"), correlid=b"L")
    conn.put(svc.data, b"m", persistent=True, syncpoint=True, correlid=bytes.fromhex(uow), properties={"uow.seq": 0})
    conn.commit()
    with Conversation(qm, "alice", "wrong") as other:
        with pytest.raises(UnknownUowError):
            other.last()
        with pytest.raises(UowStatusError, match="only its sender"):
            other.cancel(uow)
    with Conversation(qm, "alice", "old-tok") as alice:
        assert alice.last()["uow"] == uow
        assert alice.set_user_status(uow, b"still mine")["user_status"] == "still mine"
        assert alice.cancel(uow)["status"] == "CANCELLED"
    kept = ctl.peek(qm, svc, uow)
    assert kept is not None and kept.token == logon_token.seal(qm, "alice", "old-tok")
    with Conversation(qm, "alice", "old-tok") as alice:
        assert alice.delete(uow)["deleted"] is True


def test_a_subscription_made_before_tokens_were_sealed_is_taken_over_by_its_owner(qm: QueueManager) -> None:
    """A subscription whose entry and id hold the token itself (as before): its owner lists it, receives from its
    position and removes it; the first receive moves it to its sealed id; another token finds nothing."""
    t = ps.topic(qm, T)
    old = ps.Subscription(T, "daily", True, ps.structure_clock(qm, t), ps.AFTER_ALL, 0, 0, ps.incarnation(qm), 0,
                          "alice", "old-tok")
    conn = qm.connect()
    ps.put_subscription(conn, t, old)
    ps._put_roster(conn, t, old)
    conn.commit()
    assert old.sid == ps.subscription_id(T, "daily", "alice", "old-tok")
    pub = ps.publish(qm, T, [b"news"])
    assert [s.name for s in ps.subscriptions(qm, t, user="alice", token="old-tok")] == ["daily"]
    assert ps.subscriptions(qm, t, user="alice", token="wrong") == []
    with pytest.raises(UnknownObjectError):
        ps.PubSubSession(qm).receive(T, "daily", user="alice", token="wrong")
    s = ps.PubSubSession(qm)
    assert s.receive(T, "daily", user="alice", token="old-tok").pub == pub
    s.commit()
    sealed = logon_token.seal(qm, "alice", "old-tok")
    assert ps.peek_entries(qm, t, old.sid) == []
    now = ps.peek_subscription(qm, t, "daily", user="alice", token=sealed)
    assert now is not None and now.token == sealed and now.received == 1
    assert ps.roster(qm, t) == {now.sid.hex()}
    with pytest.raises(NoMessageError):
        ps.PubSubSession(qm).receive(T, "daily", user="alice", token="old-tok")
    assert ps.unsubscribe(qm, T, "daily", user="alice", token="old-tok").name == "daily"
    assert ps.roster(qm, t) == set()


def test_owners_still_match_after_a_cf_loss_and_restore(redis_url: str, tmp_path: Path) -> None:
    """The key is on the log root, not in the CF: after a CF loss the restored control entry and subscription
    (sealed, from the logs) are still their owner's, and no one else's."""
    logs = tmp_path / "logs"
    admin = Admin(connect(redis_url))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert qm.repository is not None
    repository.define_structure(admin, qm.repository, S)
    repository.define_queue(admin, qm.repository, SVC, S, uow={"status_lifetime": 2})
    repository.define_queue(admin, qm.repository, T, S, topic={})
    with Conversation(qm, "alice", "a-tok") as alice:
        uow = alice.send(SVC, b"order", commit=True).uow
    ps.subscribe(qm, T, "keep", user="alice", token="a-tok")
    qm.stop(checkpoint=False)
    lose_cf(redis.Redis.from_url(redis_url))
    run_restore(redis.Redis.from_url(redis_url), S, backup_root=tmp_path / "backups", log_root=logs)
    logon_token._keys.clear()  # read again from the log root, as a new process does
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        with Conversation(qm, "alice", "other") as other:
            with pytest.raises(UowStatusError, match="only its sender"):
                other.cancel(uow)
        with Conversation(qm, "alice", "a-tok") as alice:
            assert alice.last()["uow"] == uow
            assert alice.cancel(uow)["status"] == "CANCELLED"
        assert [s.name for s in ps.subscriptions(qm, ps.topic(qm, T), user="alice", token="a-tok")] == ["keep"]
        assert ps.unsubscribe(qm, T, "keep", user="alice", token="a-tok").name == "keep"
    finally:
        qm.stop()
