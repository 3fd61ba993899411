"""The CF spread over a Redis Cluster (CF scale-out): one structure = one hash tag {S} = one slot, on one master.

A cluster CF is named by a URL of scheme ``redis+cluster`` (``rediss+cluster`` for TLS)::

    redis+cluster://[user:password@]HOST:PORT[/?node=HOST2:PORT2&node=HOST3:PORT3]

The first address and every ``node`` are seeds: any one that answers gives the client the whole slot map, so the
extra seeds only matter when the first is down. ``cfemu.connection.connect`` hands such a URL to ``connect_cluster``,
which returns a ``CFCluster``: redis-py's RedisCluster, which sends each command, script and single-slot transaction
to the master of its slot (every script of this project touches the keys of one hash tag only: tests check it).

What must go to one server, not "the cluster", asks ``node_client(client, structure)``: the redis.Redis of the
master that holds the structure's slot now (a plain client gives itself back). That is restore's claim and guarded
writes (cfemu.bulk: WATCH/MULTI, the CF's identity is that master's INFO run_id, its SCAN of the structure's keys)
-- so a failover or a master restarted empty is "the CF was replaced" for the structures of that master only.

Errors: a cluster that cannot serve a slot now (CLUSTERDOWN, a slot no master covers, no seed reachable) is
``ClusterUnavailableError``, a redis ConnectionError, which every caller already reads as "the CF is down" (the
command was not run: it is not a lost reply). redis-py's own retries are off, as for a single server: a CF script
is never sent twice by the client (cfemu.connection).
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from cfemu import keys
from cfemu.pools import WaitingPool

__all__ = ["SCHEMES", "CFCluster", "ClusterUnavailableError", "connect_cluster", "is_cluster", "master_of",
           "node_client", "slot_of"]

SCHEMES = ("redis+cluster", "rediss+cluster")


class ClusterUnavailableError(redis.exceptions.ConnectionError):
    """The cluster cannot serve the slot now (failover under way, a master down and no replica, no seed answers).
    Nothing was run."""


class CFCluster(RedisCluster):
    """RedisCluster whose "cluster cannot serve this now" errors are ConnectionErrors (the CF is down, for now)."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return super().execute_command(*args, **kwargs)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                # A master that could not be connected to was sent nothing, and redis-py has just read the slot map
                # again: after a failover the slot has a new master, so the command goes there, once. Any other
                # connection error may have lost a reply: never resent (cfemu.connection).
                if "connecting to" not in str(e).lower() or "target_nodes" in kwargs:
                    raise
                return super().execute_command(*args, **kwargs)
        except redis.exceptions.ClusterDownError as e:
            raise ClusterUnavailableError(f"the CF cluster cannot serve the slot now: {e}") from None
        except redis.exceptions.SlotNotCoveredError as e:
            raise ClusterUnavailableError(f"the CF cluster has no master for the slot now: {e}") from None
        except redis.exceptions.RedisClusterException as e:
            text = str(e)
            if "connect" in text.lower() or "covered" in text.lower():
                raise ClusterUnavailableError(f"the CF cluster is not reachable: {text}") from None
            raise


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


def seeds(url: str) -> list[ClusterNode]:
    """The cluster URL's addresses (its own and each ``node``); ValueError naming a bad one."""
    parts = urlsplit(url)
    try:
        nodes = [ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379)]
        for extra in parse_qs(parts.query).get("node", []):
            host, _, port = extra.rpartition(":")
            nodes.append(ClusterNode(host or "127.0.0.1", int(port)))
    except ValueError as e:
        raise ValueError(f"bad address in the cluster URL: {e}") from None
    return nodes


def connect_cluster(url: str, *, opts: dict[str, Any], max_connections: int | None = None,
                    pool_timeout: float = 30.0) -> redis.Redis:
    """A CFCluster for a ``redis+cluster://`` URL. opts: what cfemu.connection.connect gives a single server's
    client (timeouts, TLS files, decode_responses); ``retry`` is replaced by the cluster's own (no retries).

    Typed as redis.Redis, which it is not: it answers every command the house sends through a client (the
    commands, scripts, pipelines and single-slot transactions route by key); what needs one server asks
    node_client(). Callers need not know which CF they have."""
    parts = urlsplit(url)
    kw = {k: v for k, v in opts.items() if k not in ("retry", "health_check_interval")}
    if parts.username:
        kw["username"] = unquote(parts.username)
    if parts.password:
        kw["password"] = unquote(parts.password)
    if parts.scheme == "rediss+cluster":
        kw["ssl"] = True
    if max_connections is not None:  # each master's pool: callers wait for a free connection, as on one server

        class _NodePool(WaitingPool):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(timeout=pool_timeout, **kwargs)

        kw.update(connection_pool_class=_NodePool, max_connections=max_connections)
    client = CFCluster(startup_nodes=seeds(url), retry=Retry(NoBackoff(), 0), require_full_coverage=False,
                       dynamic_startup_nodes=True, **kw)
    return cast(redis.Redis, client)


def slot_of(structure: str) -> int:
    """The cluster slot of a structure (all its keys share the hash tag {S})."""
    return int(key_slot(keys.meta(structure).encode()))


def master_of(client: redis.Redis, structure: str) -> str:
    """"host:port" of the master that holds the structure's slot (the client's current map)."""
    if not is_cluster(client):
        kw = client.connection_pool.connection_kwargs
        return f"{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}"
    node = cast(RedisCluster, client).get_node_from_key(keys.meta(structure))
    return str(node.name)


def refresh(client: redis.Redis) -> None:
    """Read the slot map again (after a failover or a master's restart)."""
    if is_cluster(client):
        cast(RedisCluster, client).nodes_manager.initialize()


def node_client(client: redis.Redis, structure: str, *, fresh: bool = True) -> redis.Redis:
    """The redis.Redis of the one server that holds the structure: the client itself for a single server; for a
    cluster, the master of the structure's slot (fresh: read the slot map first, so that a restore after a
    failover claims the structure on the master that holds it now)."""
    if not is_cluster(client):
        return client
    rc = cast(RedisCluster, client)
    if fresh:
        rc.nodes_manager.initialize()
    node = rc.get_node_from_key(keys.meta(structure))
    return rc.get_redis_connection(node)


def master_run_ids(client: redis.Redis) -> list[str]:
    """The INFO run_id of every master the client's slot map names."""
    rc = cast(RedisCluster, client)
    rc.nodes_manager.initialize()
    return [str(rc.get_redis_connection(n).info("server")["run_id"]) for n in rc.get_primaries()]

