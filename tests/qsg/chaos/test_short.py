"""The chaos suite in its short mode: a real group (CF, 3 SQM servers, backup scheduler), real faults (kill -9
of an SQM, kill -9 of the CF with restore, a cut CF link, half-open client connections), two seeds; nothing
lost, duplicated, phantom, half-applied or corrupted. The soak (every kind, 20 seeds) is marked `soak`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qsg.chaos.faults import KINDS, RESTORE_ENGINES, SHORT_KINDS, parse_kinds, restore_engine, schedule
from qsg.chaos.workload import client_plan, make_body, parse_body

QUEUES = ("Q1", "Q2", "Q3")


def chaos(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``cfemu chaos``; a run's mix has the REST and kombu kinds (puts and gets through the members' REST doors, and
    publishes and deliveries through the kombu transport)."""
    rest = ("--rest", "--kombu") if args[:1] in (("run",), ("soak",)) else ()
    return subprocess.run([sys.executable, "-m", "qsg.cli", "chaos", *args, *rest], capture_output=True, text=True,
                          timeout=timeout)


def why_failed(summary: dict[str, Any], run_dir: Path) -> str:
    """What a failed run found, readable in a CI log: the findings that are not zero, the report's Findings section
    (each names its messages and UOWs), what the structures still held and the fault errors."""
    report = (run_dir / "report.md").read_text()
    section = report[report.find("## Findings"):report.find("## Counts")]
    found = {k: v for k, v in summary["findings"].items() if v}
    left = summary.get("extra", {}).get("left in the structures")
    return f"findings {found}; left in the structures {left}; fault errors {summary['fault_errors']}\n{section}"


def test_the_same_seed_gives_the_same_workload_and_fault_schedule() -> None:
    def plan(seed: int, client: int, rest: bool = False, kombu: bool = False) -> list[Any]:
        it = client_plan(seed, client, QUEUES, rest=rest, kombu=kombu)
        return [next(it) for _ in range(200)]

    assert plan(7, 3) == plan(7, 3) and plan(7, 3) != plan(8, 3) and plan(7, 3) != plan(7, 4)
    assert plan(7, 3, rest=True) == plan(7, 3, rest=True) and plan(7, 3, rest=True) != plan(7, 3)
    assert {a.kind for a in plan(7, 3, rest=True)} >= {"rest", "uow", "conv", "pub"}
    assert "rest" not in {a.kind for a in plan(7, 3)}  # only when the run's mix has it
    assert plan(7, 3, kombu=True) == plan(7, 3, kombu=True) and "kombu" in {a.kind for a in plan(7, 3, kombu=True)}
    assert "kombu" not in {a.kind for a in plan(7, 3, rest=True)}
    both = plan(7, 3, rest=True, kombu=True)
    assert {"rest", "kombu"} <= {a.kind for a in both}
    names = ["QM1", "QM2", "QM3"]
    assert schedule(7, KINDS, 60, names, lease_ms=3000) == schedule(7, KINDS, 60, names, lease_ms=3000)
    assert schedule(7, KINDS, 60, names, lease_ms=3000) != schedule(8, KINDS, 60, names, lease_ms=3000)
    every = {f.kind for seed in range(1, 21) for f in schedule(seed, parse_kinds("all"), 30, names, lease_ms=3000)}
    assert every == set(parse_kinds("all")), "a 20-seed soak of 30 s (test_soak_every_fault_kind) covers every kind"
    # Each restore's engine options come from the seed and its number: every one within a few seeds (a tiny
    # memory limit and worker processes among them), the same for a seed run again.
    engines = {tuple(sorted(restore_engine(seed, n).items())) for seed in (1, 2) for n in (1, 2, 3)}
    assert engines == {tuple(sorted(e.items())) for e in RESTORE_ENGINES}
    assert [restore_engine(7, n) for n in range(1, 9)] == [restore_engine(7, n) for n in range(1, 9)]


def test_message_bodies_carry_id_and_checksum() -> None:
    body = make_body("7-3-12", 300)
    assert parse_body(body) == ("7-3-12", True)
    assert parse_body(body[:-1] + bytes([body[-1] ^ 1])) == ("7-3-12", False)
    assert parse_body(b"not a chaos message") == (None, False)
    assert body.decode("ascii")  # text: the REST door takes and gives text messages only


def assert_found_nothing(out: subprocess.CompletedProcess[str], run_dir: Path) -> None:
    """A run's --json summary says nothing was found and no fault failed; if not, the message is why_failed's (the
    summary printed with --json leaves the finding details out: they are in the run directory's report)."""
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert all(v == 0 for v in s["findings"].values()) and not s["fault_errors"], why_failed(s, run_dir)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_failed_run_says_what_it_found(tmp_path: Path) -> None:
    """A soak run's failure names its findings from the run directory, not from a key --json does not print."""
    summary = {"findings": {"lost": 1, "phantom": 0}, "fault_errors": [], "extra": {}, "ok": False}
    (tmp_path / "report.md").write_text("# Chaos run\n## Findings\n- lost: message 9-3-12 (UOW c3.7)\n## Counts\n")
    out = subprocess.CompletedProcess(["chaos"], 1, json.dumps(summary), "")
    with pytest.raises(AssertionError, match=r"(?s)'lost': 1.*9-3-12"):
        assert_found_nothing(out, tmp_path)


