"""The chaos checker catches what it claims to catch: crafted histories, one per kind of violation, each reported;
a clean history, and the allowed anomalies (non-persistent loss, unknown outcomes, redelivery), report nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import OutcomePendingError, OutcomeUnknownError
from qsg.chaos.bodies import make_body, pending_delivery
from qsg.chaos.checker import FINDING_KINDS, check
from qsg.chaos.history import load_history
from sqm.core.connection import Message


class Hist:
    """Builds a history the way the workload writes one: invoke, then its completion, time moving on."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = [{"type": "meta", "seed": 0}]
        self.t = 0.0
        self.n = 0

    def op(self, client: str, op: str, outcome: str = "ok", result: dict[str, Any] | None = None,
           **args: Any) -> None:
        self.n += 1
        self.t += 0.01
        self.events.append({"type": "invoke", "id": self.n, "t": round(self.t, 4), "client": client, "op": op,
                            **args})
        self.t += 0.01
        self.events.append({"type": outcome, "id": self.n, "t": round(self.t, 4), **(result or {})})

    def put(self, client: str, uow: str | None, msg: str, *, persistent: bool = True, expiry_ms: int = 0,
            queue: str = "Q1", priority: int = 0, outcome: str = "ok") -> None:
        self.op(client, "put", outcome, uow=uow, msg=msg, queue=queue, priority=priority, persistent=persistent,
                syncpoint=uow is not None, expiry_ms=expiry_ms)

    def get(self, client: str, uow: str, msg: str, *, crc_ok: bool = True, backout_count: int = 0,
            queue: str = "Q1") -> None:
        self.op(client, "get", "ok", {"msg": msg, "crc_ok": crc_ok, "queue": queue, "priority": 0,
                                      "backout_count": backout_count}, uow=uow, queue=queue)

    def commit(self, client: str, uow: str, outcome: str = "ok") -> None:
        self.op(client, "commit", outcome, uow=uow)

    def put_committed(self, client: str, *msgs: str) -> None:
        """Each message put and committed in a unit of work of its own (``client.msg``), in this order."""
        for m in msgs:
            self.put(client, f"{client}.{m}", m)
            self.commit(client, f"{client}.{m}")

    def backout(self, client: str, uow: str) -> None:
        self.op(client, "backout", uow=uow)

    def drain(self, msg: str, queue: str = "Q1", crc_ok: bool = True) -> None:
        self.op("drain", "drain", "ok", {"msg": msg, "crc_ok": crc_ok, "queue": queue, "backout_count": 0},
                queue=queue)

    def fault(self, n: int, kind: str, phase: str, **fields: Any) -> None:
        self.t += 0.01
        self.events.append({"type": "fault", "t": round(self.t, 4), "phase": phase, "fault": n, "kind": kind,
                            **fields})

    def note(self, **fields: Any) -> None:
        self.t += 0.01
        self.events.append({"type": "note", "t": round(self.t, 4), **fields})

    def findings(self) -> dict[str, int]:
        return check(self.events).summary()


def only(findings: dict[str, int], kind: str, n: int = 1) -> None:
    assert findings[kind] == n, findings
    assert all(v == 0 for k, v in findings.items() if k != kind), findings


def clean_base() -> Hist:
    h = Hist()
    h.put("p", "p.1", "m1")
    h.put("p", "p.1", "m2", queue="Q3")
    h.commit("p", "p.1")
    h.get("c", "c.1", "m1")
    h.commit("c", "c.1")
    h.put("p", None, "m3")  # outside syncpoint
    h.drain("m2", "Q3")
    h.drain("m3")
    return h


@pytest.mark.parametrize("content", [b"", b"\n\n", b"not json {", b"[1, 2]\n", b"{\"t\": 1}\n", b"\xff\xfe\x00garbage"],
                         ids=["empty", "blank", "not-json", "not-an-object", "no-type", "bytes"])
def test_a_file_that_is_not_a_history_is_refused_not_checked(tmp_path: Path, content: bytes) -> None:
    """`cfemu chaos check` of a file that holds no event of a run had answered "no findings" and exit 0: an
    operator checking the wrong file would read it as a clean run."""
    path = tmp_path / "history.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="chaos history"):
        load_history(path)


