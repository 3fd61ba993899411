"""The kombu transport in the chaos suite: the checker's rules hold for kombu's publishes and deliveries on crafted
histories (an acknowledged delivery consumes its message, a requeued one gives it back, a redelivery's backout count
is inferred), and the kombu runner records what kombu told the application, against a real local group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.procs import free_port
from qsg.chaos.history import History, load_history, pair_ops
from qsg.chaos.kombu_actions import ACK, DROP, REQUEUE, Kombu, KombuRunner, KombuSession
from qsg.chaos.put_spec import PutSpec
from qsg.chaos.restcheck import ordering_counts
from qsg.local_group import LocalGroup
from sqm.service.client import Client
from tests.qsg.chaos.test_checker import Hist, only

KOMBU = {"via": "kombu"}


def kombu_get(h: Hist, uow: str, msg: str, *, redelivered: bool = False, settle: str = "commit",
              outcome: str = "ok", **settled: Any) -> None:
    """A delivery through kombu (a get under syncpoint, its own unit of work) and its ack (commit) or requeue."""
    result: dict[str, Any] = {"msg": msg, "crc_ok": True, "queue": "Q1", "priority": 0, "redelivered": redelivered}
    if not redelivered:
        result["backout_count"] = 0
    h.op("c2-kombu", "get", "ok", result, **KOMBU, uow=uow, queue="Q1", syncpoint=True)
    h.op("c2-kombu", settle, outcome, settled, **KOMBU, uow=uow)


def test_a_message_acknowledged_through_kombu_and_got_again_is_duplicated() -> None:
    h = Hist()
    h.put_committed("p", "m1")
    kombu_get(h, "k.1", "m1")
    h.get("c", "c.1", "m1")
    h.commit("c", "c.1")
    only(h.findings(), "duplicated")


def test_a_requeued_delivery_gives_its_message_back() -> None:
    h = Hist()
    h.put_committed("p", "m1")
    kombu_get(h, "k.1", "m1", settle="backout")
    kombu_get(h, "k.2", "m1", redelivered=True)
    assert all(v == 0 for v in h.findings().values()), h.findings()
    h = Hist()  # and an ack refused as backed out (its connection was lost while held) gives it back too
    h.put_committed("p", "m1")
    kombu_get(h, "k.1", "m1", outcome="fail", backed_out=True, reason="MQRC_BACKED_OUT")
    h.drain("m1")
    assert all(v == 0 for v in h.findings().values()), h.findings()


def test_an_acknowledged_delivery_whose_message_is_still_there_at_the_end_is_found() -> None:
    h = Hist()
    h.put_committed("p", "m1", "m2")
    kombu_get(h, "k.1", "m1")
    h.drain("m1")
    h.drain("m2")
    only(h.findings(), "duplicated")


def test_a_kombu_redelivery_counts_at_least_one_backout() -> None:
    h = Hist()
    kombu_get(h, "k.1", "m1", redelivered=True)
    kombu_get(h, "k.2", "m2")
    ops, _ = pair_ops(h.events)
    counts = ordering_counts([o for o in ops if o.op == "get"], lambda o: False)
    assert sorted(counts.values()) == [0, 1]


# --- the runner against a real group -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    g = LocalGroup.up(tmp_path_factory.mktemp("kombu-chaos") / "g", managers=1, backup_interval=None, lease_ms=2000)
    try:
        yield g
    finally:
        g.down()


def _ops(path: Path) -> list[Any]:
    return pair_ops(load_history(path))[0]


@pytest.mark.slow
def test_the_runner_records_what_kombu_said(group: LocalGroup, tmp_path: Path) -> None:
    h = History(tmp_path / "h.jsonl", seed=0, options={})
    eps = [(h_, p) for _, h_, p in group.endpoints]
    session = KombuSession(h, eps, "c1-kombu", token=group.token)
    runner = KombuRunner(h, session, "c1.1")
    puts = tuple(PutSpec(f"m{i}", "Q1", 0, True, 0, 100) for i in range(3))
    assert runner.run(Kombu(puts=puts))
    assert KombuRunner(h, session, "c1.2").run(Kombu(gets=(("Q1", REQUEUE), ("Q1", ACK), ("Q1", DROP))))
    h.close()
    ops = _ops(tmp_path / "h.jsonl")
    assert [(o.op, o.outcome) for o in ops] == [("put", "ok")] * 3 + [("get", "ok"), ("backout", "ok"),
                                                                       ("get", "ok"), ("commit", "ok"),
                                                                       ("get", "ok"), ("commit", "ok")]
    gets = [o for o in ops if o.op == "get"]
    assert [o.result["msg"] for o in gets] == ["m0", "m0", "m1"]  # the requeued one first again
    assert [o.result["redelivered"] for o in gets] == [False, True, False]
    assert all(o.args["via"] == "kombu" and o.args["uow"].startswith("c1.2.k") for o in gets)
    with Client(eps, token=group.token) as c:  # m0 acknowledged, m1 dropped (both consumed); m2 left
        assert [m.body.split(b"|")[1] for m in c.browse("Q1", limit=10)] == [b"m2"]


@pytest.mark.slow
def test_a_group_that_answers_nowhere_records_nothing_asked(tmp_path: Path) -> None:
    h = History(tmp_path / "h.jsonl", seed=0, options={})
    session = KombuSession(h, [("127.0.0.1", free_port())], "c1-kombu", token="t")
    assert not KombuRunner(h, session, "c1.1").run(Kombu(puts=(PutSpec("m0", "Q1", 0, True, 0, 100),)))
    h.close()
    assert _ops(tmp_path / "h.jsonl") == []
