"""Store migration (EntireX's PSTORE-UNLOAD / PSTORE-LOAD): unload a structure from one CF into files, load them
into another CF (another redis-server, another group, a Redis Cluster), with a handshake, reports on both sides
(backup.migrate_report) and a guard against both stores serving at once.

It lives on the backup floor because it is made of the backup's parts: the unload is written in the backup's file
format (backup.files: CRC32C frames in entry files, a manifest signed with the group's backup key), and both sides
read and write the CF only through cfemu.bulk (its pipelined reads; a restore's claim, guarded Loader, verify and
activate on the target). It imports cfemu, backup and of sqm the failpoints and what finds the newest relog
pass in a group's logs; qsg.migrate_cli is its command line.

The source while it runs and after: the unload sets the structure's state to MIGRATING in one transaction that
also checks that no unit of work holds entries there (WATCH on the header and the UOW records: a member that joins
a UOW meanwhile makes it look again) and that no backup runs. Every member script refuses work on a structure that
is not ACTIVE (check_ready, cfemu/scripts/_prelude.lua: CFSTATE, MQRC_CF_STRUC_FAILED to the application), and
RECAUTO (sqm.core.recauto) only restores a structure that is FAILED, or RECOVERING with an automatic recovery's mark:
a MIGRATING or MIGRATED structure is neither, so no member takes it for a lost CF. At the end the source is left
MIGRATED (a failed unload puts it back to ACTIVE, removes what it wrote and its record: _undo_unload): it serves
nothing until an operator reopens it deliberately (``reopen``), so the two stores never serve at once. A structure
started WARM is refused (its content is in its backups and logs, not in the CF). While the unload runs it renews a
lease in the header (UNTIL, _Lease): reopen refuses a MIGRATING structure whose lease is live, and an unload that
finds the state changed under it (reopened after its lease lapsed) keeps nothing.

The header is in the source CF, and a loss of that CF takes it away: the structure then reads FAILED, and RECAUTO
or ``cfrestore run`` would restore it from its backups and logs beside its target. So before the header says
MIGRATED the unload records the migration in the group repository (cfemu.repository, beside the logs: it outlives
the CF), and restore, RECAUTO and the start modes refuse a structure recorded there. Only ``reopen`` clears it.
An unload that finds no group repository (none given, none recorded in the CF) is refused before it starts.

The target while it loads: the load claims the structure as a restore does (cfemu.bulk.claim: RECOVERING with a
restore token, every write one guarded transaction; RECAUTO leaves a RECOVERING structure without its mark alone),
marks the header with the migration's id (``migration``), empties it, loads the entries batch by batch in their
list order, reads each batch back into the load report, verifies counts and list order, and switches it ACTIVE
last. A load killed midway leaves the target RECOVERING with the migration's id and a report without a trailer:
``status`` and ``read_report`` say so, and a new load refuses the target (not empty) unless told to start it over
(restart=True, only for the same migration).

The handshake (before anything is written on the target): the manifest is the group's (its signature), of this
format (MIGRATION_FORMAT) and kind, every entry file intact; the target is not the source store (same CF run id and
structure, or a header that says it is this migration's source, or a group repository that records the structure
migrated away: _refuse_migrated_away, which outlives a lost source CF); the target structure is empty (no entries, no
UOW records, no tombstones; not being restored or migrated, nor running from a WARM start), its queues are not defined on another structure of the
target, and the target's group is the one asked for.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import redis

from backup.files import (
    MANIFEST_NAME,
    Backup,
    BackupWriter,
    new_backup_id,
    read_manifest,
    resolve_keys,
    signing_key,
)
from backup.migrate_report import (
    CREATED,
    LOADED,
    UNLOADED,
    ReportWriter,
    definition_record,
    entry_record,
)
from backup.migrate_target import TARGET_FILE, read_target, record_target
from backup.run import when_no_backup_runs
from cfemu import bulk, keys, rcluster
from cfemu.admin import QUEUES, STRUCTURES, Admin, QueueDef, StructureDef
from cfemu.cf import CF, BackupMark, cf_time_ms
from cfemu.credentials import BackupKeys
from cfemu.progress import Progress, no_progress
from cfemu.repository import GroupRepository, RepositoryError
from sqm.core.failpoints import failpoint
from sqm.core.relog import newest_pass
from sqm.log import LogCorruptError, LogFormatError, find_log_dirs

MIGRATION_FORMAT = 1  # the unload's format: a load refuses another
KIND = "cfemu-migration-unload"
MIGRATING, MIGRATED = "MIGRATING", "MIGRATED"
FIELD = "migration"  # header field: the migration's id (source: MIGRATING/MIGRATED; target: while it loads)
UNTIL = "migration_until"  # header field: the running unload's lease, ms of the CF's clock (source: MIGRATING)
LEASE_S = 30.0  # an unload renews its lease every third of it; reopen waits for a killed one's to run out
UNLOAD_DIR, UNLOAD_REPORT, LOAD_REPORT = "unload", "unload-report.jsonl", "load-report.jsonl"
_HEADER_CARRIED = ("gen", "clock", "floor")  # the source header fields the target keeps (LRSNs keep growing)
_RETRIES = 20


class MigrationError(RuntimeError):
    """A migration step refused or failed; the message is one line naming the structure and the problem."""


class HandshakeError(MigrationError):
    """The unload and the target do not fit: another format, the same store, a foreign group, a busy source."""


class BackupRunningMigrationError(MigrationError):
    """A backup of the structure runs: the unload waits for it (unload's wait_s) or is refused."""


class SameStoreError(HandshakeError):
    pass


class TargetNotEmptyError(HandshakeError):
    pass


class LoadedElsewhereError(HandshakeError):
    """The unload was loaded into another store (backup.migrate_target)."""


class LoadVerifyError(MigrationError):
    """The target does not hold what was loaded (it stays RECOVERING)."""


class Stored(NamedTuple):
    """One unloaded entry in cfemu.bulk's Survivor shape: id, descriptor (wire form), data."""

    id: str
    entry: dict[str, Any]
    data: bytes


# --- reading a structure in list order ------------------------------------------------------------------------
def _list_prefix(structure: str) -> str:
    return keys.queue_list(structure, "", "")[:-1]  # "{S}:q:"


def list_name(structure: str, wire: Mapping[str, Any]) -> str:
    """The list an entry sits on, without the structure's tag ("Q1:cp:0"): the same on both sides of a rename."""
    return bulk.list_of(structure, dict(wire))[len(_list_prefix(structure)):]


def list_order(client: redis.Redis, structure: str) -> list[tuple[str, list[str]]]:
    """Every queue list of the structure (by name, tag left out) with its ids in list order."""
    prefix = _list_prefix(structure)
    names = sorted({keys.text(k) for k in client.scan_iter(match=prefix + "*", count=1000)})
    out = []
    for name in names:
        ids: list[str] = []
        n = int(client.llen(name))
        for i in range(0, n, 10_000):
            ids.extend(keys.text(x) for x in client.lrange(name, i, i + 9_999))
        out.append((name[len(prefix):], ids))
    return out


def read_store(client: redis.Redis, structure: str) -> Iterator[tuple[str, int, dict[str, Any], bytes]]:
    """(list name, position, descriptor wire form, data) of every entry, list by list in list order. Meant for a
    structure nobody changes meanwhile (MIGRATING, MIGRATED, or a target still RECOVERING): an entry that is in no
    list, or in two, is an inconsistency and raises."""
    lists = list_order(client, structure)
    ids = [i for _, chunk in lists for i in chunk]
    n_entries = int(client.hlen(keys.entries(structure)))
    if len(ids) != n_entries or len(set(ids)) != len(ids):
        raise MigrationError(f"structure {structure}: its lists hold {len(ids)} ids ({len(set(ids))} distinct), its "
                             f"entries {n_entries}: not a consistent structure, refused")
    places = [(name, pos) for name, chunk in lists for pos in range(len(chunk))]
    for i, ((name, pos), (wire, data)) in enumerate(zip(places, bulk.fetch_wire(client, structure, ids),
                                                         strict=True)):
        if wire is None or data is None:
            raise MigrationError(f"structure {structure}: entry {ids[i]} vanished while it was read")
        yield name, pos, wire, data


def _definitions(client: redis.Redis, structure: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The structure's definition and its queues' as stored in {ADMIN} (every field, also ones this version
    does not know, such as a topic's attributes)."""
    raw = client.hget(STRUCTURES, structure)
    if raw is None:
        raise MigrationError(f"structure {structure} is not defined in this CF")
    sdef = msgpack.unpackb(raw, raw=False)
    queues = []
    for _, value in sorted(client.hgetall(QUEUES).items()):
        q = msgpack.unpackb(value, raw=False)
        if q.get("structure") == structure:
            queues.append(q)
    return sdef, queues


def _header(client: redis.Redis, structure: str) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.meta(structure)).items()}


def _guarded(node: redis.Redis, watch: tuple[str, ...], check: Any, stage: Any) -> Any:
    """WATCH, check (raises to refuse), MULTI/EXEC stage; again when a watched key changed under it."""
    for _ in range(_RETRIES):
        pipe = node.pipeline(transaction=True)
        try:
            pipe.watch(*watch)
            value = check(pipe)
            pipe.multi()
            stage(pipe, value)
            pipe.execute()
            return value
        except redis.exceptions.WatchError:
            continue
        finally:
            pipe.reset()
    raise MigrationError(f"the structure's header changed under {_RETRIES} transactions in a row")


# --- the source: unload, reopen ---------------------------------------------------------------------------------
def freeze(client: redis.Redis, structure: str, migration: str, *, lease_s: float = LEASE_S) -> None:
    """ACTIVE -> MIGRATING in one transaction, refused while a unit of work holds entries or a backup runs, and for
    a structure started WARM (its content is not in the CF, as backup_begin.lua refuses its backup). A
    backup mark whose lease has ended is no backup running (cfemu.cf.BackupMark): the freeze clears it, so that
    its backup, if it still runs, cannot end well. The header then holds the unload's lease (UNTIL, lease_s from
    the CF's time): the mark that it runs, renewed while it does (_renew), which reopen respects."""
    node = rcluster.node_client(client, structure)
    meta, uows = keys.meta(structure), keys.uows(structure)

    def check(pipe: Any) -> bool:
        state, mark_id, until, other, started = pipe.hmget(meta, "state", "backup", "backup_until", FIELD, "started")
        state, other, started = (keys.text(v) if v is not None else None for v in (state, other, started))
        mark = BackupMark.read(mark_id, until, pipe.time())
        backup = mark.backup if mark is not None and not mark.stale else None
        if state is None:
            raise MigrationError(f"structure {structure} is not in this CF")
        if state in (MIGRATING, MIGRATED):
            raise HandshakeError(f"structure {structure} is {state} (migration {other}): reopen it first "
                                 f"('cfemu migrate reopen {structure}') to unload it again")
        if state != "ACTIVE":
            raise MigrationError(f"structure {structure} is {state}; only an ACTIVE structure can be unloaded")
        if started == "WARM":
            # its persistent content is in its backups and logs, not in the CF (docs/pstore.md): an unload would
            # carry an empty store away and mark the source MIGRATED, and the committed messages served nowhere
            raise MigrationError(f"structure {structure} runs from a WARM start: its persistent content is in its "
                                 "backups and logs, not in the CF; start it HOT or COLD first "
                                 f"('cfemu pstore start {structure} --mode HOT')")
        if backup:
            raise BackupRunningMigrationError(f"structure {structure}: backup {backup} is running; unload once it "
                                              "has ended")
        held = [keys.text(u) for u in pipe.hkeys(uows)]
        if held:
            raise MigrationError(f"structure {structure}: {len(held)} units of work hold entries on it (e.g. "
                                 f"{', '.join(sorted(held)[:3])}): let them end (or stop the members) and unload again")
        return mark is not None and mark.stale

    def stage(pipe: Any, stale: bool) -> None:
        pipe.hset(meta, mapping={"state": MIGRATING, FIELD: migration,
                                 UNTIL: cf_time_ms(node.time()) + int(lease_s * 1000)})
        if stale:
            pipe.hdel(meta, "backup", "backup_until")

    _guarded(node, (meta, uows), check, stage)


def _freeze_when_no_backup_runs(client: redis.Redis, structure: str, migration: str, wait_s: float,
                                lease_s: float, progress: Progress) -> None:
    """freeze, once no backup of the structure runs: waited for at most wait_s seconds (0: refused at once)."""
    when_no_backup_runs(
        CF(client).structure(structure), wait_s, progress, lambda: freeze(client, structure, migration, lease_s=lease_s),
        BackupRunningMigrationError,
        lambda running: BackupRunningMigrationError(f"structure {structure}: backup {running} is still running "
                                                    f"after waiting {wait_s:g}s for it; unload once it has ended"))


def _set_state(client: redis.Redis, structure: str, *, to: str, expect: tuple[str, ...],
               migration: str | None = None, unless_running: bool = False) -> str:
    """Move the header's state from one of `expect` (of `migration` when given) to `to`; returns the old state.
    unless_running: refused while a MIGRATING structure's unload holds a live lease (it runs, if slowly)."""
    node = rcluster.node_client(client, structure)
    meta = keys.meta(structure)

    def check(pipe: Any) -> str:
        state, mid, until = (keys.text(v) if v is not None else "" for v in pipe.hmget(meta, "state", FIELD, UNTIL))
        if state not in expect or (migration is not None and mid != migration):
            raise MigrationError(f"structure {structure} is {state or 'not in this CF'}"
                                 f"{f' (migration {mid})' if mid else ''}, not {' or '.join(expect)}"
                                 f"{f' of migration {migration}' if migration else ''}: left as it is")
        left_ms = int(until) - cf_time_ms(pipe.time()) if until else 0
        if unless_running and state == MIGRATING and left_ms > 0:
            raise MigrationError(f"structure {structure}: the unload of migration {mid} is running (its lease has "
                                 f"{left_ms / 1000:.1f} s left): let it end, or stop it and reopen once its lease "
                                 "has run out")
        return state

    def stage(pipe: Any, _: str) -> None:
        pipe.hset(meta, "state", to)
        pipe.hdel(meta, UNTIL)
        if to == "ACTIVE":
            pipe.hdel(meta, FIELD)

    return str(_guarded(node, (meta,), check, stage))


def group_repository(client: redis.Redis, log_root: str | Path | None = None) -> GroupRepository:
    """The group repository a migration records in: the one the CF records as the group's (the members' log
    root), checked against `log_root` when given; `log_root`'s when the CF records none (a CF that was lost)."""
    recorded = Admin(client).repository()
    try:
        if recorded is None:
            if log_root is None:
                raise MigrationError("the CF records no group repository: give the group's log root (--log-root), "
                                     "whose repository records that the structure is migrated (it outlives the CF)")
            return GroupRepository(log_root)
        repo = GroupRepository(log_root if log_root is not None else Path(recorded["path"]).parent.parent)
        if repo.id != recorded["id"]:
            raise MigrationError(f"{repo.path} is not the group repository the CF records ({recorded['path']}): "
                                 "give the group's log root (--log-root)")
    except RepositoryError as e:
        raise MigrationError(str(e)) from None
    return repo


def reopen(client: redis.Redis, structure: str, *, log_root: str | Path | None = None,
           target_given_up: bool = False) -> dict[str, Any]:
    """Give a migrated source back to its members: the operator's deliberate choice, after a migration that is
    abandoned, or before a second unload. Never while the target serves (both would), nor while the unload runs
    (its lease is live: an unload that finds the state changed under it would leave a loadable unload). A MIGRATING or MIGRATED
    structure becomes ACTIVE; the group repository's record of the migration is cleared, so that a structure
    whose CF was lost since (FAILED) is restored again (RECAUTO, cfrestore run). An unload that was loaded (its
    directory records the target: backup.migrate_target) is refused unless ``target_given_up``: that target serves
    its messages, and the source reopened would serve them too."""
    keys.check_name("structure", structure)
    repo = group_repository(client, log_root)
    header = _header(rcluster.node_client(client, structure), structure)
    state = header.get("state", "") or "FAILED"  # missing from the CF: lost with it (Admin.state)
    record = repo.migrated().get(structure)
    target = _loaded_target(record)
    if target is not None and not target_given_up and target["cf"] == "?":
        raise LoadedElsewhereError(
            f"whether structure {structure}'s unload (migration {target['migration']}) was loaded into another CF "
            f"cannot be told: its target record {_target_record(record)} cannot be read (its directory is not there, "
            f"or the record is damaged); a target would serve its messages, and the source reopened would serve them "
            f"twice; bring the unload's directory back, or, once any target is given up: reopen with "
            f"--target-given-up")
    if target is not None and not target_given_up:
        raise LoadedElsewhereError(
            f"structure {structure}'s unload (migration {target.get('migration', '?')}) is loaded into CF "
            f"{target.get('cf', '?')[:12]} as structure {target.get('structure', '?')} of group "
            f"{target.get('group', '?')} ({_target_record(record)}): that target "
            f"serves its messages, and the source reopened would serve them twice; only once the target is given up "
            f"(its structure deleted, its CF retired): reopen with --target-given-up")
    if state in (MIGRATING, MIGRATED):
        # the header first: a failure between the two leaves the record, which refuses more, never less
        before = _set_state(client, structure, to="ACTIVE", expect=(MIGRATING, MIGRATED), unless_running=True)
        now = "ACTIVE"
    elif record is not None:
        before = now = state
    else:
        raise MigrationError(f"structure {structure} is {state} and the group repository {repo.path} records no "
                             "migration of it: nothing to reopen")
    repo.clear_migrated(structure)
    return {"structure": structure, "state_before": before, "state": now,
            "migration": header.get(FIELD, "") or (record or {}).get("migration", ""),
            "repository": str(repo.path), "restore_needed": now != "ACTIVE", "target_given_up": target}


def _target_record(record: Mapping[str, Any] | None) -> Path:
    """Where the load of a recorded unload records its target: beside the unload's files (record's 'unload')."""
    files = Path(str((record or {}).get("unload", "")))
    return (files.parent if files.name == UNLOAD_DIR else files) / TARGET_FILE


def _loaded_target(record: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The store the recorded unload was loaded into (its directory's target record), or None: not loaded (its
    directory is here and records no target). A directory that is not here (removed, a volume not mounted) or a
    record that cannot be read answers an unknown target: whether it was loaded cannot be told, which refuses more,
    never less."""
    unload = (record or {}).get("unload")
    if not unload:
        return None
    path = _target_record(record)
    unknown = {"cf": "?", "structure": "?", "group": "?", "migration": str((record or {}).get("migration", "?"))}
    try:
        if path.exists():
            return read_target(path)
        return None if path.parent.is_dir() else unknown
    except (OSError, ValueError):
        return unknown


@dataclass
class Unloaded:
    migration: str
    structure: str
    group: str
    cf: str
    directory: Path
    entries: int = 0
    bytes: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    state: str = MIGRATED

    def to_dict(self) -> dict[str, Any]:
        return {"migration": self.migration, "structure": self.structure, "group": self.group, "cf": self.cf,
                "directory": str(self.directory), "unload": str(self.directory / UNLOAD_DIR),
                "report": str(self.directory / UNLOAD_REPORT), "entries": self.entries, "bytes": self.bytes,
                "by_type": dict(sorted(self.by_type.items())), "seconds": round(self.seconds, 3),
                "state": self.state}


class _Lease:
    """The running unload's lease (the header's UNTIL): renewed every third of it, each renewal one guarded
    transaction that checks the structure is still MIGRATING by this migration. A reopen (after a lapsed lease)
    or anything else that changed the state under the unload makes it stop with a MigrationError."""

    def __init__(self, client: redis.Redis, structure: str, migration: str, lease_s: float) -> None:
        self.node = rcluster.node_client(client, structure)
        self.structure, self.migration, self.lease_s = structure, migration, lease_s
        self._next = time.monotonic() + lease_s / 3

    def renew(self, *, now: bool = False) -> None:
        if not now and time.monotonic() < self._next:
            return
        meta = keys.meta(self.structure)

        def check(pipe: Any) -> None:
            state, mid = (keys.text(v) if v is not None else "" for v in pipe.hmget(meta, "state", FIELD))
            if state != MIGRATING or mid != self.migration:
                raise MigrationError(f"structure {self.structure} changed under the unload of migration "
                                     f"{self.migration} (it is {state or 'not in this CF'}"
                                     f"{f' of migration {mid}' if mid and mid != self.migration else ''}; reopened?): "
                                     "the unload is abandoned, nothing of it is kept")

        def stage(pipe: Any, _: None) -> None:
            pipe.hset(meta, UNTIL, cf_time_ms(self.node.time()) + int(self.lease_s * 1000))

        _guarded(self.node, (meta,), check, stage)
        self._next = time.monotonic() + self.lease_s / 3


def _clear_leftover(directory: Path, structure: str, *, remove: bool) -> None:
    """A directory that holds only what an unload of `structure` left when it was killed (no manifest: never a
    loadable unload) is emptied for this one (remove=True, once the structure is frozen by this unload, so that
    the unload that left it does not run any more); anything else there is refused, never removed."""
    if not directory.exists() or not any(directory.iterdir()):
        return
    names = {p.name for p in directory.iterdir()}
    leftover = names <= {UNLOAD_DIR, UNLOAD_REPORT} and not (directory / UNLOAD_DIR / MANIFEST_NAME).exists()
    if leftover and UNLOAD_REPORT in names:
        try:
            with open(directory / UNLOAD_REPORT, "rb") as f:
                head = json.loads(f.readline() or b"{}")
        except (OSError, ValueError):
            head = {}
        leftover = isinstance(head, dict) and head.get("report") == "unload" and head.get("structure") == structure
    if not leftover:
        raise MigrationError(f"{directory} is not empty (and holds no killed unload of {structure} without its "
                             "manifest): unload into a new or empty directory")
    if not remove:
        return
    shutil.rmtree(directory / UNLOAD_DIR, ignore_errors=True)
    (directory / UNLOAD_REPORT).unlink(missing_ok=True)


def _undo_unload(client: redis.Redis, structure: str, migration: str, directory: Path, repo: GroupRepository,
                 created: bool, wrote: bool, writer: BackupWriter | None, report: ReportWriter | None) -> None:
    """A failed unload leaves nothing loadable and the source serving again. Each step is guarded on its own (a
    full disk fails the report's flush too): the files written go (the unload, complete or not: a complete one
    whose state change failed must not be loaded elsewhere), the header goes back to ACTIVE when it is still
    this migration's, and this migration's record in the group repository goes unless the header's state is
    unknown (the CF unreachable: left MIGRATING and recorded, which refuses more, never less; 'cfemu migrate
    reopen' gives it back)."""
    if report is not None:
        with contextlib.suppress(Exception):
            report.abandon()
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.abort()
    if wrote:  # what is there is this unload's, never what it found
        shutil.rmtree(directory / UNLOAD_DIR, ignore_errors=True)
        with contextlib.suppress(OSError):
            (directory / UNLOAD_REPORT).unlink(missing_ok=True)
    if created:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty
    try:
        _set_state(client, structure, to="ACTIVE", expect=(MIGRATING,), migration=migration)
    except MigrationError:
        pass  # no longer this migration's (reopened meanwhile): its record is this migration's only
    except redis.exceptions.RedisError:
        return  # state unknown: the record stays
    with contextlib.suppress(Exception):
        repo.clear_migrated(structure, migration)


def unload(client: redis.Redis, structure: str, to: str | Path, *, backup_keys: BackupKeys | None = None,
           progress: Progress = no_progress, log_root: str | Path | None = None, wait_s: float = 0.0,
           lease_s: float = LEASE_S) -> Unloaded:
    """Unload `structure` into the directory `to` (new, or empty, or holding only what a killed unload of it
    left: _clear_leftover): ``unload/`` (the backup file format, its manifest signed) and
    ``unload-report.jsonl``. The source ends MIGRATED, and the group repository (the CF's, or log_root's:
    group_repository) records it migrated; a failure puts it back to ACTIVE and removes what was written
    (_undo_unload). wait_s: a backup of the structure running (a scheduler's) is waited for, at most this long
    (backup.run.wait_for_running_backup, with progress); 0 refuses at once. lease_s: the unload's lease (_Lease)."""
    t0 = time.monotonic()
    keys_ = resolve_keys(backup_keys)
    signing_key(keys_, "sign the unload with")  # no key, no unload: refused before the CF is touched
    directory = Path(to)
    created = not directory.exists()
    keys.check_name("structure", structure)
    admin = Admin(client)
    sdef, queues = _definitions(client, structure)
    repo = group_repository(client, log_root)
    group = admin.group_name()
    node = rcluster.node_client(client, structure)
    recorded = repo.migrated().get(structure)
    if recorded is not None and _header(node, structure).get("state") not in (MIGRATING, MIGRATED):  # else freeze's
        raise HandshakeError(f"structure {structure} is recorded migrated in the group repository {repo.path} "
                             f"(migration {recorded.get('migration')}): reopen it first ('cfemu migrate reopen "
                             f"{structure}') to unload it again")
    _clear_leftover(directory, structure, remove=False)  # refused before the freeze
    cf = bulk.cf_identity(node)
    migration = new_backup_id(structure, datetime.now(UTC))
    _freeze_when_no_backup_runs(client, structure, migration, wait_s, lease_s, progress)
    writer: BackupWriter | None = None
    report: ReportWriter | None = None
    wrote = False
    try:
        lease = _Lease(client, structure, migration, lease_s)
        _clear_leftover(directory, structure, remove=True)
        wrote = True
        header = _header(node, structure)
        writer = BackupWriter(directory / UNLOAD_DIR, backup_keys=keys_)
        report = ReportWriter(directory / UNLOAD_REPORT, {
            "report": "unload", "migration": migration, "structure": structure, "group": group, "cf": cf,
            "started": datetime.now(UTC).isoformat()}, backup_keys=keys_)
        result = Unloaded(migration, structure, group, cf, directory)
        report.add(definition_record("structure", structure, sdef, action=UNLOADED))
        for q in queues:
            report.add(definition_record("queue", q["name"], q, action=UNLOADED))
        total = int(node.hlen(keys.entries(structure)))
        lease.renew(now=True)
        for name, pos, wire, data in read_store(node, structure):
            writer.add(0, wire, data)
            rec = entry_record(wire, data, list_name=name, pos=pos, action=UNLOADED)
            report.add(rec)
            result.entries += 1
            result.bytes += len(data)
            result.by_type[rec["type"]] = result.by_type.get(rec["type"], 0) + 1
            if result.entries % 5000 == 0:
                progress("unload", result.entries, total)
            if result.entries % 500 == 0:
                lease.renew()
        progress("unload", result.entries, total)
        report_sha = report.close()
        report = None
        lease.renew(now=True)
        # Durably outside the CF before the manifest makes the unload loadable: a CF loss must not make the source
        # restorable while an unload of it can be loaded (killed between the two, the record refuses more, never
        # less: 'cfemu migrate reopen' clears it).
        repo.record_migrated(structure, migration, unload=str((directory / UNLOAD_DIR).absolute()), source_cf=cf)
        writer.finish({
            "kind": KIND, "id": migration, "structure": structure, "group": group,
            "migration": {"format": MIGRATION_FORMAT, "id": migration, "source_cf": cf, "source_group": group,
                          "structure": structure, "unloaded_at": datetime.now(UTC).isoformat()},
            "structure_def": sdef, "queues": queues,
            "header": {k: int(header.get(k, 0) or 0) for k in _HEADER_CARRIED},
            "tombstones": {keys.text(u): keys.text(o) for u, o in node.hgetall(keys.tomb(structure)).items()},
            "queue_names": sorted(keys.text(q) for q in node.smembers(keys.queues(structure))),
            "pclock": {keys.text(k): keys.text(v) for k, v in node.hgetall(keys.pclock(structure)).items()},
            "entries": result.entries, "bytes": result.bytes, "report": {"name": UNLOAD_REPORT, "sha256": report_sha},
        })
        writer = None
        _set_state(client, structure, to=MIGRATED, expect=(MIGRATING,), migration=migration)
    except BaseException as e:
        _undo_unload(client, structure, migration, directory, repo, created, wrote, writer, report)
        if isinstance(e, OSError):
            raise MigrationError(f"structure {structure}: writing the unload into {directory} failed "
                                 f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}): nothing of it is "
                                 "kept, the source serves again") from e
        raise
    result.seconds = time.monotonic() - t0
    return result


