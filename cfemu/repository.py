"""The group repository: what the queue-sharing group must remember when the CF is lost.

IBM MQ keeps a queue-sharing group's definitions in a shared repository (Db2), not in the CF. Here the shared
place that outlives the CF is the log volume every member, backup and restore reach, so the repository lives
beside the members' logs::

    <log root>/_group/repository.json   the definitions and the membership (owner-only, 0600)
    <log root>/_group/lock              flock'ed around every read-modify-write (several processes write)

repository.json is replaced atomically (cfemu.durable.replace_file: temp file, fsync, rename, fsync dir):

    {"format": "cfemu-group-repository", "version": 1,
     "id": "<32 hex>",               the repository's identity; the CF records it ({ADMIN}:repository)
     "created_at": "<ISO 8601>",
     "structures": {"APP1": {"name", "max_entries", "max_bytes", "recauto", "lrsn", "defined_at", "updated_at"}},
     "queues": {"Q1": {"name", "structure", "backout_threshold", "backout_queue", "max_msg_length", "lrsn",
                       "defined_at", "updated_at"}},
     "members": {"QM1": {"log": "<absolute log directory>", "joined_at", "last_joined_at",
                         "log_lost": {"declared_at", "lrsn", "pending", "new_log_at"}}},   (log_lost: sqm log lost)
     "migrated": {"APP1": {"migration", "unload", "source_cf", "migrated_at"}},
     "uow_defaults": {"store", "max_uows", "status_lifetime", "updated_at"}}   the group's defaults for services

``migrated`` names the structures unloaded by a store migration (backup.migrate): their content now lives in
another CF, so restore, RECAUTO and the start modes refuse them (a CF loss takes the source's MIGRATED header away;
this record does not go with it) until ``cfemu migrate reopen`` clears it.

A definition's ``lrsn`` is the LRSN (physical microseconds) it was made at: a new structure's CF clock starts
there, so every record of its work lies above it, and restore can rebuild a structure that was never backed up
from an empty base at that LRSN plus the logs. ``updated_at`` moves when a definition is replaced; ``lrsn`` does
not (the structure's history began at its first definition).

Who writes it: every define path (``define_structure`` / ``define_queue`` below: the qsg CLI, the service's
define operation, the cluster launcher), every member when it joins (``open_group_repository`` then
``record_member``), and restore (the definitions it recreates). Membership is how restore knows every log it
must read: a member the repository knows but whose log is missing stops a restore, and its own start
(sqm.core.own_log), until the operator declares the log lost for good (``declare_log_lost``, ``sqm log lost``).

One log root, one group. A member whose log root holds another repository (or none, while the CF knows the
group's) refuses to join (``RepositoryError``): peer recovery, backup and restore read every member's log under
the group's log root, so a member logging elsewhere would be dropped by them (docs/architecture.md, "The group's
durable history", membership and the one log root).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cfemu import keys
from cfemu.admin import Admin, AdminError, QueueDef, StructureDef
from cfemu.durable import replace_file
from cfemu.uow_attributes import UowDefaults

log = logging.getLogger("cfemu.repository")

DIRECTORY = "_group"  # under the log root, beside the members' logs (not a log: no manifest.json, no segments)
FILE = "repository.json"
LOCK = "lock"
LOG_MANIFEST = "manifest.json"  # a member log's manifest (sqm.log.format.MANIFEST_NAME): its "group" stamp
FORMAT = "cfemu-group-repository"
VERSION = 1
MIGRATED = "migrated"  # the section of the structures a store migration unloaded
LOADED = "loaded"  # the section of the structures a store migration loaded here
LOG_LOST = "log_lost"  # in a member's record: its log was declared lost for good (declare_log_lost)
UOW_DEFAULTS = "uow_defaults"  # the section of the group's defaults for its services
LOGON_KEY = "logon_key"  # the fingerprint of the group's logon key (sqm.core.logon_token): never the key

State = dict[str, Any]


class RepositoryError(AdminError):
    """The group repository cannot be used as asked (another group's, unreadable, or it knows better)."""


def now_lrsn() -> int:
    """An LRSN for a definition: the physical clock in microseconds (the scale every LRSN clock starts from)."""
    return time.time_ns() // 1000


def _iso(timespec: str = "seconds") -> str:
    return datetime.now(UTC).isoformat(timespec=timespec)


class GroupRepository:
    """The repository under one log root (it need not exist yet: `exists`, `load`, and every write creates it)."""

    def __init__(self, log_root: str | os.PathLike[str]) -> None:
        self.log_root = Path(log_root).absolute()
        self.directory = self.log_root / DIRECTORY
        self.path = self.directory / FILE

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self) -> State | None:
        """The repository's content, or None when there is none; RepositoryError when it cannot be read."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self.refuse_lost()
            return None
        except OSError as e:
            raise RepositoryError(f"the group repository {self.path} cannot be read: {e}") from None
        try:
            state = json.loads(raw)
        except ValueError as e:
            raise RepositoryError(f"the group repository {self.path} is not valid JSON ({e})") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT or not state.get("id"):
            raise RepositoryError(f"{self.path} is not a group repository")
        if state.get("version") != VERSION:
            raise RepositoryError(f"the group repository {self.path} has version {state.get('version')!r}; this "
                                  f"version reads {VERSION}")
        for section in ("structures", "queues", "members"):
            state.setdefault(section, {})
        for section in ("structures", "queues", "members", MIGRATED, LOADED, UOW_DEFAULTS):
            value = state.get(section)
            if not isinstance(value, dict) and (value is not None or section in ("structures", "queues", "members")):
                raise RepositoryError(f"the group repository {self.path} is damaged: its {section!r} is "
                                      f"{type(value).__name__}, not an object; put it back from a copy")
        for member, rec in state["members"].items():  # restore reads every member's log by them: none passed over
            if not isinstance(rec, dict):
                raise RepositoryError(f"the group repository {self.path} is damaged: its 'members' entry {member!r} "
                                      f"is {type(rec).__name__}, not an object; put it back from a copy")
        return state

    def stamped_logs(self) -> dict[str, str]:
        """Log directory -> the group repository id its manifest is stamped with, for every stamped log under the
        log root (each member stamps its log at its start: sqm.log.RecordLog.stamp_group; restore stamps its own).
        The manifest is read here as the JSON it is (<dir>/manifest.json, its "group"): cfemu is below sqm."""
        out: dict[str, str] = {}
        try:
            entries = sorted(self.log_root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return out
        for d in entries:
            if d.name == DIRECTORY:
                continue
            try:
                manifest = json.loads((d / LOG_MANIFEST).read_bytes())
            except (OSError, ValueError):
                continue  # not a log, or one the log's own readers will name
            if isinstance(manifest, dict) and manifest.get("group"):
                out[d.name] = str(manifest["group"])
        return out

    def refuse_lost(self) -> None:
        """RepositoryError when there is no repository and the logs under the log root are stamped with one's id:
        the group had a repository and it was deleted (or its volume is not mounted). Going on would make a new,
        empty one, forgetting the group's members, definitions, declared lost logs and migrated structures, and
        every member's start would then be refused (its log "of another group")."""
        if self.path.exists():
            return
        stamped = self.stamped_logs()
        if not stamped:
            return  # a new group (or one from before logs were stamped): the repository is made when first written
        ids = [i for i, _ in Counter(stamped.values()).most_common()]  # the most logs' id first
        logs = ", ".join(sorted(stamped))
        raise RepositoryError(
            f"the group repository {self.path} is missing, and the logs under {self.log_root} ({logs}) are stamped "
            f"with its id {' or '.join(ids)}: it was deleted or its volume is not mounted; a new one would forget "
            f"the group's members, definitions and declared lost logs, so nothing was changed: put it back from a "
            f"copy (owner-only) and run again")

    @property
    def id(self) -> str | None:
        state = self.load()
        return str(state["id"]) if state else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # definitions and log paths are the operator's business only
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def update(self, change: Callable[[State], None]) -> State:
        """Read, change and durably replace the repository under its lock (created when missing; not rewritten
        when the change changed nothing)."""
        self.refuse_lost()  # before _locked makes the directory: a refused write leaves nothing behind
        with self._locked():
            old = self.load()
            state = json.loads(json.dumps(old)) if old else {
                "format": FORMAT, "version": VERSION, "id": secrets.token_hex(16), "created_at": _iso(),
                "structures": {}, "queues": {}, "members": {}}
            change(state)
            if state != old:
                replace_file(self.path, json.dumps(state, indent=1, sort_keys=True).encode() + b"\n", mode=0o600)
            return state

    def ensure(self) -> State:
        """The repository, created (empty, with a new identity) when there is none."""
        return self.load() or self.update(lambda state: None)

    # --- what it records -----------------------------------------------------------------------------------
    def record_structure(self, sdef: StructureDef, lrsn: int) -> None:
        """A structure's definition; a new one is made at `lrsn`, a replaced one keeps the LRSN it had."""
        self._record("structures", sdef.name, asdict(sdef), lrsn)

    def record_queue(self, qdef: QueueDef, lrsn: int) -> None:
        """A queue's definition; a new one is made at `lrsn`, a replaced one keeps the LRSN it had."""
        self._record("queues", qdef.name, asdict(qdef), lrsn)

    def _record(self, section: str, name: str, definition: dict[str, Any], lrsn: int) -> None:
        """A definition of ``section``; a replaced one keeps the LRSN and the time it was first defined."""
        def change(state: State) -> None:
            old = state[section].get(name)
            old = old if isinstance(old, dict) else {}  # a malformed one (edited by hand) is defined again over
            state[section][name] = {**definition, "lrsn": int(old.get("lrsn", lrsn)),
                                    "defined_at": old.get("defined_at", _iso()), "updated_at": _iso()}
        self.update(change)

    def adopt(self, structures: list[StructureDef], queues: list[QueueDef]) -> None:
        """Definitions made elsewhere (in the CF before the repository existed, or restored from a backup) that
        the repository lacks; what it knows stays. Their LRSN is 0, unknown: a structure restored from its
        definition alone is then replayed from the start of every log."""
        def change(state: State) -> None:
            for section, defs in (("structures", structures), ("queues", queues)):
                for d in defs:
                    if d.name not in state[section]:
                        state[section][d.name] = {**asdict(d), "lrsn": 0, "defined_at": _iso(),
                                                  "updated_at": _iso()}
        self.update(change)

    def record_member(self, member: str, log_dir: Path, *, began_anew: bool = False) -> None:
        """A member's join, with where it logs. A declared loss of its log (declare_log_lost) is no longer pending
        once it joins with a log: the new one it began (began_anew), or the old one, back after all. The declaration
        is kept: restore refuses the bases taken before it, whichever log the member went on with."""
        def change(state: State) -> None:
            old = state["members"].get(member) or {}
            rec = {"log": str(Path(log_dir).absolute()), "joined_at": old.get("joined_at", _iso()),
                   "last_joined_at": _iso()}
            if old.get(LOG_LOST):
                went_on = {"new_log_at": _iso()} if began_anew else {"log_back_at": _iso()}
                rec[LOG_LOST] = {**old[LOG_LOST], **({"pending": False, **went_on} if old[LOG_LOST].get("pending")
                                                     else {})}
            state["members"][member] = rec
        self.update(change)

    def declare_log_lost(self, member: str, lrsn: int) -> dict[str, Any]:
        """Record that `member`'s log is lost for good (sqm log lost): its next start begins a new log, purges and
        COLD and WARM starts go on without it, and a restore refuses every base begun before the declaration, by
        `lrsn` and by the time it records (restore.run.refuse_lost_logs). RepositoryError when the group has no
        such member."""
        # to the microsecond: restore compares it with the times backups began (restore.run.refuse_lost_logs)
        declared: dict[str, Any] = {"declared_at": _iso("microseconds"),
                                    "lrsn": int(lrsn), "pending": True}

        def change(state: State) -> None:
            rec = state["members"].get(member)
            if rec is None:
                raise RepositoryError(f"the group has no member {member} (members: "
                                      f"{', '.join(sorted(state['members'])) or 'none'})")
            rec[LOG_LOST] = declared
        self.update(change)
        return declared

    # --- what it knows ---------------------------------------------------------------------------------------
    def structure(self, name: str) -> tuple[StructureDef, int] | None:
        """A structure's definition and the LRSN it was made at, or None."""
        rec = ((self.load() or {}).get("structures") or {}).get(name)
        if rec is None:
            return None
        try:
            lrsn = int(rec["lrsn"])
        except (ValueError, TypeError, KeyError):  # malformed (edited by hand): unknown, as adopt's, read from 0
            lrsn = 0
        return _structure_def(name, rec), lrsn

    def structures(self) -> dict[str, StructureDef]:
        """Every structure the repository defines, by name (an entry written before RECAUTO existed reads as on)."""
        return {name: _structure_def(name, rec)
                for name, rec in ((self.load() or {}).get("structures") or {}).items()}

    def queues(self, structure: str | None = None) -> list[QueueDef]:
        """The queue definitions (of one structure, or all), sorted by name; a malformed one (edited by hand) is
        passed over with a warning, so that it cannot stop every member's start."""
        out = []
        for name, rec in ((self.load() or {}).get("queues") or {}).items():
            if structure is None or (isinstance(rec, dict) and rec.get("structure") == structure):
                try:
                    out.append(QueueDef.from_dict(rec))
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    log.warning("group repository: the definition of queue %s is malformed (%s): passed over; "
                                "define it again", name, e)
        return sorted(out, key=lambda q: q.name)

    # --- the group's defaults for its services (cfemu.uow_attributes.UowDefaults) -----------------------------
    def record_uow_defaults(self, defaults: UowDefaults) -> None:
        def change(state: State) -> None:
            state[UOW_DEFAULTS] = {**defaults.to_dict(), "updated_at": _iso()}
        self.update(change)

    def uow_defaults(self) -> UowDefaults | None:
        rec = (self.load() or {}).get(UOW_DEFAULTS)
        return None if rec is None else UowDefaults.from_dict({k: v for k, v in rec.items() if k != "updated_at"})

    # --- the group's logon key: its fingerprint, so that a lost key file is not silently replaced ----------
    def logon_key_fingerprint(self) -> str | None:
        return _fingerprint_in((self.load() or {}).get(LOGON_KEY))

    def record_logon_key_fingerprint(self, fingerprint: str) -> str:
        """Record the fingerprint unless one is recorded (a section edited into something else is replaced); the
        one recorded now."""
        def change(state: State) -> None:
            if _fingerprint_in(state.get(LOGON_KEY)) is None:
                state[LOGON_KEY] = {"fingerprint": fingerprint, "recorded_at": _iso()}
        return str(self.update(change)[LOGON_KEY]["fingerprint"])

    # --- store migration: the source that must not serve again (backup.migrate) ----------------------------
    def record_migrated(self, structure: str, migration: str, *, unload: str, source_cf: str) -> None:
        """`structure` was unloaded by `migration`: restore, RECAUTO and the start modes refuse it from now on."""
        def change(state: State) -> None:
            state.setdefault(MIGRATED, {})[structure] = {"migration": migration, "unload": unload,
                                                         "source_cf": source_cf, "migrated_at": _iso()}
        self.update(change)

    def clear_migrated(self, structure: str, migration: str | None = None) -> dict[str, Any] | None:
        """Forget that `structure` was migrated (only `migration`'s record, when given); returns the record."""
        found: list[dict[str, Any]] = []

        def change(state: State) -> None:
            rec = (state.get(MIGRATED) or {}).get(structure)
            if rec is not None and (migration is None or rec.get("migration") == migration):
                found.append(state[MIGRATED].pop(structure))
        if self.exists():
            self.update(change)
        return found[0] if found else None

    def record_loaded(self, structure: str, migration: str, *, unload: str,
                      pass_before: Mapping[str, Any] | None = None) -> None:
        """`structure` was loaded here by `migration` from `unload`: none of what was loaded is in this group's logs,
        so until a backup or a complete relog pass taken since holds it, a restore from the definition alone, from a
        backup begun before the load or from `pass_before` (the newest complete relog pass of the structure in this
        group's logs when it was loaded: {member, e}) would lose it (restore.run). The time is to the microsecond: a
        backup begun in the second before the load is before it."""
        def change(state: State) -> None:
            state.setdefault(LOADED, {})[structure] = {
                "migration": migration, "unload": unload,
                "loaded_at": _iso("microseconds"),
                "pass_before": dict(pass_before) if pass_before is not None else None}
        self.update(change)

    def loaded(self, structure: str) -> dict[str, Any] | None:
        """The migration that loaded `structure` here, or None."""
        rec = ((self.load() or {}).get(LOADED) or {}).get(structure)
        return dict(rec) if rec else None

    def migrated(self) -> dict[str, dict[str, Any]]:
        """Structure -> its migration record, for every structure unloaded and not reopened."""
        return dict((self.load() or {}).get(MIGRATED) or {})

    def members(self) -> dict[str, str]:
        """Member -> its log directory, for every member that ever joined."""
        return {m: str(rec.get("log", "")) for m, rec in ((self.load() or {}).get("members") or {}).items()}

    def member(self, name: str) -> dict[str, Any] | None:
        """What the repository records of one member (its log, its joins, a declared loss of its log), or None."""
        rec = ((self.load() or {}).get("members") or {}).get(name)
        return dict(rec) if rec else None

    def lost_logs(self) -> dict[str, dict[str, Any]]:
        """Member -> the declared loss of its log ({"declared_at", "lrsn", "pending": no new log begun yet}), for
        every member whose log was declared lost."""
        return {m: dict(rec[LOG_LOST]) for m, rec in ((self.load() or {}).get("members") or {}).items()
                if rec.get(LOG_LOST)}