def test_bad_fault_kind_is_refused_by_name(tmp_path: Path) -> None:
    out = chaos("run", "--faults", "sqm-kill,meteor-strike", "--dir", str(tmp_path))
    assert out.returncode == 2 and "meteor-strike" in out.stderr
    assert not (tmp_path / "history.jsonl").exists()


# Seed 2 is a second schedule of the same faults: it runs with -m soak (31 s), to keep the default suite under 20
# minutes; seed 1 and the fault kinds' own short runs below stay in it.
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.soak)])
def test_short_run_finds_nothing(tmp_path: Path, seed: int) -> None:
    out = chaos("run", "--seed", str(seed), "--duration", "22", "--faults", ",".join(SHORT_KINDS), "--json",
                "--dir", str(tmp_path))
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert out.returncode == 0, why_failed(s, tmp_path)
    assert len(s["faults"]) >= 2 and not s["fault_errors"]
    assert all(f["service_s"] is not None for f in s["faults"])
    assert s["operations"] > 1000 and s["committed_uows"] > 200
    assert s["counts"]["REST puts acknowledged"] > 10 and s["counts"]["REST gets received"] > 10, s["counts"]
    assert s["counts"]["kombu publishes acknowledged"] > 10, s["counts"]
    assert s["counts"]["kombu deliveries acknowledged"] > 10 and s["counts"]["kombu deliveries requeued"] > 0, s["counts"]
    assert all(v == 0 for v in s["findings"].values())
    assert s["counts"].get("unknown outcomes", 0) >= 0 and s["recovery"]["service_s"]
    for name in ("history.jsonl", "summary.json", "findings.json", "faults.json", "throughput.svg", "report.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "throughput.svg").read_text().startswith("<svg")
    assert (tmp_path / "process-logs" / "QM1.log").stat().st_size > 0
    assert not (tmp_path / "cluster").exists(), "the cluster's logs and backups are removed after the run"
    began = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()
             if '"restore began"' in line]
    assert all("engine" in e for e in began)  # which engine options each restore ran with
    assert bool(began) == any(f["kind"] == "cf-kill" for f in s["faults"])


@pytest.mark.e2e
@pytest.mark.slow
def test_cf_kill_recauto_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind cf-kill-recauto: the CF killed under the chaos workload with RECAUTO on; nobody restores by
    hand; the checker finds nothing lost, duplicated or out of order."""
    out = chaos("run", "--seed", "3", "--duration", "16", "--faults", "cf-kill-recauto", "--json",
                "--dir", str(tmp_path))
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert out.returncode == 0, why_failed(s, tmp_path)
    assert s["faults"] and not s["fault_errors"]
    assert all(f["kind"] == "cf-kill-recauto" and f["service_s"] is not None for f in s["faults"])
    assert all(f["timings"]["recauto_s"] > 0 and f["timings"]["cf_restarts"] == 1 for f in s["faults"])
    assert all(v == 0 for v in s["findings"].values())
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "process-logs").glob("QM*.log"))
    assert "CSQE131I recovery of APP1 completed" in logs and "CSQE131I recovery of APP2 completed" in logs


@pytest.mark.timed
@pytest.mark.slow
def test_pstore_disconnect_and_no_new_uows_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kinds pstore-disconnect and no-new-uows: a structure's persistent store disconnected (then its new
    units of work refused) for seconds under the workload, publishers and subscribers included; what was refused is
    a FAIL outcome with its reason, and the checker finds nothing lost, twice, half-delivered or out of order."""
    out = chaos("run", "--seed", "2", "--duration", "14", "--faults", "pstore-disconnect,no-new-uows", "--json",
                "--dir", str(tmp_path))
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert out.returncode == 0, why_failed(s, tmp_path)
    assert {f["kind"] for f in s["faults"]} == {"pstore-disconnect", "no-new-uows"} and not s["fault_errors"]
    assert all(f["service_s"] is not None and f["timings"]["off_s"] >= 2.0 for f in s["faults"])
    assert all(v == 0 for v in s["findings"].values())
    assert s["counts"]["publications committed"] > 20 and s["counts"]["publication deliveries"] > 80
    events = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    refused = {e.get("error") for e in events if e["type"] == "fail"}  # the pub/sub and conversation calls' classes
    assert {"PstoreUnavailableError", "NoNewUowsError"} <= refused, sorted(map(str, refused))


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", range(1, 21))
def test_soak_every_fault_kind(tmp_path: Path, seed: int) -> None:
    out = chaos("run", "--seed", str(seed), "--duration", "30", "--faults", "all", "--json", "--dir",
                str(tmp_path), timeout=900)
    assert_found_nothing(out, tmp_path)


