"""The CF admin structure {ADMIN}: structure and queue definitions, group members with their leases and fencing
epochs, recovery locks, and the backup catalog.

Like the CF itself the admin structure is lost with the CF; restore rebuilds what it needs (definitions from the
group repository, cfemu.repository, and the backup; members re-join with epochs that only grow; the catalog from
the backup directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import redis

from cfemu import duplex, keys, lua
from cfemu.limits import DEFAULT_MSG_LENGTH, check_defined, check_max_msg_length
from cfemu.topic_attributes import TopicAttributes, companion_queues
from cfemu.uow_attributes import UowAttributes, UowDefaults, control_queue, data_queue, stored_attributes

log = logging.getLogger("cfemu.admin")

STRUCTURES, QUEUES, MEMBERS, EPOCHS = keys.structure_defs(), keys.queue_defs(), keys.members(), keys.epochs()

STRUCTURE_STATES = ("ACTIVE", "FAILED", "RECOVERING")


def lease_left_ms(info: Mapping[str, Any] | None) -> int | None:
    """What is left of a member's lease, as Admin.members lists the member (`info`), or None: not listed, or its
    lease lapsed (the CF's PTTL of a key that is gone is negative)."""
    left = int(info.get("lease_ms", -1)) if info is not None else -1
    return left if left >= 0 else None


class AdminError(ValueError):
    """A definition request that cannot be carried out (already defined, unknown name, bad value)."""


@dataclass
class StructureDef:
    name: str
    max_entries: int = 0  # 0 = unlimited
    max_bytes: int = 0
    # RECAUTO (MQ's CFSTRUCT RECAUTO): a member that finds the structure failed restores it without an operator
    # (sqm.core.recauto). On by default, as in MQ; a definition written before the attribute existed reads as on.
    recauto: bool = True

    def __post_init__(self) -> None:
        # Checked here, so that no path (the command line, the console, a repository read) makes a definition the
        # CF, msgpack or the group repository's readers cannot take.
        try:
            check_defined(f"structure {self.name}: max_entries", self.max_entries)
            check_defined(f"structure {self.name}: max_bytes", self.max_bytes)
        except ValueError as e:
            raise AdminError(str(e)) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructureDef:
        """A definition as stored (admin structure, group repository, a backup's structure_def), old ones too."""
        return cls(str(d["name"]), int(d.get("max_entries", 0) or 0), int(d.get("max_bytes", 0) or 0),
                   bool(d.get("recauto", True)))


@dataclass
class QueueDef:
    name: str
    structure: str
    backout_threshold: int = 0  # 0 = never move to the backout queue
    backout_queue: str = ""
    max_msg_length: int = DEFAULT_MSG_LENGTH  # at most cfemu.limits.MAX_MSG_LENGTH
    # A service's unit-of-work attributes (cfemu.uow_attributes.UowAttributes as a dict); empty: a plain queue.
    uow: dict[str, Any] = field(default_factory=dict)
    # A topic's attributes (cfemu.topic_attributes.TopicAttributes as a dict); empty: not a topic.
    topic: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            check_defined(f"queue {self.name}: backout_threshold", self.backout_threshold)
        except ValueError as e:
            raise AdminError(str(e)) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QueueDef:
        """A definition as stored (admin structure, group repository, a backup's manifest), old ones too."""
        return cls(str(d["name"]), str(d["structure"]), int(d.get("backout_threshold", 0) or 0),
                   str(d.get("backout_queue", "") or ""), int(d.get("max_msg_length", DEFAULT_MSG_LENGTH)),
                   dict(d.get("uow") or {}), dict(d.get("topic") or {}))

    @property
    def uow_attributes(self) -> UowAttributes | None:
        return UowAttributes.from_dict(self.uow) if self.uow else None

    @property
    def topic_attributes(self) -> TopicAttributes | None:
        return TopicAttributes.from_dict(self.topic) if self.topic else None

    @property
    def companions(self) -> tuple[str, ...]:
        """The companion queues defined with this one (a service's, a topic's)."""
        return ((data_queue(self.name), control_queue(self.name)) if self.uow else ()) + (
            companion_queues(self.name) if self.topic else ())


def _pack(obj: Any) -> bytes:
    return msgpack.packb(asdict(obj), use_bin_type=True)


def stage_structure(writer: redis.Redis, sdef: StructureDef, *, state: str, gen: int,
                    epochs: Mapping[Any, Any], clock: int = 0) -> None:
    """The writes that create (or re-size) a structure's header, keeping the fields it already has, and copy the
    members' epochs into its fence: on a client (Admin.create_structure), or queued on a transaction (a restore's
    guarded reset, cfemu.bulk.reset)."""
    m = keys.meta(sdef.name)
    for name, value in (("gen", gen), ("clock", clock), ("floor", 0), ("entries", 0), ("bytes", 0), ("state", state)):
        writer.hsetnx(m, name, value)
    writer.hset(m, mapping={"max_entries": sdef.max_entries, "max_bytes": sdef.max_bytes})
    if epochs:
        writer.hset(keys.fence(sdef.name), mapping=dict(epochs))


class Admin:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._scripts = lua.register(client, lua.admin_operations())  # cfemu/scripts/admin_*.lua
        self.bad_entries: dict[tuple[str, str], str] = {}  # (hash, field) -> why it could not be read

    def _run(self, op: str, keys_: list[str], args: list[Any]) -> int:
        """One admin script (cfemu/scripts/admin_<op>.lua); each returns an integer. On a duplexed CF the write
        (a fence, a lease, a lock) is on both servers before it counts (cfemu.duplex)."""
        script = self._scripts[f"admin_{op}"]
        if duplex.pair_of(self.redis) is None:
            return int(script(keys=keys_, args=args))
        command = ("EVALSHA", script.sha, len(keys_), *keys_, *args)
        try:
            return int(duplex.run_confirmed(self.redis, [command])[0])
        except redis.exceptions.NoScriptError:
            self.redis.script_load(script.script)
            return int(duplex.run_confirmed(self.redis, [command])[0])

    # --- the group ------------------------------------------------------------------------------------
    def group_name(self) -> str:
        """The queue-sharing group's name (backups record it; restore refuses another group's backup)."""
        name = self.redis.get(keys.group())
        return keys.text(name) if name else "QSG1"

    def set_group_name(self, name: str) -> None:
        self.redis.set(keys.group(), keys.check_name("group", name))

    def uow_defaults(self) -> UowDefaults | None:
        """The group's defaults for its services' STORE, MAX-UOWS and UWSTATP (None: none set in this CF)."""
        raw = self.redis.get(keys.uow_defaults())
        if raw is None:
            return None
        try:
            return UowDefaults.from_dict(msgpack.unpackb(raw, raw=False))
        except (ValueError, TypeError) as e:
            self.bad_entries[(keys.uow_defaults(), "")] = str(e)
            return None

    def set_uow_defaults(self, defaults: UowDefaults) -> UowDefaults:
        self.redis.set(keys.uow_defaults(), _pack(defaults))
        return defaults

    # --- structures -----------------------------------------------------------------------------------
    def define_structure(self, name: str, *, max_entries: int = 0, max_bytes: int = 0,
                         replace: bool = False, clock: int = 0, recauto: bool = True,
                         create: bool = True) -> StructureDef:
        """Define a structure and create it in the CF. clock: where a new structure's LRSN clock starts (the
        group repository's definition LRSN: every record of the structure's work then lies above it). create
        False: the definition alone, the structure's own keys left as they are (a restore or a purge that owns
        the structure writes its header and fence by its guarded reset, cfemu.bulk.reset)."""
        keys.check_name("structure", name)
        if name == "ADMIN":
            raise AdminError("ADMIN is the admin structure's name; choose another")
        if max_entries < 0 or max_bytes < 0:
            raise AdminError("structure capacity must be >= 0 (0 = unlimited)")
        sdef = StructureDef(name, max_entries, max_bytes, recauto)
        if not self.redis.hsetnx(STRUCTURES, name, _pack(sdef)):
            if not replace:
                raise AdminError(f"structure {name} is already defined")
            self.redis.hset(STRUCTURES, name, _pack(sdef))
        if create:
            self.create_structure(sdef, clock=clock)
        return sdef

    def create_structure(self, sdef: StructureDef, *, state: str = "ACTIVE", gen: int = 1, clock: int = 0) -> None:
        """Create (or re-size) the structure's header in the CF and copy the members' epochs into it."""
        stage_structure(self.redis, sdef, state=state, gen=gen, clock=clock, epochs=self.redis.hgetall(EPOCHS))

    def structures(self) -> list[StructureDef]:
        """Every defined structure; a malformed definition is reported (bad_entries) and skipped, so one bad
        admin entry cannot stop every member's housekeeping."""
        return [d for d in (self._decode(STRUCTURES, k, v, lambda **d: StructureDef.from_dict(d))
                            for k, v in self.redis.hgetall(STRUCTURES).items()) if d is not None]

    def _decode(self, key: str, field: Any, value: Any, cls: Any) -> Any:
        try:
            return cls(**msgpack.unpackb(value, raw=False))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            name = keys.text(field)
            if (key, name) not in self.bad_entries:
                log.error("malformed admin entry %s[%s] skipped: %s", key, name, e)
            self.bad_entries[(key, name)] = f"{type(e).__name__}: {e}"
            return None

    def structure_def(self, name: str) -> StructureDef:
        raw = self.redis.hget(STRUCTURES, name)
        if raw is None:
            raise AdminError(f"structure {name} is not defined")
        return StructureDef.from_dict(msgpack.unpackb(raw, raw=False))

    def set_state(self, name: str, state: str) -> None:
        if state not in STRUCTURE_STATES:
            raise AdminError(f"structure state must be one of {', '.join(STRUCTURE_STATES)}, not {state}")
        self.structure_def(name)
        self.redis.hset(keys.meta(name), "state", state)

    def state(self, name: str) -> str:
        """ACTIVE, FAILED or RECOVERING; a defined structure missing from the CF (CF lost) counts as FAILED."""
        st = self.redis.hget(keys.meta(name), "state")
        return keys.text(st) if st else "FAILED"

    # --- queues ---------------------------------------------------------------------------------------
    def define_queue(self, name: str, structure: str, *, backout_threshold: int = 0, backout_queue: str = "",
                     max_msg_length: int = DEFAULT_MSG_LENGTH, replace: bool = False,
                     uow: Mapping[str, Any] | None = None, topic: Mapping[str, Any] | None = None) -> QueueDef:
        """``uow``: the service's unit-of-work attributes (cfemu.uow_attributes); a service's companion queues
        (<name>.UOWDATA, <name>.UOWCTL) are defined with it, on the same structure. ``topic``: a topic's attributes
        (cfemu.topic_attributes); its companion queues (<name>.PUB, <name>.SUB) likewise."""
        keys.check_name("queue", name)
        self.structure_def(structure)
        if backout_queue:
            keys.check_name("queue", backout_queue)
        if backout_threshold < 0:
            raise AdminError(f"backout threshold must be >= 0, not {backout_threshold}")
        try:  # the group's bound: a message a queue accepts must fit every path a message takes
            check_max_msg_length(max_msg_length)
        except ValueError as e:
            raise AdminError(f"queue {name}: {e}") from None
        attrs: dict[str, Any] = {}
        if uow is not None:
            try:
                attrs = stored_attributes(uow)
                for companion in (data_queue(name), control_queue(name)):
                    keys.check_name("queue", companion)
            except ValueError as e:
                raise AdminError(f"service {name}: {e}") from None
        tattrs: dict[str, Any] = {}
        if topic is not None:
            if uow is not None:
                raise AdminError(f"queue {name}: a topic cannot be a service too (choose --uow or --topic)")
            try:
                tattrs = TopicAttributes.from_dict(topic).to_dict()
                for companion in companion_queues(name):
                    keys.check_name("queue", companion)
            except (ValueError, TypeError) as e:
                raise AdminError(f"topic {name}: {e}") from None
        qdef = QueueDef(name, structure, backout_threshold, backout_queue, max_msg_length, attrs, tattrs)
        old = self.redis.hget(QUEUES, name)
        if old is not None and not replace:
            raise AdminError(f"queue {name} is already defined")
        if old is None and not replace:
            # A plain queue may have a companion's name (X.PUB, X.UOWDATA): a topic or service defined over it would
            # take its messages for its own state (the pubsub sweeper removes them as received publications) and
            # close it to the applications that use it. ``replace`` is the operator's word that it is to be taken.
            for companion in qdef.companions:
                if self.redis.hexists(QUEUES, companion):
                    raise AdminError(f"queue {companion} is already defined: {name} cannot be defined as a "
                                     f"{'service' if qdef.uow else 'topic'}, whose companion queue it would be "
                                     "(delete it first, or define with replace to take it over)")
        if old is not None and msgpack.unpackb(old, raw=False)["structure"] != structure:
            raise AdminError(f"queue {name} is on another structure; it cannot move")
        if old is not None:
            # A redefinition that does not name the UOW or topic attributes keeps them: redefining a service to
            # change its backout queue must not make it a plain queue, whose units of work would never be settled
            # again. A service stays a service and a topic a topic.
            was = QueueDef.from_dict(msgpack.unpackb(old, raw=False))
            kept = dataclasses.replace(qdef, uow=qdef.uow or (was.uow if uow is None else {}),
                                       topic=qdef.topic or (was.topic if topic is None else {}))
            if bool(was.uow) != bool(kept.uow) or bool(was.topic) != bool(kept.topic):
                raise AdminError(f"queue {name} is a {'service' if was.uow else 'topic' if was.topic else 'plain queue'}"
                                 "; a redefinition cannot change what kind of queue it is")
            qdef = kept
        self.redis.hset(QUEUES, name, _pack(qdef))
        self.redis.sadd(keys.queues(structure), name)
        if qdef.companions:
            for companion in qdef.companions:
                cdef = QueueDef(companion, structure, 0, "", max_msg_length)
                self.redis.hset(QUEUES, companion, _pack(cdef))
                self.redis.sadd(keys.queues(structure), companion)
        return qdef

    def define_from(self, qdef: QueueDef, *, structure: str = "", replace: bool = False) -> QueueDef:
        """Define a queue again from a definition as stored (the group repository's, a backup's), every attribute
        with it: a redefinition that listed the fields one by one dropped a service's UOW attributes and a topic's
        (a Redis Cluster CF that lost its {ADMIN} master turned the chaos topic into a plain queue)."""
        return self.define_queue(qdef.name, structure or qdef.structure, backout_threshold=qdef.backout_threshold,
                                 backout_queue=qdef.backout_queue, max_msg_length=qdef.max_msg_length,
                                 replace=replace, uow=qdef.uow or None, topic=qdef.topic or None)

    def ensure_structure(self, name: str, queues: Iterable[str] = (), *, max_entries: int = 0,
                         max_bytes: int = 0) -> None:
        """Define a structure and its queues where they are not defined yet. A definition refused with AdminError
        (already there, perhaps with other values) is left as it is and the next one is tried: for a launcher
        that sets up a group it may have set up before, where the existing definitions win."""
        with contextlib.suppress(AdminError):
            self.define_structure(name, max_entries=max_entries, max_bytes=max_bytes)
        for q in queues:
            with contextlib.suppress(AdminError):
                self.define_queue(q, name)

    def queue_def(self, name: str) -> QueueDef:
        raw = self.redis.hget(QUEUES, name)
        if raw is None:
            raise AdminError(f"queue {name} is not defined")
        return QueueDef.from_dict(msgpack.unpackb(raw, raw=False))

    def queues(self) -> list[QueueDef]:
        """Every defined queue, by name; a malformed definition is reported (bad_entries) and skipped, as in
        structures() (every member reads them when it joins: cfemu.repository)."""
        found = (self._decode(QUEUES, k, v, lambda **d: QueueDef.from_dict(d)) for k, v in self.redis.hgetall(QUEUES).items())
        return sorted((q for q in found if q is not None), key=lambda q: q.name)

    # --- members, leases, fencing ---------------------------------------------------------------------
    def join(self, member: str, info: dict[str, Any], lease_ms: int) -> int:
        """Register a member and give it a new epoch (epochs only grow, even across the loss of the CF). The lease
        is in place before the member is listed, so no peer ever sees it listed without a lease (lapsed)."""
        keys.check_member_name(member)
        old = int(self.redis.hget(EPOCHS, member) or 0)
        epoch = max(old + 1, int(info.get("min_epoch", 0)), int(time.time() * 1000))
        packed_info = msgpack.packb(info, use_bin_type=True)
        self._transaction([("HSET", EPOCHS, member, epoch), ("SET", keys.lease(member), epoch, "PX", lease_ms),
                           ("HSET", MEMBERS, member, packed_info)])
        self.join_structures(member, epoch)
        return epoch

    def join_structures(self, member: str, epoch: int) -> None:
        """Carry a member's epoch into every structure's fence (a structure rebuilt by restore starts without).
        A fence only moves up: a late write of an older epoch cannot unfence a newer incarnation."""
        for s in self.structures():
            self._run("raise_fence", [keys.fence(s.name)], [member, epoch])

    def heartbeat(self, member: str, epoch: int, lease_ms: int) -> int:
        """Renew the lease: 1 renewed, 0 fenced (the epoch is no longer current), -1 unknown (CF lost: re-join)."""
        return self._run("heartbeat", [keys.lease(member), EPOCHS], [member, epoch, lease_ms])

    def leave(self, member: str) -> None:
        """Clean shutdown: no lease, no recovery needed (the member's log shows no open work). The lease and the
        listing go in one step: a peer never sees the member listed without a lease (lapsed) and recovers it."""
        self._transaction([("DEL", keys.lease(member)), ("HDEL", MEMBERS, member)])

    def _transaction(self, commands: list[tuple[Any, ...]]) -> None:
        """The commands applied as one step (MULTI/EXEC): no reader sees some of them done and not the others. On a
        duplexed CF they are on both servers before this returns (the member acts on them at once)."""
        if duplex.pair_of(self.redis) is not None:
            duplex.run_confirmed(self.redis, [("MULTI",), *commands, ("EXEC",)])
            return
        pipe = self.redis.pipeline(transaction=True)
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute()

    def fence(self, member: str, *, repair_ms: int = 5000) -> int:
        """Bump a lapsed member's epoch so that every CF call it makes with the old one is refused. Returns 0, and
        changes nothing, when the member holds a lease again (it restarted since it was seen lapsed) or is no longer
        listed (it left the group, or a peer recovered it, since it was seen lapsed). A lease key
        that holds anything but a lease (another type, no time to live) fences nobody: it is replaced by a lease
        of ``repair_ms`` and 0 returned (admin_fence.lua)."""
        epoch = self._run("fence", [keys.lease(member), EPOCHS, MEMBERS], [member, int(time.time() * 1000), repair_ms])
        if epoch == -2:  # it left (or was recovered) after the caller listed it: nobody to fence
            return 0
        if epoch < 0:
            log.warning("the lease key of member %s held no lease (another type, or no time to live): replaced by a "
                        "lease of %d ms; the member is not fenced", member, repair_ms)
            return 0
        if epoch:
            self.join_structures(member, epoch)
        return epoch

    def epoch(self, member: str) -> int:
        return int(self.redis.hget(EPOCHS, member) or 0)

    def members(self) -> dict[str, dict[str, Any]]:
        out = {}
        for k, v in self.redis.hgetall(MEMBERS).items():
            info = self._decode(MEMBERS, k, v, dict)
            if info is None:
                continue
            name = keys.text(k)
            info["epoch"] = self.epoch(name)
            info["lease_ms"] = self.redis.pttl(keys.lease(name))
            out[name] = info
        return out

    def lapsed_members(self) -> list[str]:
        """Members registered in the group whose lease has run out (failed, or paused past the lease)."""
        return [m for m, info in self.members().items() if lease_left_ms(info) is None]

    def try_recovery_lock(self, failed: str, by: str, ttl_ms: int) -> bool:
        return bool(self.redis.set(keys.recovery_lock(failed), by, nx=True, px=ttl_ms))

    def release_recovery_lock(self, failed: str) -> None:
        self.redis.delete(keys.recovery_lock(failed))

    # --- a conversation's first record (sqm.conversations.bindings) ---------------------------------------------
    def try_conversation_lock(self, structure: str, service: str, record: str, holder: str, ttl_ms: int) -> bool:
        """Take the lock of one conversation's first record (SET NX PX): False while another send holds it."""
        return bool(self.redis.set(keys.conversation_lock(structure, service, record), holder, nx=True, px=ttl_ms))

    def release_conversation_lock(self, structure: str, service: str, record: str, holder: str) -> bool:
        """Release it, only if holder still holds it (never another send's, taken after this one's lapsed)."""
        return self._run("hold_lock", [keys.conversation_lock(structure, service, record)], [holder, 0]) == 1

    # --- automatic structure recovery (RECAUTO; sqm.core.recauto) ----------------------------------------------
    def try_structure_recovery_lock(self, structure: str, holder: str, ttl_ms: int) -> bool:
        """Take the lock that makes one member the recoverer of a failed structure (SET NX PX). holder: the
        member and its epoch ("QM2@1795..."), so that a re-joined incarnation is not taken for its old one."""
        return bool(self.redis.set(keys.structure_recovery_lock(structure), holder, nx=True, px=ttl_ms))

    def renew_structure_recovery_lock(self, structure: str, holder: str, ttl_ms: int) -> bool:
        """Move the lock's expiry on, only while holder holds it; False: it lapsed or another took it."""
        return self._run("hold_lock", [keys.structure_recovery_lock(structure)], [holder, ttl_ms]) == 1

    def release_structure_recovery_lock(self, structure: str, holder: str) -> bool:
        """Release the lock, only if holder still holds it (never another member's)."""
        return self._run("hold_lock", [keys.structure_recovery_lock(structure)], [holder, 0]) == 1

    def structure_recovery_holder(self, structure: str) -> str | None:
        raw = self.redis.get(keys.structure_recovery_lock(structure))
        return keys.text(raw) if raw is not None else None

    def set_recovery_attempt(self, structure: str, holder: str | None) -> None:
        """Mark (or, with None, clear) an automatic recovery under way. The mark has no TTL: a structure left
        RECOVERING by an automatic restore whose member died shows the mark with no live lock, and is recovered
        again; a RECOVERING structure without it is an operator's restore, which members leave alone."""
        if holder is None:
            self.redis.hdel(keys.recovery_attempts(), structure)
        else:
            self.redis.hset(keys.recovery_attempts(), structure, holder)

    def recovery_attempt(self, structure: str) -> str | None:
        raw = self.redis.hget(keys.recovery_attempts(), structure)
        return keys.text(raw) if raw is not None else None

    def forget_member(self, member: str, epoch: int) -> bool:
        """After peer recovery: the member stays fenced (its epoch stays) but is no longer a live member. Not when
        it joined again meanwhile (its epoch is not ``epoch``, the one its fencing gave it): False."""
        return self._run("forget", [MEMBERS, EPOCHS], [member, epoch]) == 1

    # --- the group repository's identity (cfemu.repository) ----------------------------------------------
    def repository(self) -> dict[str, str] | None:
        """{id, path} of the group repository the CF knows as the group's, or None (a new or lost CF)."""
        raw = self.redis.get(keys.repository())
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
            return {"id": str(rec["id"]), "path": str(rec["path"])}
        except (ValueError, TypeError, KeyError) as e:
            log.error("malformed admin entry %s ignored: %s", keys.repository(), e)
            return None

    def claim_repository(self, repo_id: str, path: str, *, overwrite: bool = False) -> dict[str, str]:
        """Record the group's repository unless one is recorded (overwrite: restore, which is authoritative);
        returns the one recorded now."""
        value = json.dumps({"id": repo_id, "path": path})
        self.redis.set(keys.repository(), value, nx=not overwrite)
        return self.repository() or {"id": repo_id, "path": path}

    # --- backup catalog (the copy in the CF; the backup directory holds the durable one) ----------------
    def record_backup(self, structure: str, entry: dict[str, Any]) -> None:
        self.redis.hset(keys.backups(structure), entry["id"], msgpack.packb(entry, use_bin_type=True))

    def backups(self, structure: str) -> list[dict[str, Any]]:
        out = [msgpack.unpackb(v, raw=False) for v in self.redis.hvals(keys.backups(structure))]
        return sorted(out, key=lambda b: b.get("start_lrsn", 0))

    def forget_backup(self, structure: str, backup_id: str) -> None:
        self.redis.hdel(keys.backups(structure), backup_id)