def _fingerprint_in(rec: object) -> str | None:
    return rec["fingerprint"] if isinstance(rec, dict) and isinstance(rec.get("fingerprint"), str) else None


def migrated_refusal(structure: str, record: Mapping[str, Any], doing: str) -> str:
    """The one-line reason restore, RECAUTO and the start modes give for not `doing` a migrated structure."""
    return (f"structure {structure} was migrated (migration {record.get('migration', '?')}, unloaded to "
            f"{record.get('unload', '?')}): its messages are served by the migration's target, so {doing} it here "
            f"would serve them twice; only if the migration is abandoned: 'cfemu migrate reopen {structure} "
            f"--confirm {structure}', then again")


def open_group_repository(admin: Admin, log_root: str | os.PathLike[str], *, who: str) -> GroupRepository:
    """The group repository under log_root, checked to be the group's: the one the CF records, or, when the CF
    records none (a new group, or a CF lost and not yet restored), this one, created if need be and recorded
    as the group's. RepositoryError, naming `who` and both places, when log_root is not the group's."""
    repo = GroupRepository(log_root)
    recorded = admin.repository()
    if recorded is None:
        state = repo.ensure()
        recorded = admin.claim_repository(str(state["id"]), str(repo.path))
    mine = repo.id
    if mine == recorded["id"]:
        redefine_survivors(admin, repo)
        repo.adopt(admin.structures(), admin.queues())  # definitions made without the repository
        _sync_uow_defaults(admin, repo)
    elif mine is None and Path(recorded["path"]).absolute() == repo.path:
        raise RepositoryError(
            f"{who}: the group repository {repo.path} is missing, and the CF records it there as the group's (id "
            f"{recorded['id']}): it was deleted or its volume is not mounted; put it back from a copy and run again")
    else:
        raise RepositoryError(
            f"{who}: the log root {repo.log_root} is not the group's: the CF records the group's repository at "
            f"{recorded['path']}, and {repo.path} "
            + ("does not exist" if mine is None else "is another one")
            + "; peer recovery, backup and restore read every member's log under the group's log root, so use "
              "that one (--log-root or $CFEMU_LOG_ROOT)")
    return repo


