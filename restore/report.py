"""What a restore did (or, in a dry run, would do), drawn for the operator: the summary tables.

The report file (written by restore.result.write_report) (JSON, one object: restore.run.RestoreResult.to_json()) has: structure, backup_id, backup_path,
engine, dry_run, state_before, replay_from / replay_to (where the replay starts, and the highest LRSN read),
replay_range ({"empty": false, "from": F, "to": T}, or {"empty": true, "from": null, "to": null} when nothing is to
replay), restore_lrsn (the restored structure's generation and recovery floor), log_ranges (member -> dir, from, to), records_by_member, counts
(messages by disposition: restored, in-doubt, consumed, put-backed-out, expired, gone; UOWs: uows in doubt,
uows in flight backed out), nonpersistent_lost (skipped by the backup; found in the CF before the load),
in_doubt_uows (UOW -> owner), decisions_logged, keys_deleted, loaded_entries, loaded_bytes, peak_rss_bytes (the
process's peak resident memory, plan and load), memory_limit and partitions (the local engine's), timings (seconds per
phase), report_path, started_at, base_kind (fuzzy, restore, purge or definition: backup.points; logs: the
logs alone, docs/log-management.md), start (which start it used, in words) and restore_point (the id of the restore point the restore wrote, empty in a dry run).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table

from cfemu.clitools import styled_table
from restore.result import PurgeResult, RestoreResult
from restore.settle import CONSUMED, EXPIRED, GONE, HELD_INDOUBT, PUT_BACKED_OUT, RESTORED, STATUS_DROPPED

DISPOSITIONS = (RESTORED, HELD_INDOUBT, CONSUMED, PUT_BACKED_OUT, EXPIRED, GONE, STATUS_DROPPED)
UOW_COUNTS = ("uows in doubt", "uows in flight backed out")
BASE_NOTE = {"restore": ": the restore point of the last restore", "purge": ": the restore point of a purge",
             "definition": ": never backed up, restored from its definition and the logs",
             "logs": ": no backup is newer: restored from the logs alone (the relog window)"}


def _table(title: str, console: Console) -> Table:
    return styled_table(console, title=title)


def summary(result: RestoreResult, console: Console) -> Group:
    """The tables printed after a restore (or as the plan of a dry run)."""
    what = "plan (dry run: nothing changed)" if result.dry_run else "restore"
    head = _table(f"{result.structure} {what}", console)
    head.add_column("")
    head.add_column("")
    head.add_row("backup", f"{result.backup_id} ({result.backup_path})" + BASE_NOTE.get(result.base_kind, ""))
    head.add_row("engine", result.engine)
    if result.peak_rss_bytes:
        limit = (f" (working memory limit {result.memory_limit / 2**20:.0f} MiB, {result.partitions} partitions, "
                 f"{result.workers} worker{'s' if result.workers != 1 else ''})" if result.memory_limit else "")
        head.add_row("peak memory", f"{result.peak_rss_bytes / 2**20:.0f} MiB resident{limit}")
    head.add_row("state before", result.state_before)
    head.add_row("replay", f"nothing to replay (the logs hold no record from LRSN {result.replay_from} on)"
                 if result.nothing_to_replay else f"LRSN {result.replay_from} .. {result.replay_to}")
    if result.start:
        head.add_row("start", result.start)
    if not result.dry_run:
        head.add_row("new generation", str(result.restore_lrsn))
        head.add_row("loaded", f"{result.loaded_entries} messages, {result.loaded_bytes} bytes")
        head.add_row("decisions logged", str(result.decisions_logged))
        head.add_row("restore point", result.restore_point)
        if result.unfinished_points_removed:
            head.add_row("removed", "unfinished restore points of earlier runs: "
                         + ", ".join(result.unfinished_points_removed))
    if result.report_path:
        head.add_row("report", result.report_path)

    logs = _table("logs", console)
    for col in ("member", "from LRSN", "to LRSN", "records"):
        logs.add_column(col, justify="left" if col == "member" else "right")
    for member, r in sorted(result.log_ranges.items()):
        logs.add_row(member, str(r["from"]), str(r["to"]) if r["to"] is not None else "- (nothing to replay)",
                     str(result.records_by_member.get(member, 0)))

    fates = _table("messages and units of work", console)
    fates.add_column("disposition")
    fates.add_column("count", justify="right")
    for name in DISPOSITIONS + UOW_COUNTS:
        fates.add_row(name, str(result.counts.get(name, 0)))
    for why, n in result.nonpersistent_lost.items():
        fates.add_row(f"non-persistent lost ({why})", str(n))

    times = _table("timings", console)
    times.add_column("phase")
    times.add_column("seconds", justify="right")
    for phase, secs in result.timings.items():
        times.add_row(phase, f"{secs:.3f}")
    return Group(head, logs, fates, times)


def purge_summary(result: PurgeResult, console: Console) -> Table:
    t = _table(f"{result.structure} purged", console)
    t.add_column("")
    t.add_column("")
    t.add_row("state before", result.state_before)
    t.add_row("messages discarded", str(result.discarded))
    t.add_row("bytes discarded", str(result.discarded_bytes))
    t.add_row("new generation", str(result.gen))
    t.add_row("restore point", result.restore_point)
    return t