# --- the target: load -------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    migration: str
    structure: str
    source_structure: str
    group: str
    cf: str
    report: Path
    entries: int = 0
    bytes: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    state: str = "ACTIVE"

    def to_dict(self) -> dict[str, Any]:
        return {"migration": self.migration, "structure": self.structure, "source_structure": self.source_structure,
                "group": self.group, "cf": self.cf, "report": str(self.report), "entries": self.entries,
                "bytes": self.bytes, "by_type": dict(sorted(self.by_type.items())), "seconds": round(self.seconds, 3),
                "state": self.state}


def with_keys(backup_keys: BackupKeys, extra: BackupKeys | None) -> BackupKeys:
    """This process's keys plus another group's (to check an unload that group signed)."""
    if extra is None:
        return backup_keys
    return BackupKeys(current=backup_keys.current, previous=(*backup_keys.previous, *extra.checking()),
                      accept_unsigned=backup_keys.accept_unsigned, source=f"{backup_keys.source}; {extra.source}")


def open_unload(directory: str | Path, *, backup_keys: BackupKeys | None = None) -> Backup:
    """The unload in `directory`, its manifest checked (the group's signature, kind, format) and every entry file
    read through (CRC32C of each frame, digests, counts): nothing of a damaged unload reaches a target."""
    path = Path(directory) / UNLOAD_DIR
    manifest = read_manifest(path, backup_keys=backup_keys)
    info = manifest.get("migration")
    if manifest.get("kind") != KIND or not isinstance(info, dict):
        raise HandshakeError(f"{path}: not a migration unload (a backup? restore it with cfrestore instead)")
    if info.get("format") != MIGRATION_FORMAT:
        raise HandshakeError(f"{path}: unload format {info.get('format')!r}; this tool loads format "
                             f"{MIGRATION_FORMAT} only: load it with the version that unloaded it")
    unload = Backup(path, manifest)
    frames = sum(1 for _ in unload.frames())
    if frames != manifest["entries"]:
        raise HandshakeError(f"{path}: {frames} entries in its files, the manifest says {manifest['entries']}")
    return unload