def _sync_uow_defaults(admin: Admin, repo: GroupRepository) -> None:
    """The group's defaults for its services where one side lacks them: the CF's again after it was lost, the
    repository's when they were set in the CF alone."""
    in_cf, in_repo = admin.uow_defaults(), repo.uow_defaults()
    if in_cf is None and in_repo is not None:
        admin.set_uow_defaults(in_repo)
    elif in_cf is not None and in_repo != in_cf:
        repo.record_uow_defaults(in_cf)


def _structure_def(name: str, rec: Mapping[str, Any]) -> StructureDef:
    """A structure's definition as the repository holds it. A malformed one (edited by hand) still names a structure
    with a history in the logs, so it is read with the defaults (unlimited capacity) and a warning, never dropped:
    a dropped one would let the structure be defined again empty over its history."""
    try:
        return StructureDef.from_dict(rec)
    except (ValueError, TypeError, KeyError) as e:
        log.warning("group repository: the definition of structure %s is malformed (%s): read as unlimited; "
                    "'cfemu alter structure %s' sets it again", name, e, name)
        return StructureDef(name, recauto=bool(rec.get("recauto", True)) if isinstance(rec, Mapping) else True)


def redefine_survivors(admin: Admin, repo: GroupRepository) -> list[str]:
    """Define again, from the repository, the structures that outlived the admin structure: on a Redis Cluster CF
    (cfemu.rcluster) the master holding {ADMIN} can be lost while the structures on the other masters are not.
    Without their definitions, a member re-joining the new admin structure would not carry its new epoch into
    their fences (Admin.join_structures walks the definitions) and be refused there as stale. A structure whose
    header is gone too is left to restore (which defines it again itself). Returns the names defined again."""
    defined = {s.name for s in admin.structures()}
    out = []
    for name, sdef in sorted(repo.structures().items()):
        if name in defined or not admin.redis.exists(keys.meta(name)):
            continue
        admin.define_structure(name, max_entries=sdef.max_entries, max_bytes=sdef.max_bytes, replace=True,
                               recauto=sdef.recauto)
        for q in repo.queues(name):
            with contextlib.suppress(AdminError):
                admin.define_from(q, structure=name)
        out.append(name)
    return out


