"""A duplexed CF, the controller's side: the users of the pair, and the steps that degrade, promote and resynchronise it.

The controller is one process: the one that starts both redis-servers of the pair (the local cluster's CF
supervisor, qsg.cfpair). Degrading and promoting are decided by that one actor, one after the other, which is what
makes the rule safe (docs/architecture.md "A duplexed CF"):

* the controller promotes the secondary only while the last mode it set is DUPLEX *confirmed* (it wrote
  mode=DUPLEX on the primary and a WAIT on the same connection saw the secondary acknowledge it);
* a member acknowledges an operation only when the secondary acknowledged it (WAIT) or, read after the operation
  on the same connection, the mode is not DUPLEX (cfemu.duplex). An operation acknowledged the second way was
  applied before the controller's next DUPLEX flip, which its confirming WAIT covers; or the controller degraded
  the pair since, and then it does not promote.

Users (Redis ACL; both servers load the same file, since either may be the primary):

  qsg-replica   the secondary's link to its primary (masteruser/masterauth): PSYNC, REPLCONF, PING only
  qsg-duplex    the controller: REPLICAOF, CONFIG SET (masterauth), INFO, WAIT, and the {ADMIN}:duplex hash only

Their passwords live in the group's secrets directory (cf-replica.password, cf-duplex.password, 0600). The
secondary's masterauth is set with CONFIG SET after it starts, never on its command line (where ps shows it).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cfemu import credentials, keys
from cfemu.duplex import DUPLEX, GEN_FIELD, MODE_FIELD, SIMPLEX
from cfemu.private_files import private_dir, write_private

REPLICA_USER, CONTROL_USER = "qsg-replica", "qsg-duplex"
_FILES = {REPLICA_USER: "cf-replica.password", CONTROL_USER: "cf-duplex.password"}


def passwords(directory: Path) -> dict[str, str]:
    """The pair's two passwords, made now where missing (0600 files in the 0700 secrets directory)."""
    private_dir(directory)
    out = {}
    for user, name in _FILES.items():
        path = directory / name
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32).encode())
        out[user] = credentials.read_password(directory, name[len("cf-"):-len(".password")]) or ""
    return out


def acl_lines(directory: Path) -> list[str]:
    """The pair's ACL lines, added to the group's (cfemu.credentials.acl_lines) on both servers."""
    pw = passwords(directory)
    return [f"user {REPLICA_USER} on >{pw[REPLICA_USER]} -@all +psync +replconf +ping",
            f"user {CONTROL_USER} on >{pw[CONTROL_USER]} ~{keys.duplex()} ~{keys.lease('*')} ~{keys.epochs()} "
            f"~{keys.members()} -@all +@connection +info +ping +wait +replicaof +config|set +hset +hget +hmget "
            "+hgetall +hkeys +set"]


def control_client(host: str, port: int, directory: Path, *, timeout: float = 2.0) -> redis.Redis:
    """The controller's connection to one server of the pair."""
    # No retry: a server that does not answer within timeout is what the controller wants to know about, at once
    # (redis-py's default retries a timeout three times, which turned a 2 s lease into half a minute).
    return redis.Redis(host=host, port=port, username=CONTROL_USER, password=passwords(directory)[CONTROL_USER],
                       socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=False,
                       retry=Retry(NoBackoff(), 0))


def replication(client: redis.Redis) -> dict[str, str]:
    """INFO replication as text fields (role, master_link_status, master_sync_in_progress, connected_slaves...)."""
    info: dict[str, Any] = client.info("replication")
    return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in info.items()}


def in_sync(secondary: redis.Redis) -> bool:
    """The secondary replicates from its primary, with the initial synchronisation done."""
    info = replication(secondary)
    return (info.get("role") == "slave" and info.get("master_link_status") == "up"
            and info.get("master_sync_in_progress") == "0")


def attach(secondary: redis.Redis, primary: tuple[str, int], directory: Path) -> None:
    """Make a server the replica of primary (a full resynchronisation: what it held is replaced)."""
    secondary.config_set("masteruser", REPLICA_USER)
    secondary.config_set("masterauth", passwords(directory)[REPLICA_USER])
    secondary.execute_command("REPLICAOF", primary[0], str(primary[1]))


def state(client: redis.Redis) -> tuple[str, int]:
    """(mode, generation) as recorded on a server: SIMPLEX and 0 when nothing is recorded."""
    raw = client.hmget(keys.duplex(), [MODE_FIELD, GEN_FIELD])
    mode = keys.text(raw[0]) if raw[0] else SIMPLEX
    return mode, int(raw[1] or 0)


def set_mode(primary: redis.Redis, mode: str, *, gen: int | None = None, confirm_ms: int = 2000) -> bool:
    """Record the pair's mode (and generation) on the primary. DUPLEX counts only once the secondary acknowledged
    it (WAIT on the same connection): False when it did not in confirm_ms, and then the pair is set back to
    SIMPLEX, which is what it stays. SIMPLEX needs no acknowledgement."""
    fields: dict[Any, Any] = {MODE_FIELD: mode}
    if gen is not None:
        fields[GEN_FIELD] = gen
    if mode == SIMPLEX:
        primary.hset(keys.duplex(), mapping=fields)
        return True
    pipe = primary.pipeline(transaction=False)
    pipe.hset(keys.duplex(), mapping=fields)
    pipe.execute_command("WAIT", 1, confirm_ms)
    acked = int(pipe.execute()[1])
    if acked < 1:
        primary.hset(keys.duplex(), MODE_FIELD, SIMPLEX)
        return False
    return True


def promote(secondary: redis.Redis, gen: int, *, grace_ms: int) -> None:
    """Make the secondary the primary, at a new generation, simplex until a new secondary is in sync. The caller
    made sure the old primary can no longer act (killed, or demoted: ``attach`` it to the new one).

    Before it answers as a primary, still a replica (writable for the moment), it gets its generation and mode,
    and every live member's lease runs for grace_ms again: the members could not renew their leases while the old
    primary was failing (a hung one holds them for the controller's whole lease), and a copy whose leases ran out
    meanwhile made the members fence each other the moment it was promoted. A member that died meanwhile is
    recovered one grace later."""
    secondary.config_set("replica-read-only", "no")
    try:
        set_mode(secondary, SIMPLEX, gen=gen)
        epochs = {keys.text(k): v for k, v in secondary.hgetall(keys.epochs()).items()}
        for member in (keys.text(m) for m in secondary.hkeys(keys.members())):
            if member in epochs:
                secondary.set(keys.lease(member), epochs[member], px=grace_ms)
        secondary.execute_command("REPLICAOF", "NO", "ONE")
    finally:
        secondary.config_set("replica-read-only", "yes")


__all__ = ["CONTROL_USER", "DUPLEX", "REPLICA_USER", "SIMPLEX", "acl_lines", "attach", "control_client",
           "in_sync", "passwords", "promote", "replication", "set_mode", "state"]