def handshake(client: redis.Redis, manifest: Mapping[str, Any], structure: str, *, group: str | None = None,
              restart: bool = False) -> dict[str, Any]:
    """The checks a load makes on the target before it writes anything; returns what it found there."""
    info = manifest["migration"]
    node = rcluster.node_client(client, structure)
    cf = bulk.cf_identity(node)
    header = _header(node, structure)
    if (cf == info["source_cf"] and structure == info["structure"]) or (
            header.get(FIELD) == info["id"] and header.get("state") in (MIGRATING, MIGRATED)):
        raise SameStoreError(f"the target is the source store of migration {info['id']} (CF run id {cf[:12]}, "
                             f"structure {structure}): load into another CF or under another structure name")
    partial = header.get(FIELD) == info["id"] and header.get("state") == "RECOVERING"
    if partial and not restart:
        raise TargetNotEmptyError(f"structure {structure} holds a partial load of migration {info['id']} (killed "
                                  "midway): start it over with --restart")
    if not partial:
        state = header.get("state", "")
        if state and state not in ("ACTIVE", "FAILED"):
            raise TargetNotEmptyError(f"structure {structure} is {state} in the target"
                                      f"{' (migration ' + header[FIELD] + ')' if header.get(FIELD) else ''}: "
                                      "not an empty store")
        if header.get("started") == "WARM":
            # its persistent content is in its group's backups and logs, kept for its HOT start (docs/pstore.md):
            # the load would replace the header that says so, and the structure would serve the migration's
            # messages with no HOT start possible any more (as the unload refuses a WARM source, freeze)
            raise HandshakeError(f"structure {structure} in the target runs from a WARM start: its persistent "
                                 "content is in its group's backups and logs, kept for its HOT start; start it HOT "
                                 f"or COLD first ('cfemu pstore start {structure} --mode COLD'), or load under "
                                 "another name")
        counts = {"entries": node.hlen(keys.entries(structure)), "units of work": node.hlen(keys.uows(structure)),
                  "tombstones": node.hlen(keys.tomb(structure))}
        busy = {k: int(v) for k, v in counts.items() if int(v)}
        if busy:
            raise TargetNotEmptyError(f"structure {structure} in the target is not empty ("
                                      f"{', '.join(f'{v} {k}' for k, v in busy.items())}): a load needs an empty "
                                      "structure (purge it first, or load under another name)")
    for q in manifest["queues"]:
        raw = client.hget(QUEUES, q["name"])
        if raw is not None and msgpack.unpackb(raw, raw=False).get("structure") != structure:
            raise HandshakeError(f"queue {q['name']} is defined in the target on structure "
                                 f"{msgpack.unpackb(raw, raw=False).get('structure')}: queue names are the group's")
    has_group = client.exists(keys.group())
    target_group = Admin(client).group_name()
    if group is not None and has_group and target_group != group:
        raise HandshakeError(f"the target CF is group {target_group}, not {group}")
    return {"cf": cf, "group": group or target_group, "set_group": group is not None and not has_group,
            "partial": partial}