def define_structure(admin: Admin, repo: GroupRepository, name: str, *, max_entries: int = 0, max_bytes: int = 0,
                     replace: bool = False, recauto: bool = True) -> StructureDef:
    """Define a structure in the CF and, durably, in the group repository (the CF is lost with its content;
    the repository is not). A structure the repository knows but the CF does not has a history in the logs:
    it is restored (cfrestore run), never defined again empty over it."""
    keys.check_name("structure", name)
    known = repo.structure(name)
    if known is not None and name not in {s.name for s in admin.structures()}:
        raise RepositoryError(f"structure {name} is in the group repository (defined at LRSN {known[1]}) but not in "
                              f"the CF: the CF was lost; restore it with 'cfrestore run {name}' (or empty it with "
                              f"'cfrestore purge {name}')")
    lrsn = now_lrsn()
    sdef = admin.define_structure(name, max_entries=max_entries, max_bytes=max_bytes, replace=replace, clock=lrsn,
                                  recauto=recauto)
    repo.record_structure(sdef, lrsn)
    return sdef


def alter_structure(admin: Admin, repo: GroupRepository, name: str, *, max_entries: int | None = None,
                    max_bytes: int | None = None, recauto: bool | None = None) -> StructureDef:
    """Change the attributes given (None: keep), in the CF and the group repository (ALTER CFSTRUCT). A structure
    the CF lost is altered in the repository alone (e.g. RECAUTO off before anyone restores it): restore
    recreates it from there."""
    keys.check_name("structure", name)
    known = repo.structure(name)
    in_cf = name in {s.name for s in admin.structures()}
    if in_cf:
        old = admin.structure_def(name)
    elif known is not None:
        old = known[0]
    else:
        raise RepositoryError(f"structure {name} is not defined")
    new = StructureDef(name, old.max_entries if max_entries is None else max_entries,
                       old.max_bytes if max_bytes is None else max_bytes, old.recauto if recauto is None else recauto)
    if in_cf:
        new = admin.define_structure(name, max_entries=new.max_entries, max_bytes=new.max_bytes, replace=True,
                                     recauto=new.recauto)
    repo.record_structure(new, known[1] if known else now_lrsn())
    return new


