"""The group's defaults for its services' STORE, MAX-UOWS and UWSTATP (seed 003: "by specifying STORE=BROKER in the
Broker defaults section ... making all UOWs in the system persistent", the same for UWSTATP, and MAX-UOWS for "the
Broker"; docs/uow.md, "Defaults"): the precedence request, service, group (a request's STORE=NO and UWSTATP=255
override both), against a real redis-server, real logs and the real `cfemu define uow-defaults`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import UowLimitError
from cfemu.uow_attributes import (
    UWSTATP_NONE,
    UowAttributes,
    UowDefaults,
    service_attributes,
    stored_attributes,
)
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import Conversation
from sqm.conversations.group_defaults import CACHE_S
from sqm.core.manager import QueueManager
from tests.qsg.test_cli import ok, run
from tests.support.group import start_qm
from tests.support.harness import lose_cf

S = "APP1"


def test_the_precedence_is_the_services_then_the_groups() -> None:
    group = UowDefaults(store=False, max_uows=7, status_lifetime=3)
    assert service_attributes({}, group) == UowAttributes(store=False, max_uows=7, status_lifetime=3)
    assert service_attributes({"store": True, "status_lifetime": 0}, group) == UowAttributes(
        store=True, max_uows=7, status_lifetime=0)
    assert service_attributes({"max_messages": 4}, UowDefaults()) == UowAttributes(max_messages=4)
    # A definition keeps only the group's fields it gives; one stored in full before group defaults keeps them all
    assert stored_attributes({"max_messages": 4}) == {"max_messages": 4, "lifetime_s": 86400,
                                                      "postpone_attempts": 0, "postpone_delay_s": 0,
                                                      "conv_nonact_s": 300}
    assert service_attributes(UowAttributes().to_dict(), group) == UowAttributes()
    for bad in ({"max_uows": -1}, {"status_lifetime": 255}, {"store": "yes"}, {"lifetime_s": 5}):
        with pytest.raises(ValueError):
            UowDefaults.from_dict(bad)


@pytest.fixture
def group(redis_url: str, tmp_path: Path) -> Iterator[tuple[Admin, repository.GroupRepository, QueueManager]]:
    admin = Admin(connect(redis_url))
    repo = repository.open_group_repository(admin, tmp_path / "logs", who="test")
    repository.define_structure(admin, repo, S)
    repository.define_queue(admin, repo, "PLAIN", S, uow={})  # gives none of the group's fields
    repository.define_queue(admin, repo, "OWN", S, uow={"store": True, "status_lifetime": 1, "max_uows": 3})
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield admin, repo, qm
    qm.stop()


def settled(qm: QueueManager, service: str, **want: object) -> UowAttributes:
    """The service's attributes as the member applies them, once its cached group defaults (1 s) caught up."""
    deadline = time.monotonic() + 10 * CACHE_S + 5
    while True:
        a = ctl.service(qm, service).attributes
        if all(getattr(a, k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return a
        time.sleep(0.1)


def test_a_service_without_its_own_takes_the_groups_and_a_request_overrides_both(
        group: tuple[Admin, repository.GroupRepository, QueueManager]) -> None:
    admin, repo, qm = group
    snd = Conversation(qm, "alice", "tok-a")
    before = snd.send("PLAIN", b"built-in defaults", commit=True)
    assert before.persistent and snd.query(before.uow)["persistent_status"] is False
    repository.define_uow_defaults(admin, repo, {"store": False, "status_lifetime": 3, "max_uows": 2})
    assert settled(qm, "PLAIN", store=False).status_lifetime == 3
    by_group = snd.send("PLAIN", b"the group's", commit=True)
    q = snd.query(by_group.uow)
    assert (by_group.persistent, q["persistent"], q["status_lifetime"]) == (False, False, 3)
    with pytest.raises(UowLimitError, match="service PLAIN has 2 active units of work, its MAX-UOWS"):
        snd.send("PLAIN", b"a third: the group's MAX-UOWS is 2")  # the service gives none: the group's
    own = snd.send("OWN", b"the service's", commit=True)
    q = snd.query(own.uow)
    assert (own.persistent, q["status_lifetime"]) == (True, 1)  # the service's before the group's
    by_request = snd.send("OWN", b"STORE=NO, UWSTATP=255", store=False, status_lifetime=UWSTATP_NONE, commit=True)
    q = snd.query(by_request.uow)
    assert (by_request.persistent, q["persistent_status"]) == (False, False)  # the request's before both
    assert ctl.service(qm, "OWN").attributes.max_uows == 3
    snd.close()


def test_cfemu_define_uow_defaults_keeps_them_durably(redis_url: str, tmp_path: Path) -> None:
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    d = json.loads(ok("cfemu", "define", "uow-defaults", "--no-uow-store", "--max-uows", "50", "--json", *where))
    assert d == {"kind": "uow-defaults", "store": False, "max_uows": 50, "status_lifetime": 0}
    table = ok("cfemu", "define", "uow-defaults", "--status-lifetime", "4", *where)  # the others stay
    assert "the group's defaults" in table and "max_uows" in table and "50" in table
    r = run("cfemu", "define", "uow-defaults", "--status-lifetime", "255", *where)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--status-lifetime" in r.stderr
    admin = Admin(connect(redis_url))
    assert admin.uow_defaults() == UowDefaults(store=False, max_uows=50, status_lifetime=4)
    lose_cf(admin.redis)  # the CF is lost: the group repository has them, and gives them back
    assert admin.uow_defaults() is None
    assert repository.GroupRepository(tmp_path / "logs").uow_defaults() == UowDefaults(False, 50, 4)
    d = json.loads(ok("cfemu", "define", "uow-defaults", "--json", *where))
    assert (d["store"], d["max_uows"], d["status_lifetime"]) == (False, 50, 4)
    assert admin.uow_defaults() == UowDefaults(store=False, max_uows=50, status_lifetime=4)