def load(client: redis.Redis, directory: str | Path, *, structure: str | None = None, group: str | None = None,
         restart: bool = False, report: str | Path | None = None, backup_keys: BackupKeys | None = None,
         source_keys: BackupKeys | None = None, batch: int = bulk.BATCH, progress: Progress = no_progress,
         log_root: str | Path | None = None, default_log_root: str | Path | None = None) -> Loaded:
    """Load the unload in `directory` into the CF `client` names, as `structure` (default: the source's name).
    The load report goes to `report` (default: load-report.jsonl in `directory`). log_root: the target group's
    log root, whose group repository (cfemu.repository) then knows the structure and its queues too, so that
    RECAUTO and restore find them after a loss of the target CF. default_log_root (the settings'): the group
    repository checked when log_root is not given and the CF records none (_refuse_migrated_away)."""
    t0 = time.monotonic()
    keys_ = resolve_keys(backup_keys)
    signing_key(keys_, "sign the load report with")
    unloaded = open_unload(directory, backup_keys=with_keys(keys_, source_keys))
    manifest = unloaded.manifest
    info = manifest["migration"]
    S = keys.check_name("structure", structure or info["structure"])
    if group is not None:
        keys.check_name("group", group)
    found = handshake(client, manifest, S, group=group, restart=restart)
    _refuse_migrated_away(client, S, info, group, log_root, default_log_root)
    # The newest relog pass of the structure in the target group's logs before the load holds none of what is
    # loaded: a restore must not start from it (restore.run), as from a backup begun before the load. Read before
    # anything is written: a log it cannot read refuses the load, changing nothing.
    try:
        newest = newest_pass(find_log_dirs(Path(log_root)), S) if log_root is not None else None
    except (LogCorruptError, LogFormatError) as e:
        raise MigrationError(f"loading structure {S}: the target group's logs under {log_root} cannot be read "
                             f"({e}): nothing was loaded") from None
    report_path = Path(report) if report is not None else Path(directory) / LOAD_REPORT
    if report_path.exists():
        if not (restart and found["partial"]):
            raise MigrationError(f"{report_path} exists: a load report is never overwritten (--report elsewhere)")
        report_path.unlink()
    _claim_target(Path(directory), info, S, found)
    if found["set_group"]:
        Admin(client).set_group_name(str(group))
    sdef_raw = dict(manifest["structure_def"], name=S)
    queues_raw = [dict(q, structure=S) for q in manifest["queues"]]
    sdef = StructureDef.from_dict(sdef_raw)
    hdr = manifest["header"]
    result = Loaded(info["id"], S, info["structure"], found["group"], found["cf"], report_path)
    try:
        with bulk.claim(client, S, bulk.observe(client, S)) as owner:
            owner.transaction(lambda pipe: pipe.hset(keys.meta(S), FIELD, info["id"]))
            writer = ReportWriter(report_path, {
                "report": "load", "migration": info["id"], "structure": S, "source_structure": info["structure"],
                "group": found["group"], "cf": found["cf"], "source_cf": info["source_cf"],
                "started": datetime.now(UTC).isoformat()}, backup_keys=keys_)
            try:
                bulk.reset(owner, sdef)
                # definitions: the structure's and its queues', every field as the source stored them
                owner.admin.hset(STRUCTURES, S, msgpack.packb(sdef_raw, use_bin_type=True))
                for q in queues_raw:
                    owner.admin.hset(QUEUES, q["name"], msgpack.packb(q, use_bin_type=True))
                writer.add(definition_record("structure", S, sdef_raw, action=CREATED))
                for q in queues_raw:
                    writer.add(definition_record("queue", q["name"], q, action=CREATED))
                _load_entries(owner, unloaded, writer, result, batch, progress)
                if manifest["pclock"]:
                    owner.transaction(lambda pipe: pipe.hset(keys.pclock(S), mapping=manifest["pclock"]))
                _verify(owner, unloaded, result)
                writer.close()
            except BaseException:
                writer.abandon()
                raise
            bulk.activate(owner, sdef, gen=int(hdr["gen"]) or 1, clock=int(hdr["clock"]), floor=int(hdr["floor"]),
                          entries=result.entries, nbytes=result.bytes)
    except bulk.CFReplacedError as e:
        raise MigrationError(f"structure {S}: {e}") from None
    except bulk.NotOwnerError as e:
        # a concurrent load (or restore) claimed the structure after this one: it owns it now, this one stopped
        raise MigrationError(f"another load or restore took structure {S} over: this load of migration {info['id']} "
                             f"stopped, its report {report_path} unfinished ({e})") from None
    if log_root is not None:
        repo = GroupRepository(log_root)
        repo.adopt([sdef], [QueueDef.from_dict(q) for q in queues_raw])
        repo.record_loaded(S, str(info["id"]), unload=str(Path(directory).resolve()),
                           pass_before=None if newest is None else {"member": newest[0], "e": int(newest[1]["e"])})
    result.seconds = time.monotonic() - t0
    return result