def define_uow_defaults(admin: Admin, repo: GroupRepository, given: Mapping[str, Any]) -> UowDefaults:
    """Set the group's defaults for its services (STORE, MAX-UOWS, UWSTATP): the ones ``given``, the rest as they
    were; in the CF and, durably, in the group repository. A bad value changes nothing (AdminError)."""
    current = admin.uow_defaults() or repo.uow_defaults() or UowDefaults()
    try:
        new = UowDefaults.from_dict({**current.to_dict(), **given})
    except (ValueError, TypeError) as e:
        raise AdminError(f"UOW defaults: {e}") from None
    repo.record_uow_defaults(new)
    return admin.set_uow_defaults(new)


def define_queue(admin: Admin, repo: GroupRepository, name: str, structure: str, *, backout_threshold: int = 0,
                 backout_queue: str = "", max_msg_length: int = 4 * 2**20, replace: bool = False,
                 uow: Mapping[str, Any] | None = None, topic: Mapping[str, Any] | None = None) -> QueueDef:
    """Define a queue (or, with ``uow`` attributes, a service, with ``topic`` attributes, a topic, and its companion
    queues) in the CF and, durably, in the group repository."""
    qdef = admin.define_queue(name, structure, backout_threshold=backout_threshold, backout_queue=backout_queue,
                              max_msg_length=max_msg_length, replace=replace, uow=uow, topic=topic)
    lrsn = now_lrsn()
    repo.record_queue(qdef, lrsn)
    for companion in qdef.companions:
        repo.record_queue(admin.queue_def(companion), lrsn)
    return qdef


def ensure_structure(admin: Admin, repo: GroupRepository, name: str, queues: tuple[str, ...] | list[str] = (), *,
                     max_entries: int = 0, max_bytes: int = 0, recauto: bool = True) -> None:
    """Admin.ensure_structure, durably: for a launcher that sets up a group it may have set up before. What is
    defined already stays as it is; a structure the repository knows but the CF lost is left to restore."""
    with contextlib.suppress(AdminError):
        define_structure(admin, repo, name, max_entries=max_entries, max_bytes=max_bytes, recauto=recauto)
    for q in queues:
        with contextlib.suppress(AdminError):
            define_queue(admin, repo, q, name)
