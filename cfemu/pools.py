"""The bounded connection pool of a client of the CF: one server's (cfemu.connection) and each master's of a Redis
Cluster CF (cfemu.rcluster). Callers wait for a free connection; a wait that times out is PoolExhaustedError, a
local limit, never read as a lost CF."""

from __future__ import annotations

import contextlib
from queue import Empty, Full, LifoQueue
from typing import Any

import redis

from cfemu.redis_internals import check_pid, in_maintenance

__all__ = ["PoolExhaustedError", "WaitingPool"]


class PoolExhaustedError(redis.exceptions.RedisError):
    """Every connection of the pool stayed busy for the pool timeout: a local limit, not a failed CF (so it is
    deliberately not a redis ConnectionError, which callers read as "the CF is down")."""


class WaitingPool(redis.BlockingConnectionPool):
    """A bounded pool whose callers wait for a free connection, and whose wait timing out says so.

    Taking and giving back a connection is what redis-py's BlockingConnectionPool does (a LIFO queue of
    connections, None for one not made yet; a connection with unread data is reconnected) without its
    observability records, which cost more CPU than the rest of a CF call's client side (BENCHMARKS.md, "Where the
    time goes: one lifecycle through the service"); in the modes this project never uses (client-side caching,
    maintenance notifications) redis-py's own methods run."""

    def _lean(self) -> bool:
        return (getattr(self, "cache", None) is None and not in_maintenance(self)
                and isinstance(getattr(self, "pool", None), LifoQueue))

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not self._lean():
            try:
                return super().get_connection(*args, **kwargs)
            except redis.exceptions.ConnectionError as e:
                if str(e) != "No connection available.":  # redis-py's only word for "the pool is empty"
                    raise
                raise self._exhausted() from None
        check_pid(self)
        try:
            connection = self.pool.get(block=True, timeout=self.timeout)
        except Empty:
            raise self._exhausted() from None
        if connection is None:
            connection = self.make_connection()
        try:
            connection.connect()
            try:
                if connection.can_read():
                    raise redis.exceptions.ConnectionError("Connection has data")
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                connection.disconnect()
                connection.connect()
                if connection.can_read():
                    raise redis.exceptions.ConnectionError("Connection not ready") from None
        except BaseException:
            self.release(connection)
            raise
        return connection

    def release(self, connection: Any) -> None:
        if not self._lean():
            super().release(connection)
            return
        check_pid(self)
        if not self.owns_connection(connection):
            connection.disconnect()
            self.pool.put_nowait(None)
            return
        if connection.should_reconnect():
            connection.disconnect()
        with contextlib.suppress(Full):
            self.pool.put_nowait(connection)

    def _exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(f"all {self.max_connections} connections to the CF stayed busy for "
                                  f"{self.timeout:g}s")