def _claim_target(directory: Path, info: Mapping[str, Any], structure: str, found: Mapping[str, Any]) -> None:
    """Record this load's target as the unload's one store, or refuse it when another store is recorded
    (backup.migrate_target): a load started over, or a second load into the same store, passes."""
    mine = {"migration": str(info["id"]), "cf": str(found["cf"]), "structure": structure,
            "group": str(found["group"])}
    try:
        held = record_target(directory, mine)
    except (OSError, ValueError) as e:
        raise MigrationError(f"cannot record the load's target in {directory / TARGET_FILE} ({e}): a load records "
                             "it there so that the unload is never loaded into two stores") from None
    if held is not None and (held.get("cf"), held.get("structure")) != (mine["cf"], structure):
        raise LoadedElsewhereError(
            f"the unload of migration {info['id']} is loaded into CF {held.get('cf', '?')[:12]} as structure "
            f"{held.get('structure')} of group {held.get('group')} ({directory / TARGET_FILE}): loaded into another "
            f"store too, its messages would be served twice; only if that target is given up (its structure "
            f"deleted, its CF retired), or is this store restarted since (a new run id), remove {TARGET_FILE} and "
            "load again")


def _refuse_migrated_away(client: redis.Redis, structure: str, info: Mapping[str, Any], group: str | None,
                          log_root: str | Path | None, default_log_root: str | Path | None) -> None:
    """Refuse a load into a group whose repository records `structure` migrated away. Always checked (the
    repository the CF records, else log_root, else default_log_root): after a loss of the source CF the
    repository is all that knows the source, and a load of the unload back into it would make both CFs serve
    the messages; restore and RECAUTO would refuse such a loaded structure after a CF loss too.
    default_log_root (the settings', often the source group's while the target is a new CF of another group) is
    read only for a target that is the source's group, or whose group is not known yet (--group not given, the CF
    records none): the safe side."""
    migration = str(info["id"])
    if log_root is None and Admin(client).repository() is None:
        target_group = group or (Admin(client).group_name() if client.exists(keys.group()) else None)
        if default_log_root is None or target_group not in (None, info.get("source_group")):
            return
        repo = GroupRepository(default_log_root)
    else:
        repo = group_repository(client, log_root)
    try:
        record = repo.migrated().get(structure)
    except RepositoryError as e:
        raise MigrationError(str(e)) from None
    if record is None:
        return
    same = record.get("migration") == migration
    # loaded back into its source's group: both would serve its messages (the source CF lost and restarted
    # empty); another migration's: restore and RECAUTO would refuse the loaded structure after a CF loss
    raise (SameStoreError if same else HandshakeError)(
        f"the target group's repository {repo.path} records structure {structure} migrated away (migration "
        f"{record.get('migration')}{', this unload: the target is its source' if same else ''}): load into another "
        "group's CF or under another name (--structure), or reopen it there first")