@pytest.mark.e2e
@pytest.mark.slow
def test_cf_kill_duplex_primary_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind cf-kill-duplex-primary: a duplexed group; the primary killed under the chaos workload; its
    copy is promoted, nothing restored; the checker finds nothing lost, duplicated or out of order."""
    out = chaos("run", "--seed", "2", "--duration", "16", "--faults", "cf-kill-duplex-primary", "--json",
                "--dir", str(tmp_path))
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert out.returncode == 0, why_failed(s, tmp_path)
    assert s["faults"] and not s["fault_errors"]
    assert all(f["kind"] == "cf-kill-duplex-primary" and f["service_s"] is not None for f in s["faults"])
    assert all(f["timings"]["promotion_s"] > 0 and f["timings"]["empty_restarts"] == 0 for f in s["faults"])
    assert all(v == 0 for v in s["findings"].values())
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "process-logs").glob("QM*.log"))
    assert "CSQE132I" not in logs  # no member restored anything


def kind_run(tmp_path: Path, kind: str, seed: int, duration: float) -> dict[str, object]:
    """One run of a fault kind alone: nothing found, no fault error, every member serving again within its bound
    after every fault (the checker's liveness)."""
    out = chaos("run", "--seed", str(seed), "--duration", str(duration), "--faults", kind, "--json", "--dir",
                str(tmp_path), timeout=900)
    assert out.stdout, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert out.returncode == 0, why_failed(s, tmp_path)
    assert s["faults"] and all(f["kind"] == kind and f["service_s"] is not None for f in s["faults"])
    assert all(v == 0 for v in s["findings"].values()), s["findings"]
    for f in s["faults"]:
        assert f["serving"] and all(v is not None and v <= f["serve_bound_s"] for v in f["serving"].values()), f
    return s


@pytest.mark.e2e
@pytest.mark.slow
def test_snoop_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind snoop: another application of the same token reads and touches no other user's work; every
    attempt is in the history, refused (the checker's isolation)."""
    s = kind_run(tmp_path, "snoop", 1, 8)
    assert s["counts"]["snoop attempts"] > 40 and s["counts"]["snoop attempts refused"] > 30, s["counts"]


@pytest.mark.e2e
@pytest.mark.slow
def test_browse_storm_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind browse-storm: browsers paging past 100,000 expired messages to the live one keep no member's
    calls waiting (every probe within 2 s, nobody fenced), and every browse shows the live message alone."""
    s = kind_run(tmp_path, "browse-storm", 1, 10)
    assert all(f["timings"]["browses"] >= 4 for f in s["faults"]), s["faults"]


@pytest.mark.e2e
@pytest.mark.slow
def test_backup_under_restore_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind backup-under-restore: a backup that ran across an operator's restore of its structure does not
    end ok (the claim takes its mark away), and the restores run again after a CF loss lose nothing."""
    s = kind_run(tmp_path, "backup-under-restore", 1, 10)
    assert all(f["timings"]["backup"].startswith("BackupCancelledError") for f in s["faults"]), s["faults"]


@pytest.mark.e2e
@pytest.mark.slow
def test_log_volume_missing_run_finds_nothing(tmp_path: Path) -> None:
    """The fault kind log-volume-missing: a member killed -9 whose log volume does not come back is recovered by no
    peer and refuses to start (the configuration exit code) until the volume is back; then it restarts from its log
    and the checker finds nothing lost or half-applied."""
    s = kind_run(tmp_path, "log-volume-missing", 1, 12)
    assert all(f["timings"]["exit_code"] == 2 for f in s["faults"]), s["faults"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_commit_while_a_restore_loads_is_answered_pending_and_nothing_is_lost(tmp_path: Path) -> None:
    """The fault kind restore-race, seed 6 (APP1, held at its load): while its first restore is held at the start of
    its load (after it read the logs), the fault's own unit of work (a put and a get on EDGE) is committed: the
    member must answer that the outcome is pending (the history's unknown), never "committed": the restore backs
    the unit of work out, and an acknowledged put would be the checker's `lost`, an acknowledged get its
    `duplicated`."""
    s = kind_run(tmp_path, "restore-race", 6, 8)
    race = s["faults"][0]
    assert race["where"] == "load", race
    assert race["timings"]["commit_while_held"] == "unknown", race["timings"]


@pytest.mark.soak
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("kind", "seed", "duration"), [
    ("huge-uow", 1, 25), ("huge-uow", 3, 25), ("stuck-backup", 3, 25), ("stuck-backup", 6, 25),
    ("slow-restart", 1, 25), ("cf-hang", 2, 20), ("cf-hang", 3, 20)])
def test_a_new_fault_kind_alone_finds_nothing(tmp_path: Path, kind: str, seed: int, duration: float) -> None:
    """Each kind the liveness work added, alone (huge-uow: both ends; stuck-backup: kill, cancel and takeover; cf-hang:
    RECAUTO and the operator's restore): nothing found, every member serving again within its bound."""
    kind_run(tmp_path, kind, seed, duration)