def test_a_torn_last_line_is_left_out_of_a_history(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text('{"type": "note", "t": 0}\n{"type": "invoke", "id": 1, "t":')
    assert load_history(path) == [{"type": "note", "t": 0}]


def test_a_clean_history_reports_nothing() -> None:
    r = check(clean_base().events)
    assert r.ok and set(r.summary()) == set(FINDING_KINDS)
    assert r.counts["messages put"] == 3 and r.counts["committed units of work"] == 5


def test_lost() -> None:
    h = clean_base()
    h.put("p", "p.2", "m4")
    h.commit("p", "p.2")  # acknowledged, then never seen again
    only(h.findings(), "lost")
    assert check(h.events).of("lost")[0].msgs == ["m4"]


def test_duplicated_by_two_committed_gets_and_by_consumed_then_drained() -> None:
    h = clean_base()
    h.get("c2", "c2.1", "m1")  # m1 was consumed by c.1 already
    h.commit("c2", "c2.1")
    only(h.findings(), "duplicated")
    h = clean_base()
    h.drain("m1")  # consumed and still present at the end
    only(h.findings(), "duplicated")


def pending_get(h: Hist, client: str, msg: str, *, backout_count: int = 0, op: str = "get") -> None:
    """A get outside syncpoint whose commit is pending: unknown, with the message it delivered all the same."""
    extra: dict[str, Any] = {"uow": None, "syncpoint": False} if op == "get" else {}
    h.op(client, op, "unknown", {"reason": "MQRC_OUTCOME_PENDING", "msg": msg, "crc_ok": True, "queue": "Q1",
                                 "priority": 0, "backout_count": backout_count}, queue="Q1", **extra)


def test_a_pending_get_backed_out_by_a_restore_and_delivered_again_is_no_duplicate() -> None:
    h = clean_base()
    h.put("p", None, "m4")
    pending_get(h, "c2", "m4")  # told pending, with the message; a restore backs the get out
    h.drain("m4")  # delivered again (its backout count raised)
    h.events[-1]["backout_count"] = 1
    r = check(h.events)
    assert r.ok, r.summary()
    assert r.counts["unknown outcomes resolved: backed out"] == 1


def test_a_pending_get_whose_commit_completed_is_a_delivery_and_no_loss() -> None:
    h = clean_base()
    h.put("p", None, "m4")
    pending_get(h, "c2", "m4")  # its commit completed: the message is never delivered again
    r = check(h.events)
    assert r.ok, r.summary()  # neither lost nor undelivered: the pending get delivered it
    assert r.counts["unknown outcomes resolved: committed"] == 1
    h = clean_base()
    h.put("p", None, "m4")
    pending_get(h, "drain", "m4", op="drain")
    assert check(h.events).ok


def test_a_message_delivered_again_after_a_committed_get_is_still_duplicated() -> None:
    h = clean_base()
    pending_get(h, "c2", "m1", backout_count=1)  # c.1 committed its get of m1: a later delivery is a duplicate
    only(h.findings(), "duplicated")


def test_phantom_never_put_and_put_backed_out() -> None:
    h = clean_base()
    h.drain("nobody-put-this")
    only(h.findings(), "phantom")
    h = clean_base()
    h.put("p", "p.2", "m5")
    h.backout("p", "p.2")
    h.drain("m5")
    only(h.findings(), "phantom")


def test_atomicity_of_a_uow_with_unknown_outcome() -> None:
    h = clean_base()
    h.put("p", "p.2", "m6")
    h.put("p", "p.2", "m7")
    h.commit("p", "p.2", outcome="unknown")
    h.drain("m6")  # one put visible, the other never: half a unit of work
    f = check(h.events)
    only(f.summary(), "atomicity")
    assert f.of("atomicity")[0].msgs == ["m6", "m7"] and f.of("atomicity")[0].uow == "p.2"


def test_atomicity_of_a_get_and_a_put() -> None:
    h = clean_base()
    h.put("p", "p.2", "m8")
    h.commit("p", "p.2")
    h.get("c", "c.2", "m8")
    h.put("c", "c.2", "m9")
    h.commit("c", "c.2", outcome="unknown")
    h.drain("m8")  # the get did not take effect (m8 is back) ...
    h.drain("m9")  # ... but the put did
    only(h.findings(), "atomicity")


def test_corrupted() -> None:
    h = clean_base()
    h.put("p", "p.2", "m10")
    h.commit("p", "p.2")
    h.drain("m10", crc_ok=False)
    only(h.findings(), "corrupted")


def inverted(h: Hist) -> None:
    """o1 and o2 put and committed in that order by p, then got and committed by c the other way round."""
    h.put_committed("p", "o1", "o2")
    h.get("c", "c.o", "o2")
    h.commit("c", "c.o")
    h.get("c", "c.o2", "o1")
    h.commit("c", "c.o2")


def test_order_one_producer_one_consumer() -> None:
    h = clean_base()
    inverted(h)
    f = check(h.events)
    only(f.summary(), "order")
    assert f.of("order")[0].msgs == ["o1", "o2"]


def test_order_allows_redelivery_after_backout_and_faults() -> None:
    h = clean_base()
    h.put_committed("p", "o1", "o2")
    h.get("x", "x.1", "o1")
    h.backout("x", "x.1")  # o1 goes back to its place after o2 was taken
    h.get("c", "c.o", "o2")
    h.commit("c", "c.o")
    h.get("c", "c.o2", "o1", backout_count=1)
    h.commit("c", "c.o2")
    f = check(h.events)
    assert f.ok, f.summary()
    assert f.counts["redeliveries after backout"] == 1
    h = clean_base()  # the same inversion inside a fault window is not judged
    h.fault(1, "sqm-kill", "inject")
    inverted(h)
    h.fault(1, "sqm-kill", "recovered")
    assert check(h.events).ok


def test_allowed_nonpersistent_loss_and_unknown_outcomes_either_way() -> None:
    h = clean_base()
    h.put("p", None, "np1", persistent=False)  # lost with the CF: allowed
    h.put("p", "p.2", "u1")
    h.commit("p", "p.2", outcome="unknown")  # resolved as committed: its put is visible
    h.put("p", "p.3", "u2")
    h.commit("p", "p.3", outcome="unknown")  # resolved as backed out: nothing visible
    h.put("p", None, "u3", outcome="unknown")  # an out-of-syncpoint put, outcome unknown, never seen
    h.drain("u1")
    r = check(h.events)
    assert r.ok, r.findings
    assert r.counts["non-persistent lost (allowed)"] == 1
    assert r.counts["unknown outcomes resolved: committed"] == 1
    assert r.counts["unknown outcomes resolved: backed out"] == 2


def test_resurrected_nonpersistent_after_a_cf_loss() -> None:
    h = clean_base()
    h.put("p", None, "np2", persistent=False)
    h.fault(1, "cf-kill", "inject")
    h.fault(1, "cf-kill", "recovered")
    h.drain("np2")
    only(h.findings(), "resurrected")


def test_expired_message_delivered() -> None:
    h = clean_base()
    h.put("p", "p.2", "e1", expiry_ms=100)
    h.commit("p", "p.2")
    h.t += 5.0
    h.drain("e1")
    only(h.findings(), "expired")
    h = clean_base()  # expired and gone: allowed, counted
    h.put("p", "p.2", "e2", expiry_ms=100)
    h.commit("p", "p.2")
    r = check(h.events)
    assert r.ok and r.counts["expired, never delivered (allowed)"] == 1


def test_a_prepared_uow_takes_the_coordinators_resolution() -> None:
    h = clean_base()
    h.put("p", "p.2", "x1")
    h.op("p", "prepare", "ok", {"server_uow": "QM1.1.5", "qmgr": "QM1"}, uow="p.2", xid="x-p.2")
    h.op("coordinator", "resolve", "ok", xid="x-p.2", server_uow="QM1.1.5", qmgr="QM1", commit=False)
    h.drain("x1")  # backed out by the coordinator, yet present
    only(h.findings(), "phantom")


def test_resolved_twice_a_coordinators_commit_and_an_operators_backout_both_done() -> None:
    h = clean_base()
    h.put("p", "p.2", "x1")
    h.op("p", "prepare", "ok", {"server_uow": "QM1.1.5", "qmgr": "QM1"}, uow="p.2", xid="x-p.2")
    h.op("coordinator", "resolve", "ok", xid="x-p.2", server_uow="QM1.1.5", qmgr="QM1", commit=True)
    h.op("operator-heuristic", "resolve", "ok", xid="x-p.2", server_uow="QM1.1.5", qmgr="QM1", commit=False)
    h.get("c", "c.1", "x1")
    h.commit("c", "c.1")
    only(h.findings(), "resolved-twice")


def test_a_heuristic_resolve_refused_while_the_coordinators_went_through_is_no_finding() -> None:
    h = clean_base()
    h.put("p", "p.2", "x1")
    h.op("p", "prepare", "ok", {"server_uow": "QM1.1.5", "qmgr": "QM1"}, uow="p.2", xid="x-p.2")
    h.op("operator-heuristic", "resolve", "fail", {"reason": "MQRC_UNEXPECTED_ERROR"}, xid="x-p.2",
         server_uow="QM1.1.5", qmgr="QM1", commit=False)
    h.op("coordinator", "resolve", "ok", xid="x-p.2", server_uow="QM1.1.5", qmgr="QM1", commit=True)
    h.get("c", "c.1", "x1")
    h.commit("c", "c.1")
    assert check(h.events).ok


def test_a_prepare_refused_with_a_backout_is_a_known_backout() -> None:
    """A no vote (a structure a restore may rebuild without the PREPARE): the unit of work is backed out, known, so
    its put delivered is a phantom, not an unknown outcome inferred committed."""
    h = clean_base()
    h.put("p", "p.2", "x1")
    h.op("p", "prepare", "fail", {"reason": "MQRC_BACKED_OUT", "backed_out": True}, uow="p.2", xid="x-p.2")
    r = check(h.events)
    assert r.ok and not r.counts.get("unknown outcomes"), (r.summary(), r.counts)
    h.drain("x1")
    only(h.findings(), "phantom")


def test_deliveries_are_ordered_by_backout_count_not_by_when_a_slow_reply_arrived() -> None:
    """Soak seed 6 (a delayed CF link): c4's get took s1 first, but its reply arrived after the message had been
    backed out and delivered again to c2 (backout count 1). Ordered by reply time, c2's committed get looked
    undone and c4's backed-out get looked done: two false atomicity findings."""
    h = clean_base()
    h.put("p", "p.2", "s1")
    h.commit("p", "p.2")
    h.get("c2", "c2.1", "s1", backout_count=1)
    h.put("c2", "c2.1", "s2")
    h.commit("c2", "c2.1")
    h.get("c4", "c4.1", "s1", backout_count=0)  # the late reply
    h.backout("c4", "c4.1")
    h.drain("s2")
    r = check(h.events)
    assert r.ok, r.findings


def test_undelivered_consumed_by_a_get_whose_client_left() -> None:
    """A get whose client left while it waited (or whose reply never reached the client) that took a message
    nobody ever received is an 'undelivered' finding: told apart from a plain loss, and not reported when the
    message was delivered after all (docs/runbook.md, "Message sizes and clients that leave")."""
    h = clean_base()
    h.op("leaver", "get", "unknown", {"reason": "client left", "left": True}, uow=None, queue="Q1", syncpoint=False,
         wait_ms=20_000)
    h.put("p", None, "w1")  # put after the client left, while a server that missed it would still wait
    r = check(h.events)
    only(r.summary(), "undelivered")
    assert r.of("undelivered")[0].msgs == ["w1"] and "client left" in r.of("undelivered")[0].detail
    assert r.counts["gets whose client left while they waited"] == 1
    h.drain("w1")  # the get took nothing: w1 is there at the end
    assert check(h.events).ok
    h = clean_base()  # a get outside syncpoint whose reply was lost (a frame the client refused): unknown outcome
    h.put("p", None, "w2")
    h.op("c", "get", "unknown", {"reason": "MQRC_CONNECTION_BROKEN"}, uow=None, queue="Q1", syncpoint=False)
    only(h.findings(), "undelivered")
    h = clean_base()  # the same loss on another queue, or long before the put: a plain loss
    h.op("leaver", "get", "unknown", {"left": True}, uow=None, queue="Q3", syncpoint=False, wait_ms=100)
    h.op("leaver", "get", "unknown", {"left": True}, uow=None, queue="Q1", syncpoint=False, wait_ms=100)
    h.t += 5.0
    h.put("p", None, "w3")
    only(h.findings(), "lost")
    h = clean_base()  # a get by correlation id takes only a message with that correlation id
    h.op("leaver", "get", "unknown", {"left": True}, uow=None, queue="Q1", syncpoint=False, wait_ms=20_000,
         correlid="0a")
    h.op("p", "put", uow=None, msg="w4", queue="Q1", priority=0, persistent=True, syncpoint=False, expiry_ms=0,
         correlid="0b")
    only(h.findings(), "lost")


def test_stuck_entries_left_locked_after_the_drain() -> None:
    """An entry still locked after every in-doubt UOW was resolved and every queue drained is a 'stuck' finding
    (for example a UOW decided by a lagging peer restored as in doubt for nobody); expired messages waiting for
    their purge are not."""
    h = clean_base()
    h.note(what="drained", drained=2, **{"left in the structures": {
        "Q1": {"UP": 0, "UG": 1, "EX": 0, "CP": 0}, "Q2": {"UP": 2, "UG": 0, "EX": 0, "CP": 0},
        "Q3": {"UP": 0, "UG": 0, "EX": 3, "CP": 0}}})  # expired messages waiting for their purge are allowed
    only(h.findings(), "stuck", 2)


def test_restore_order_the_live_cf_and_restore_disagree() -> None:
    """The live CF and a restore agree on get order: a commit peer recovery completed counts at one LRSN on both
    (docs/log-format.md, `counts_at`); any other order is a 'restore-order' finding. Messages taken, added or
    backed out in between are allowed."""
    h = clean_base()
    h.fault(1, "peer-clock-skew", "inject")
    h.fault(1, "peer-clock-skew", "CF killed", live_order={"Q1": ["a", "x0", "c0", "b"], "Q3": ["k"]})
    h.fault(1, "peer-clock-skew", "restored order read",
            restored_order={"Q1": ["c0", "x0", "b", "new"], "Q3": ["k"]})
    h.fault(1, "peer-clock-skew", "recovered")
    only(h.findings(), "restore-order")


def test_restore_order_allows_gets_and_new_messages_in_between() -> None:
    h = clean_base()
    h.fault(1, "cf-kill", "inject")
    h.fault(1, "cf-kill", "CF killed", live_order={"Q1": ["a", "x0", "c0", "b"], "Q2": []})
    h.fault(1, "cf-kill", "restored order read",
            restored_order={"Q1": ["x0", "pending", "b", "new"], "Q2": ["late"]})
    h.fault(1, "cf-kill", "recovered")
    assert h.findings() == dict.fromkeys(FINDING_KINDS, 0)


# --- a restore owns its structure (docs/runbook.md): the faults' 'restore began' / 'restore ended' events --------

def restore_began(h: Hist, n: int, *, cf: str = "cf-1", structure: str = "APP1") -> None:
    h.t += 0.01
    h.events.append({"type": "fault", "t": round(h.t, 4), "phase": "restore began", "fault": 1, "kind": "k",
                     "restore": n, "structure": structure, "queues": ["Q1", "Q2"], "cf": cf})


def restore_ended(h: Hist, n: int, outcome: str = "ok", *, cf: str = "cf-1", structure: str = "APP1",
                  **extra: Any) -> None:
    h.t += 0.01
    h.events.append({"type": "fault", "t": round(h.t, 4), "phase": f"restore ended: {outcome}", "fault": 1,
                     "kind": "k", "restore": n, "structure": structure, "outcome": outcome, "cf": cf, **extra})


def test_restore_foreign_cf_a_restore_wrote_into_a_cf_started_empty_under_it() -> None:
    h = clean_base()
    restore_began(h, 1)
    restore_ended(h, 1, "failed", cf="cf-2", written_into_new_cf=3)  # verify found the load half in the new CF
    restore_began(h, 2, cf="cf-2")
    restore_ended(h, 2, cf="cf-2")
    r = check(h.events)
    only(r.summary(), "restore-foreign-cf")
    assert "restore 1 of APP1" in r.of("restore-foreign-cf")[0].detail


def test_restore_foreign_cf_a_restore_that_completed_on_another_cf_than_it_started_on() -> None:
    h = clean_base()
    restore_began(h, 1)
    restore_ended(h, 1, cf="cf-2")
    only(h.findings(), "restore-foreign-cf")


def test_a_restore_that_stopped_when_its_cf_was_replaced_and_wrote_nothing_is_clean() -> None:
    h = clean_base()
    restore_began(h, 1)
    restore_ended(h, 1, "stopped", cf="cf-2", written_into_new_cf=0)
    restore_began(h, 2, cf="cf-2")
    restore_ended(h, 2, cf="cf-2")
    assert check(h.events).ok


def test_restore_wiped_a_stale_restore_completed_after_another_and_wiped_acknowledged_work() -> None:
    """A stale restore that completes after another and wipes acknowledged work is a 'restore-wiped' finding: the
    slow restore began first; the fast one restored the structure; a client's put was acknowledged as committed;
    then the slow one loaded its older plan: the put is gone (lost, too)."""
    h = clean_base()
    restore_began(h, 1)  # slow to plan
    restore_began(h, 2)
    restore_ended(h, 2)
    h.put("p", "p.9", "w1")
    h.commit("p", "p.9")
    h.put("p", "p.10", "w2", queue="Q3")  # another structure's queue: not wiped by a restore of APP1
    h.commit("p", "p.10")
    h.drain("w2", "Q3")
    restore_ended(h, 1)
    r = check(h.events)
    assert r.summary()["restore-wiped"] == 1 and r.summary()["lost"] == 1, r.findings
    wiped = r.of("restore-wiped")[0]
    assert wiped.msgs == ["w1"] and "restore 1 of APP1" in wiped.detail and "p.9" in wiped.detail


def test_overlapping_restores_of_which_one_refused_are_clean() -> None:
    h = clean_base()
    restore_began(h, 1)
    restore_began(h, 2)
    restore_ended(h, 2)
    h.put("p", "p.9", "w1")
    h.commit("p", "p.9")
    h.drain("w1")
    restore_ended(h, 1, "refused")
    restore_began(h, 3, structure="APP2")  # another structure, overlapping: allowed
    restore_began(h, 4)
    restore_ended(h, 3, structure="APP2")
    restore_ended(h, 4)
    assert check(h.events).ok


def test_a_get_whose_reply_outlived_a_cf_loss_comes_first_by_when_it_was_asked() -> None:
    """cf-kill-twice (seed 4): c2's get took m4 from the CF just before it was lost; its SQM, held, replied after
    the restore, which had brought m4 back (the take's GET never reached a log it read), and after c1 had got m4
    and committed. Both deliveries have backout count 0; by reply time c1's committed get looked undone and c2's
    backed-out one done: two false atomicity findings."""
    h = clean_base()
    h.put("p", "p.2", "m4")
    h.commit("p", "p.2")
    h.n += 1
    late = h.n
    h.t += 0.01
    h.events.append({"type": "invoke", "id": late, "t": round(h.t, 4), "client": "c2", "op": "get", "uow": "c2.1",
                     "queue": "Q1"})
    h.fault(1, "cf-kill-twice", "inject")
    h.fault(1, "cf-kill-twice", "CF killed")
    h.get("c1", "c1.1", "m4")
    h.commit("c1", "c1.1")
    h.t += 0.01
    h.events.append({"type": "ok", "id": late, "t": round(h.t, 4), "msg": "m4", "crc_ok": True, "queue": "Q1",
                     "priority": 0, "backout_count": 0})
    h.op("c2", "commit", "fail", {"reason": "MQRC_BACKED_OUT", "backed_out": True}, uow="c2.1")
    h.fault(1, "cf-kill-twice", "recovered")
    r = check(h.events)
    assert r.ok, r.findings


def purge_of(h: Hist, *msgs: str) -> None:
    """What purge-then-cf-kill writes: the purge names the messages it discarded, then the CF is lost."""
    h.fault(1, "purge-then-cf-kill", "inject")
    h.fault(1, "purge-then-cf-kill", "purged", structure="APP1", msgs=list(msgs))
    h.fault(1, "purge-then-cf-kill", "CF killed")
    h.fault(1, "purge-then-cf-kill", "recovered")


def test_purge_undone_a_purged_message_delivered_after_the_purge() -> None:
    h = clean_base()
    h.put("p", "p.2", "m4")
    h.put("p", "p.2", "m5")
    h.commit("p", "p.2")
    purge_of(h, "m4", "m5")
    h.drain("m4")  # a restore that crossed the purge brought it back
    only(h.findings(), "purge-undone")
    assert check(h.events).of("purge-undone")[0].msgs == ["m4"]


def test_purged_messages_are_neither_lost_nor_evidence_about_their_uow() -> None:
    h = clean_base()
    h.put("p", "p.2", "m4")  # committed, then discarded by the purge: allowed
    h.put("p", "p.2", "m5", queue="Q3")  # its UOW's put on the other structure survives
    h.commit("p", "p.2")
    purge_of(h, "m4")
    h.drain("m5", "Q3")
    r = check(h.events)
    assert r.ok, r.summary()
    assert r.counts["purged (allowed)"] == 1


def test_a_stray_members_committed_puts_lost_with_the_cf_are_lost() -> None:
    """member-own-log-root, if the member joined: its puts are in the history as a client's; a restore that
    cannot read its log loses them, and the lost rule sees it."""
    h = clean_base()
    h.fault(1, "member-own-log-root", "inject")
    h.put("stray-1", "stray-1.1", "stray-1-0")
    h.put("stray-1", "stray-1.1", "stray-1-1")
    h.commit("stray-1", "stray-1.1")
    h.fault(1, "member-own-log-root", "CF killed")
    h.fault(1, "member-own-log-root", "recovered")
    only(h.findings(), "lost", 2)


def test_a_refused_stray_member_is_no_cf_loss_but_a_cf_killed_step_is() -> None:
    """member-own-log-root loses the CF only when the stray member got in (its "CF killed" step): a refusal
    alone must not make the non-persistent messages delivered after it count as resurrected."""
    h = Hist()
    h.put("p", None, "np1", persistent=False)
    h.fault(1, "member-own-log-root", "inject")
    h.fault(1, "member-own-log-root", "QM4 refused to join: exit code 2")
    h.fault(1, "member-own-log-root", "recovered")
    h.drain("np1")
    assert h.findings()["resurrected"] == 0
    h = Hist()
    h.put("p", None, "np1", persistent=False)
    h.fault(1, "member-own-log-root", "inject")
    h.fault(1, "member-own-log-root", "CF killed")
    h.fault(1, "member-own-log-root", "recovered")
    h.drain("np1")
    only(h.findings(), "resurrected")


def test_a_peer_clock_skew_that_failed_before_its_cf_loss_is_no_cf_loss() -> None:
    """peer-clock-skew loses the CF at its end (its "CF killed" step): one whose victim died while starting (the
    fault failed before) lost nothing, and a non-persistent message delivered after it is no resurrection."""
    for lost in (False, True):
        h = Hist()
        h.put("p", None, "np1", persistent=False)
        h.fault(1, "peer-clock-skew", "inject")
        if lost:
            h.fault(1, "peer-clock-skew", "CF killed")
        h.fault(1, "peer-clock-skew", "recovered")
        h.drain("np1")
        if lost:
            only(h.findings(), "resurrected")
        else:
            assert h.findings()["resurrected"] == 0


# --- units of work sent to a service (qsg.chaos.uowcheck) --------------------------------------------------------
RECV = {1: ["RECV_ONLY"], 2: ["RECV_FIRST", "RECV_LAST"], 3: ["RECV_FIRST", "RECV_MIDDLE", "RECV_LAST"]}


class Conv(Hist):
    """A history of conversation actions as qsg.chaos.conversations writes one."""

    def send(self, key: str, suow: str, msgs: list[str], end: str = "COMMIT") -> None:
        client = key.split(".")[0]
        for i, m in enumerate(msgs):
            self.op(client, "usend", "ok", {"suow": suow, "status": "RECEIVED", "messages": i + 1}, uow=key,
                    svc="SVC1", msg=m, idx=i, of=len(msgs))
        status = {"COMMIT": "ACCEPTED", "BACKOUT": "BACKEDOUT"}[end]
        self.sync(key, "sender", end, suow, status)

    def sync(self, key: str, role: str, option: str, suow: str, status: str | None, outcome: str = "ok",
             client: str = "", **result: Any) -> None:
        res = {"status": status, "suow": suow, **result} if outcome == "ok" else result
        self.op(client or key.split(".")[0], "usync", outcome, res, uow=key, svc="SVC1", option=option, role=role,
                suow=suow)

    def recv(self, key: str, suow: str, msgs: list[str], markers: list[str] | None = None,
             end: str | None = "COMMIT", *, to_end: bool = True, client: str = "", of: int = 0) -> None:
        client = client or key.split(".")[0]
        markers = markers or RECV[of or len(msgs)][:len(msgs)]
        for m, mark in zip(msgs, markers, strict=True):
            self.op(client, "urecv", "ok", {"msg": m, "crc_ok": True, "suow": suow, "recv": mark,
                                            "status": "DELIVERED"}, uow=key, svc="SVC1")
        if to_end:
            self.op(client, "urecv", "fail", {"reason": "MQRC_NO_MSG_AVAILABLE", "error": "EndOfUowError"},
                    uow=key, svc="SVC1")
        if end is not None:
            status = {"COMMIT": "PROCESSED", "BACKOUT": "ACCEPTED", "CANCEL": "POSTPONED"}[end]
            self.sync(key, "receiver", end, suow, status, client=client)

    def query(self, suow: str, status: str | None, client: str = "q", outcome: str = "ok", **result: Any) -> None:
        self.sync(f"{client}.q", "query", "QUERY", suow, status, outcome, client=client, **result)

    def final(self, suow: str, status: str | None, outcome: str = "ok", **result: Any) -> None:
        self.query(suow, status, "ufinal", outcome, **result)


def conv_base() -> Conv:
    """A clean history: a UOW sent, received whole after one postponement, processed; one backed out; one
    cancelled by its sender; one timed out; statuses queried along the way."""
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2", "a3"])
    h.query("U1", "ACCEPTED")
    h.recv("r.1", "U1", ["a1", "a2"], end="CANCEL", to_end=False, of=3)  # postponed after a partial receive
    h.query("U1", "POSTPONED")
    h.recv("r.2", "U1", ["a1", "a2", "a3"])
    h.send("s.2", "U2", ["b1", "b2"], end="BACKOUT")
    h.send("s.3", "U3", ["c1"])
    h.sync("s.3", "sender", "CANCEL", "U3", "CANCELLED")
    h.send("s.4", "U4", ["d1", "d2"])
    h.query("U4", "TIMEOUT")
    h.send("s.5", "U5", ["e1"])
    h.recv("udrain.1", "U5", ["e1"], client="udrain")
    for suow, status in (("U1", "PROCESSED"), ("U2", "BACKEDOUT"), ("U3", "CANCELLED"), ("U4", "TIMEOUT"),
                         ("U5", "PROCESSED")):
        h.final(suow, status)
    return h


def test_uow_a_clean_conversation_history_finds_nothing() -> None:
    s = check(conv_base().events)
    assert not any(s.summary().values()), s.findings
    assert s.counts["UOWs sent"] == 5 and s.counts["UOW receipts"] == 3
    assert s.counts["units of work"] == 0, "conversation ops are not MQ units of work"


def test_uow_received_interleaved_is_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2"])
    h.send("s.2", "U2", ["b1", "b2"])
    h.recv("r.1", "U1", ["a1", "b2"])
    h.recv("r.2", "U2", ["b1"], end="BACKOUT", to_end=False)
    assert check(h.events).summary()["uow-interleaved"] == 1


def test_uow_out_of_order_and_wrong_markers_are_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2", "a3"])
    h.recv("r.1", "U1", ["a2", "a1", "a3"])
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-order")
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2", "a3"])
    h.recv("r.1", "U1", ["a1", "a2", "a3"], ["RECV_FIRST", "RECV_LAST", "RECV_LAST"])
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-order")
    h = Conv()
    h.send("s.1", "U1", ["a1"])
    h.recv("r.1", "U1", ["a1"], ["RECV_FIRST"])
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-order")


def test_uow_a_partial_receipt_committed_or_ended_early_is_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2", "a3"])
    h.recv("r.1", "U1", ["a1", "a2"], to_end=False, of=3)  # committed after two of three
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-partial")
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2", "a3"])
    h.recv("r.1", "U1", ["a1", "a2"], end="BACKOUT", of=3)  # told "end of unit of work" after two of three
    h.recv("r.2", "U1", ["a1", "a2", "a3"])
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-partial")


def test_uow_a_backed_out_uow_received_is_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1"], end="BACKOUT")
    h.recv("r.1", "U1", ["a1"], end="BACKOUT")
    h.final("U1", "BACKEDOUT")
    # seen BACKEDOUT (the sender's backout) and DELIVERED after it: the status rule finds it too
    f = h.findings()
    assert f["uow-received-backedout"] == 1 and f["uow-status"] == 1, f


def test_uow_processed_twice_is_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2"])
    h.recv("r.1", "U1", ["a1", "a2"])
    h.recv("r.2", "U1", ["a1", "a2"])
    h.final("U1", "PROCESSED")
    f = h.findings()
    assert f["uow-duplicated"] == 1 and f["uow-status"] == 1, f  # DELIVERED after PROCESSED as well


def test_uow_committed_never_processed_is_lost() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2"])
    h.final("U1", None, "fail", reason="MQRC_UNKNOWN_OBJECT_NAME", error="UnknownUowError")
    only(h.findings(), "uow-lost")
    h = Conv()
    h.send("s.1", "U1", ["a1", "a2"])
    h.final("U1", "DISCARDED")  # reachable (a non-persistent UOW's restart) but not for a UOW committed whole
    only(h.findings(), "uow-lost")
    h = Conv()  # the final pass could not ask: counted, not a finding
    h.send("s.1", "U1", ["a1"])
    h.final("U1", None, "unknown", reason="MQRC_CONNECTION_BROKEN", error="OutcomeUnknownError")
    assert not any(h.findings().values())


def test_uow_cancelled_and_processed_is_found() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1"])
    h.sync("s.1", "sender", "CANCEL", "U1", "CANCELLED")
    h.recv("r.1", "U1", ["a1"])
    h.final("U1", "CANCELLED")
    f = h.findings()
    assert f["uow-cancelled-processed"] == 1 and f["uow-status"] == 1, f


def test_uow_still_active_after_the_drain_is_unsettled() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1"])
    h.final("U1", "ACCEPTED")
    only(h.findings(), "uow-unsettled")


def test_uow_statuses_follow_the_table_and_the_restart_rule() -> None:
    h = Conv()  # DELIVERED, then ACCEPTED again (a restart: delivery counted), then processed: allowed
    h.send("s.1", "U1", ["a1"])
    h.recv("r.1", "U1", ["a1"], end=None)
    h.query("U1", "ACCEPTED")
    h.recv("r.2", "U1", ["a1"])
    h.query("U1", "PROCESSED")
    h.final("U1", "PROCESSED")
    assert not any(h.findings().values()), h.findings()
    h = Conv()  # PROCESSED, then ACCEPTED: no transition leads back from a final status
    h.send("s.1", "U1", ["a1"])
    h.recv("r.1", "U1", ["a1"])
    h.query("U1", "ACCEPTED")
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-status")
    h = Conv()  # RECEIVED after ACCEPTED
    h.send("s.1", "U1", ["a1"])
    h.query("U1", "RECEIVED")
    h.final("U1", "TIMEOUT")
    only(h.findings(), "uow-status")
    h = Conv()  # a status not in the model
    h.send("s.1", "U1", ["a1"])
    h.query("U1", "FROZEN")
    h.final("U1", "TIMEOUT")
    only(h.findings(), "uow-status")


def test_uow_overlapping_calls_are_not_ordered() -> None:
    """Two QUERYs whose calls overlap may see the statuses in either order: only a call that completed before
    another began orders their statuses."""
    h = Conv()
    h.send("s.1", "U1", ["a1"])
    h.recv("r.1", "U1", ["a1"], end=None)
    t = h.t
    h.query("U1", "PROCESSED")
    h.query("U1", "DELIVERED")
    # the PROCESSED query began before the DELIVERED one completed
    h.events[-4]["t"], h.events[-3]["t"], h.events[-2]["t"], h.events[-1]["t"] = t + 0.01, t + 0.05, t + 0.02, t + 0.03
    h.sync("r.1", "receiver", "COMMIT", "U1", "PROCESSED", client="r")
    h.final("U1", "PROCESSED")
    assert not any(h.findings().values()), h.findings()


def test_uow_processed_without_a_receiver_commit_is_a_status_finding() -> None:
    h = Conv()
    h.send("s.1", "U1", ["a1"])
    h.recv("r.1", "U1", ["a1"], end="BACKOUT")
    h.final("U1", "PROCESSED")
    only(h.findings(), "uow-status")


def test_uow_reachability_matches_the_state_table() -> None:
    from qsg.chaos.uowcheck import allowed_after

    assert allowed_after("RECEIVED", "PROCESSED") and allowed_after("DELIVERED", "ACCEPTED")
    assert allowed_after("POSTPONED", "TIMEOUT") and allowed_after("ACCEPTED", "DISCARDED")
    assert not allowed_after("PROCESSED", "ACCEPTED") and not allowed_after("ACCEPTED", "RECEIVED")
    assert not allowed_after("CANCELLED", "PROCESSED") and not allowed_after("BACKEDOUT", "ACCEPTED")


# --- publishers and subscribers (qsg.chaos.pubsubcheck) -----------------------------------------------------------
class Pubs(Hist):
    """A history of publish/subscribe actions as qsg.chaos.pubsub_actions writes one."""

    def subscribe(self, sub: str, durable: bool = True, client: str = "", home: str = "QM1.1",
                  pc: int = 0) -> None:
        self.op(client or sub, "psub", "ok", {"position_lrsn": 0, "home": home, "subscribed_pc": pc, "received": 0,
                                              "durable": durable}, uow=f"{sub}.s", topic="NEWS", sub=sub,
                durable=durable)

    def publish(self, key: str, pub: str, msgs: list[str], end: str = "COMMIT", outcome: str = "ok",
                **result: Any) -> None:
        client = key.split(".")[0]
        for i, m in enumerate(msgs):
            self.op(client, "ppub", "ok", {"pub": pub, "messages": i + 1}, uow=key, topic="NEWS", msg=m, idx=i,
                    of=len(msgs))
        self.op(client, "psync", outcome, result, uow=key, topic="NEWS", option=end, role="publisher", pub=pub)

    def recv(self, key: str, sub: str, pubs: list[tuple[str, int, list[str]]], end: str | None = "COMMIT",
             outcome: str = "ok", client: str = "", **result: Any) -> None:
        """One receipt: each (publication id, commit LRSN, its messages) received, then ``end``."""
        client = client or sub
        for pub, lrsn, msgs in pubs:
            self.op(client, "precv", "ok", {"pub": pub, "lrsn": lrsn, "msgs": [[m, True] for m in msgs],
                                            "persistent": True}, uow=key, topic="NEWS", sub=sub)
        if end is not None:
            self.op(client, "psync", outcome, result, uow=key, topic="NEWS", option=end, role="subscriber", sub=sub)


P1, P2, P3 = ("P1", 10, ["a1", "a2"]), ("P2", 20, ["b1"]), ("P3", 30, ["c1", "c2", "c3"])


def pubs_base() -> Pubs:
    """Two durable subscribers and a non-durable one; three publications committed and one backed out; d1 backs
    one receipt out and gets it again; everything drained."""
    h = Pubs()
    h.subscribe("d0")
    h.subscribe("d1")
    h.subscribe("n4", durable=False)
    h.publish("p.1", "P1", ["a1", "a2"])
    h.publish("p.2", "P2", ["b1"])
    h.publish("p.3", "PX", ["x1"], end="BACKOUT")
    h.recv("d0.1", "d0", [P1, P2])
    h.recv("d1.1", "d1", [P1], end="BACKOUT")
    h.recv("n4.1", "n4", [P1])
    h.publish("p.4", "P3", ["c1", "c2", "c3"])
    h.recv("pdrain.1", "d0", [P3], client="pdrain")
    h.recv("pdrain.2", "d1", [P1, P2, P3], client="pdrain")
    return h


def pub_only(h: Pubs, kind: str, n: int = 1) -> None:
    only(check(h.events).summary(), kind, n)


def test_pub_a_clean_history_finds_nothing() -> None:
    r = check(pubs_base().events)
    assert not any(r.summary().values()), r.findings
    assert r.counts["publications committed"] == 3 and r.counts["publications aborted"] == 1
    assert r.counts["publication redeliveries after backout"] == 1
    assert r.counts["units of work"] == 0, "pub/sub ops are not MQ units of work"


def test_pub_lost_a_durable_subscriber_never_committed_a_publication() -> None:
    h = pubs_base()
    h.publish("p.5", "P4", ["e1"])
    h.recv("pdrain.3", "d0", [("P4", 40, ["e1"])], client="pdrain")  # d1 never gets it
    pub_only(h, "pub-lost")
    h2 = pubs_base()
    h2.publish("p.5", "P4", ["e1"])
    h2.recv("pdrain.3", "d0", [("P4", 40, ["e1"])], end="BACKOUT", client="pdrain")
    h2.recv("pdrain.4", "d1", [("P4", 40, ["e1"])], client="pdrain")
    pub_only(h2, "pub-lost")  # received but backed out: not committed


def test_pub_a_subscriber_whose_commit_is_unknown_may_have_committed_it() -> None:
    h = pubs_base()
    h.publish("p.5", "P4", ["e1"])
    h.recv("pdrain.3", "d0", [("P4", 40, ["e1"])], client="pdrain")
    h.recv("pdrain.4", "d1", [("P4", 40, ["e1"])], outcome="unknown", client="pdrain")
    assert not any(check(h.events).summary().values())


def test_pub_committed_before_a_subscriber_subscribed_is_neither_owed_nor_allowed() -> None:
    h = pubs_base()
    h.subscribe("d2")  # after P1, P2 and P3 committed: owed none of them
    assert not any(check(h.events).summary().values())
    h.recv("d2.1", "d2", [P1])
    pub_only(h, "pub-before-subscribe")


def test_pub_a_publication_committed_while_a_subscribe_ran_may_go_either_way() -> None:
    h = Pubs()
    h.subscribe("d0")
    h.n += 1
    h.events.append({"type": "invoke", "id": h.n, "t": 0.5, "client": "d1", "op": "psub", "uow": "d1.s",
                     "topic": "NEWS", "sub": "d1", "durable": True})
    h.t = 0.5
    h.publish("p.1", "P1", ["a1"])  # its COMMIT runs while d1's subscribe has not answered
    h.events.append({"type": "ok", "id": h.n - 1, "t": h.t + 0.01, "home": "QM1.1", "subscribed_pc": 0})
    h.t += 0.02
    h.recv("pdrain.1", "d0", [("P1", 10, ["a1"])], client="pdrain")
    assert not any(check(h.events).summary().values())
    h.recv("pdrain.2", "d1", [("P1", 10, ["a1"])], client="pdrain")
    assert not any(check(h.events).summary().values())


def test_pub_one_committed_before_a_subscribe_behind_a_publication_still_open_may_reach_it() -> None:
    """A subscribe starts below an open publication (docs/pubsub.md): one committed before it, but held back behind
    that open one, reaches the new subscriber. Allowed (and counted) only when another publication's COMMIT began
    before its own answered and was still under way when the subscribe was asked."""
    def history(open_until: float) -> Pubs:
        h = Pubs()
        h.subscribe("d0")
        h.n += 1  # P1's COMMIT: its puts made, its answer at open_until
        open_commit, h.t = h.n, h.t + 0.01
        h.events.append({"type": "invoke", "id": open_commit, "t": h.t, "client": "p", "op": "psync", "uow": "p.1",
                         "topic": "NEWS", "option": "COMMIT", "role": "publisher", "pub": "P1"})
        h.publish("q.1", "P2", ["b1"])  # committed and answered while P1 is open
        h.events.append({"type": "ok", "id": open_commit, "t": open_until})
        h.t = max(h.t, 0.5)
        h.subscribe("d2")  # asked at about 0.51
        h.recv("d2.1", "d2", [("P2", 20, ["b1"])])
        return h

    r = check(history(open_until=0.9).events)  # P1 still open when d2 subscribed
    assert r.summary()["pub-before-subscribe"] == 0
    assert r.counts["publications held back at a subscribe, received (allowed)"] == 1
    assert check(history(open_until=0.2).events).summary()["pub-before-subscribe"] == 1  # P1 answered before


def test_pub_one_committed_in_a_fault_window_may_reach_a_later_subscriber() -> None:
    """A COMMIT answered while the CF was lost (its structure restored meanwhile) is completed in the CF once it is
    back, after a subscribe made then: open there when the subscribe started below it, it may reach that
    subscriber (counted). The same COMMIT answered outside every fault window reaching it is a finding."""
    def history(in_fault: bool) -> Pubs:
        h = Pubs()
        h.subscribe("d0")
        if in_fault:
            h.fault(1, "cf-hang", "inject")
        h.publish("p.1", "P1", ["a1"])  # answered "ok": logged, its CF work waits for the restore
        if in_fault:
            h.fault(1, "cf-hang", "recovered")
        h.t += 0.5
        h.subscribe("n4", durable=False)
        h.recv("n4.1", "n4", [("P1", 10, ["a1"])])
        h.recv("pdrain.1", "d0", [("P1", 10, ["a1"])], client="pdrain")
        return h

    r = check(history(in_fault=True).events)
    assert r.summary()["pub-before-subscribe"] == 0, r.findings
    assert r.counts["publications committed in a fault window, received by a later subscriber (allowed)"] == 1
    pub_only(history(in_fault=False), "pub-before-subscribe")


def test_pub_a_backed_out_or_never_committed_publication_delivered_is_found() -> None:
    h = pubs_base()
    h.recv("pdrain.3", "d0", [("PX", 25, ["x1"])], client="pdrain")
    pub_only(h, "pub-backedout-delivered")
    h2 = pubs_base()
    h2.publish("p.5", "P9", ["f1"], outcome="fail", reason="MQRC_RESOURCE_PROBLEM", error="PstoreUnavailableError",
               backed_out=True)
    h2.recv("pdrain.3", "d0", [("P9", 50, ["f1"])], client="pdrain")
    pub_only(h2, "pub-backedout-delivered")


def test_pub_unknown_outcome_goes_to_all_durable_subscribers_or_to_none() -> None:
    h = pubs_base()
    h.publish("p.5", "P4", ["e1"], outcome="unknown", reason="MQRC_UNKNOWN", error="OutcomeUnknownError")
    assert not any(check(h.events).summary().values()), "delivered to none: it did not commit"
    h.recv("pdrain.3", "d0", [("P4", 40, ["e1"])], client="pdrain")
    pub_only(h, "pub-split")  # d0 has it, d1 does not
    h.recv("pdrain.4", "d1", [("P4", 40, ["e1"])], client="pdrain")
    r = check(h.events)
    assert not any(r.summary().values()), r.findings
    assert r.counts["publications of unknown outcome: committed"] == 1


def test_pub_duplicated_committed_twice_or_received_again_after_its_commit() -> None:
    h = pubs_base()
    h.recv("pdrain.3", "d0", [P3], client="pdrain")
    pub_only(h, "pub-duplicated")
    h2 = pubs_base()
    h2.recv("pdrain.3", "d0", [P3], end="BACKOUT", client="pdrain")  # received again, even if not committed
    pub_only(h2, "pub-duplicated")


def test_pub_partial_a_delivery_that_is_not_the_whole_publication() -> None:
    h = pubs_base()
    h.recv("n4.2", "n4", [("P3", 30, ["c1", "c3"])])  # a message missing
    pub_only(h, "pub-partial")
    h2 = pubs_base()
    h2.recv("n4.2", "n4", [("P3", 30, ["c1", "c3", "c2"])])  # out of order
    pub_only(h2, "pub-partial")
    h3 = pubs_base()
    h3.recv("n4.2", "n4", [("P3", 30, ["c1", "c2", "c3", "b1"])])  # two publications in one
    pub_only(h3, "pub-partial")


def test_pub_order_a_subscriber_committed_a_later_publication_first() -> None:
    h = Pubs()
    h.subscribe("d0")
    h.publish("p.1", "P1", ["a1", "a2"])
    h.publish("p.2", "P2", ["b1"])
    h.recv("pdrain.1", "d0", [P2, P1], client="pdrain")
    f = check(h.events).summary()
    assert f["pub-order"] >= 1 and all(v == 0 for k, v in f.items() if k != "pub-order"), f
    h2 = Pubs()
    h2.subscribe("d0")
    h2.publish("p.1", "P1", ["a1", "a2"])
    h2.publish("p.2", "P2", ["b1"])
    h2.recv("pdrain.1", "d0", [("P1", 20, ["a1", "a2"]), ("P2", 10, ["b1"])], client="pdrain")  # positions fall
    pub_only(h2, "pub-order")


def test_pub_order_holds_only_for_a_commit_answered_ok_outside_the_faults() -> None:
    """A COMMIT whose outcome the publisher never learnt (the CF lost under it), or one answered during a fault,
    is completed when the CF or its restore is back, after publications committed meanwhile: delivered after
    them, as allowed (a slow restore, for example one with a tiny memory limit, makes that window seconds long)."""
    for outcome, in_fault in (("unknown", False), ("ok", True)):
        h = Pubs()
        h.subscribe("d0")
        if in_fault:
            h.fault(1, "cf-kill", "inject")
        h.publish("p.1", "P1", ["a1", "a2"], outcome=outcome, reason="MQRC_CONNECTION_BROKEN",
                  error="OutcomeUnknownError")
        if in_fault:
            h.fault(1, "cf-kill", "recovered")
            h.t += 5  # past the settling time: P2 is calm
        h.publish("p.2", "P2", ["b1"])
        h.recv("pdrain.1", "d0", [("P2", 20, ["b1"]), ("P1", 30, ["a1", "a2"])], client="pdrain")
        r = check(h.events)
        assert not any(r.summary().values()), (outcome, in_fault, r.findings)


def test_pub_a_purged_publication_never_delivered_is_not_lost() -> None:
    """A purge discards what the structure holds, subscription queues too (the fault names the messages): a
    publication it discarded is allowed never to reach a durable subscriber, as a purged message on a queue."""
    h = Pubs()
    h.subscribe("d0")
    h.publish("p.1", "P1", ["a1", "a2"])
    h.publish("p.2", "P2", ["b1"])
    h.recv("pdrain.1", "d0", [("P2", 20, ["b1"])], client="pdrain")
    pub_only(h, "pub-lost")
    h.fault(1, "purge-then-cf-kill", "purged", structure="APP1", msgs=["a1", "a2"])
    r = check(h.events)
    assert not any(r.summary().values()), r.findings
    assert r.counts["publications purged (allowed)"] == 1


def test_pub_a_purge_of_the_topics_structure_ends_the_subscriptions_until_they_subscribe_again() -> None:
    """A purge discards the topic's subscriptions with everything else (found by seeds 8 and 10 of the restore
    kinds: 48-90 'lost' publications, each committed between the purge and its subscriber's new subscribe): a
    publication committed meanwhile is not for the subscriber; one committed after it subscribed again is."""
    h = Pubs()
    h.subscribe("d0")
    h.fault(1, "purge-then-cf-kill", "inject")
    h.fault(1, "purge-then-cf-kill", "purged", structure="APP1", msgs=[])
    h.publish("p.1", "P1", ["a1"])  # no subscription: the purge took it
    assert not any(check(h.events).summary().values())
    h.subscribe("d0")
    h.publish("p.2", "P2", ["b1"])
    pub_only(h, "pub-lost")  # subscribed again: P2 is d0's
    h2 = Pubs()
    h2.subscribe("d0")
    h2.fault(1, "purge-then-cf-kill", "inject")
    h2.fault(1, "purge-then-cf-kill", "purged", structure="APP2", msgs=[])  # not the topic's structure
    h2.publish("p.1", "P1", ["a1"])
    pub_only(h2, "pub-lost")


def test_pub_phantom_and_corrupted_deliveries() -> None:
    h = pubs_base()
    h.recv("n4.2", "n4", [("PZ", 90, ["z1"])])
    pub_only(h, "pub-phantom")
    h2 = pubs_base()
    h2.op("n4", "precv", "ok", {"pub": "P3", "lrsn": 30, "msgs": [["c1", True], ["c2", False], ["c3", True]]},
          uow="n4.2", topic="NEWS", sub="n4")
    pub_only(h2, "corrupted")


def test_pub_a_non_durable_incarnation_is_judged_on_its_own() -> None:
    h = pubs_base()
    # n4's member restarted: its subscription went, it subscribed again (a new incarnation) and gets P3 only.
    h.subscribe("n4", durable=False, home="QM1.2", pc=5)
    h.publish("p.5", "P4", ["e1"])
    h.recv("n4.2", "n4", [("P4", 40, ["e1"])])
    h.recv("pdrain.3", "d0", [("P4", 40, ["e1"])], client="pdrain")
    h.recv("pdrain.4", "d1", [("P4", 40, ["e1"])], client="pdrain")
    assert not any(check(h.events).summary().values()), "n4 owes nothing: it is not durable"
    h2 = pubs_base()
    h2.subscribe("n4", durable=False, home="QM1.2", pc=5)
    h2.recv("n4.3", "n4", [P1])  # the new incarnation got one committed before it subscribed
    pub_only(h2, "pub-before-subscribe")


# --- liveness: every member serves again within its bound after a fault, and keeps serving ------------------------
def faulted(after: dict[str, float | None], *, bound: float = 26.0, next_pids: dict[str, int | None] | None = None,
            kind: str = "sqm-kill") -> Hist:
    """A clean history with one fault: the members' processes at its injection, when each served again after its
    heal (the runner's 'serving again' events), its recovery, and the processes at the workload's end."""
    h = clean_base()
    pids = {"QM1": 11, "QM2": 12, "QM3": 13}
    h.fault(1, kind, "inject", target="QM1", pids=pids, serve_bound_s=bound)
    h.fault(1, kind, "heal", target="QM1")
    recovered = {**pids, "QM1": 21}
    for member, s in after.items():
        h.fault(1, kind, "serving again", member=member, pid=recovered[member], after_heal_s=s, bound_s=bound)
    h.fault(1, kind, "recovered", service_s=5.0, pids=recovered)
    h.note(what="workload stop", pids=recovered if next_pids is None else next_pids)
    return h


def test_liveness_every_member_serving_again_within_its_bound_is_clean() -> None:
    r = check(faulted({"QM1": 4.2, "QM2": 0.1, "QM3": 0.2}).events)
    assert r.ok, r.findings


def test_liveness_a_member_serving_again_past_its_bound_or_never() -> None:
    h = faulted({"QM1": 31.5, "QM2": 0.1, "QM3": None})
    only(h.findings(), "liveness", 2)
    details = [f.detail for f in check(h.events).of("liveness")]
    assert any("QM1 served again 31.5 s" in d and "bound of 26.0 s" in d for d in details), details
    assert any("QM3 did not serve again" in d for d in details), details


def test_liveness_a_member_that_served_then_stopped_before_the_next_fault() -> None:
    """Fenced right after it served (a restart longer than its lease): its process is gone by the next mark."""
    h = faulted({"QM1": 4.0, "QM2": 0.1, "QM3": 0.2}, next_pids={"QM1": None, "QM2": 12, "QM3": 13})
    only(h.findings(), "liveness")
    assert "QM1 served again after fault 1, then stopped" in check(h.events).of("liveness")[0].detail
    restarted = faulted({"QM1": 4.0, "QM2": 0.1, "QM3": 0.2}, next_pids={"QM1": 21, "QM2": 12, "QM3": 31})
    only(restarted.findings(), "liveness")
    assert "replaced by 31" in check(restarted.events).of("liveness")[0].detail


def test_liveness_a_history_without_the_runners_records_is_not_judged() -> None:
    h = clean_base()
    h.fault(1, "sqm-kill", "inject", target="QM1")
    h.fault(1, "sqm-kill", "recovered", service_s=5.0)
    assert check(h.events).ok


# --- isolation: no application reads or acts on another user's work -------------------------------------------------
def snooped(outcome: str, result: dict[str, Any]) -> Hist:
    h = clean_base()
    h.fault(1, "snoop", "inject", target="QM2")
    h.op("snoop1", "snoop", "fail", {"reason": "MQRC_NOT_AUTHORIZED", "error": "NotAuthorizedError"},
         what="browse", as_user="", token="own", target="SVC1.UOWCTL")
    h.op("snoop1", "snoop", outcome, result, what="CANCEL", as_user="c3", token="guess", target="ab12")
    h.op("snoop1", "snoop", "ok", {"breach": False, "detail": "[]"}, what="subscriptions", as_user="mallory",
         token="own", target="NEWS")
    return h


def test_isolation_every_attempt_refused_is_clean() -> None:
    r = check(snooped("fail", {"reason": "MQRC_UOW_STATUS", "error": "UowStatusError"}).events)
    assert r.ok, r.findings
    assert r.counts["snoop attempts"] == 3 and r.counts["snoop attempts refused"] == 2
    assert "unknown outcomes" not in r.counts, "a snoop attempt is no unit of work"


def test_isolation_an_attempt_not_refused() -> None:
    h = snooped("ok", {"breach": True, "detail": "{'uow': 'ab12', 'status': 'CANCELLED'}"})
    only(h.findings(), "isolation")
    detail = check(h.events).of("isolation")[0].detail
    assert "CANCEL as c3 (token guess) on ab12" in detail and "CANCELLED" in detail


def test_the_workload_records_the_message_a_pending_get_delivered() -> None:
    """What the workload and the drain record of an unknown outcome: the delivered message of a pending get (its
    OutcomePendingError.message), nothing for any other unknown outcome."""
    body = make_body("m9", 64)
    e = OutcomePendingError("the commit of unit of work u1 is logged, but APP1 could not take it now")
    e.message = Message(body=body, queue="Q1", backout_count=2)
    assert pending_delivery(e, "QM1") == {"msg": "m9", "crc_ok": True, "queue": "Q1", "priority": 0,
                                          "persistent": True, "backout_count": 2, "qmgr": "QM1"}
    assert pending_delivery(OutcomePendingError("a commit"), "QM1") == {}
    assert pending_delivery(OutcomeUnknownError("the connection died"), "QM1") == {}