def _load_entries(owner: bulk.Owner, unloaded: Backup, writer: ReportWriter, result: Loaded, batch: int,
                  progress: Progress) -> None:
    """The entries in file order (each list's order), batch by batch: each batch one guarded transaction, then
    read back from the target into the report (what the target holds, not what was meant to be written)."""
    S = owner.structure
    loader = bulk.Loader(owner, gen=int(unloaded.manifest["header"]["gen"]) or 1)
    positions: dict[str, int] = defaultdict(int)
    total = int(unloaded.manifest["entries"])
    chunk: list[Stored] = []

    def flush() -> None:
        loader.write(chunk)
        descs, datas = bulk.read(owner.client, S, [s.id for s in chunk])
        for s, raw, data in zip(chunk, descs, datas, strict=True):
            if raw is None or data is None:
                raise LoadVerifyError(f"structure {S}: entry {s.id} is not in the target after its batch")
            wire = msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape")
            if not isinstance(wire.get("pr"), dict):
                wire["pr"] = {}
            name = list_name(S, wire)
            rec = entry_record(wire, data, list_name=name, pos=positions[name], action=LOADED)
            positions[name] += 1
            writer.add(rec)
            result.entries += 1
            result.bytes += len(data)
            result.by_type[rec["type"]] = result.by_type.get(rec["type"], 0) + 1
        writer.flush()
        progress("load", result.entries, total)
        failpoint("migrate-load-batch")

    for _, wire, data in unloaded.frames():
        chunk.append(Stored(str(wire["id"]), wire, data))
        if len(chunk) >= batch:
            flush()
            chunk = []
    if chunk:
        flush()
    # the queue set, and the tombstones (outcomes decided for owners that may still retry: the same answer here);
    # no UOW record: the unload refused a structure where a unit of work held entries
    loader.finish(unloaded.manifest["queue_names"], lambda u: "", unloaded.manifest["tombstones"])


def _verify(owner: bulk.Owner, unloaded: Backup, result: Loaded) -> None:
    """Counts (entries, data, lists, no UOW records) and every list's order against the unload's."""
    S = owner.structure
    expected: dict[str, list[str]] = defaultdict(list)
    for _, wire, _data in unloaded.frames():
        expected[bulk.list_of(S, wire)].append(str(wire["id"]))
    problems = bulk.verify_counts(owner, result.entries, {k: len(v) for k, v in expected.items()}, set())
    if result.entries != unloaded.manifest["entries"]:
        problems.append(f"{result.entries} entries loaded, the unload holds {unloaded.manifest['entries']}")
    for k, ids in expected.items():
        got = [keys.text(x) for x in owner.client.lrange(k, 0, -1)]
        if got != ids:
            problems.append(f"list {k} is not in the source's order")
    if problems:
        raise LoadVerifyError(f"structure {S} after the load: {'; '.join(problems[:5])} (left RECOVERING)")


# --- status and reports of a store --------------------------------------------------------------------------------
def status(client: redis.Redis, structure: str, *, log_root: str | Path | None = None) -> dict[str, Any]:
    """Where a structure stands in a migration: its state and migration id, and what that means (the group
    repository's record too, when the repository is found: group_repository)."""
    node = rcluster.node_client(client, structure)
    header = _header(node, structure)
    state, mid = header.get("state", ""), header.get(FIELD, "")
    try:
        record = group_repository(client, log_root).migrated().get(structure)
    except MigrationError:
        record = None
    meaning = {
        MIGRATING: "being unloaded (or an unload died: 'cfemu migrate reopen' gives it back); members' work refused",
        MIGRATED: "unloaded: serves nothing so that its target alone does; 'cfemu migrate reopen' to serve again",
    }.get(state, "")
    if state == MIGRATING and header.get(UNTIL):
        left_ms = int(header[UNTIL]) - cf_time_ms(node.time())
        meaning = (f"being unloaded (its lease has {left_ms / 1000:.1f} s left: reopen refused); members' work refused"
                   if left_ms > 0 else "an unload that died or stalled (its lease ran out): 'cfemu migrate reopen' "
                   "gives it back; members' work refused")
    if state == "RECOVERING":
        meaning = (f"a load of migration {mid} is running, or was killed midway (partial: load again with --restart)"
                   if mid else "being restored (not a migration's)")
    elif state == "ACTIVE":
        meaning = "serving"
    elif not state:
        meaning = "not in this CF"
    if record is not None and state not in (MIGRATING, MIGRATED):
        mid = str(record.get("migration", ""))
        meaning = (f"migrated (recorded in the group repository; the CF holds it {state or 'no more'}): restore, "
                   "RECAUTO and the start modes refuse it; 'cfemu migrate reopen' to serve it here again")
    return {"structure": structure, "state": state or "-", "migration": mid, "entries": int(header.get("entries", 0) or 0)
            if state != "RECOVERING" else int(node.hlen(keys.entries(structure))), "meaning": meaning}
