"""The bounded connection pool of a client of the CF: one server's (cfemu.connection) and each master's of a Redis
Cluster CF (cfemu.rcluster). Callers wait for a free connection; a wait that times out is PoolExhaustedError, a
local limit, never read as a lost CF."""

from __future__ import annotations

import time
from queue import Empty, Full, LifoQueue
from typing import Any

import redis

from cfemu.redis_internals import check_pid, idle_and_clean, in_maintenance, socket_of

__all__ = ["FreeConnections", "PoolExhaustedError", "WaitingPool"]


class FreeConnections(LifoQueue):
    """The pool's free connections, last in first out: a ``LifoQueue`` whose take and give back are a list's pop
    and append (atomic under the GIL) while connections are free, with its condition taken only by a caller that
    has to wait and by whoever gives one back while somebody does. A CF call takes and gives back a connection
    every time, and the queue's condition (its lock, its waiters, its notify) was a dozen Python calls of each
    (BENCHMARKS.md, "peers", seventh look).

    No give-back is lost: a waiter counts itself in ``_sleepers`` (holding the condition's lock) before it looks
    at the list, and a giver looks at ``_sleepers`` after it appended, taking the lock to notify when it is
    non-zero; so either the waiter's look finds the connection or the giver's notify finds the waiter waiting."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._sleepers = 0

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return self.queue.pop()
        except IndexError:
            if not block:
                raise Empty from None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.not_empty:
            self._sleepers += 1
            try:
                while True:
                    try:
                        return self.queue.pop()
                    except IndexError:
                        pass
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise Empty
                    self.not_empty.wait(remaining)
            finally:
                self._sleepers -= 1

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        # Never more items than the pool's size exist (a connection or a None for one not made), so a full queue
        # is a caller's mistake to report, not a state to wait out.
        if 0 < self.maxsize <= len(self.queue):
            raise Full
        self.queue.append(item)
        if self._sleepers:
            with self.not_empty:
                self.not_empty.notify()

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def qsize(self) -> int:
        return len(self.queue)

    def empty(self) -> bool:
        return not self.queue

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.queue)


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("queue_class", FreeConnections)
        super().__init__(*args, **kwargs)

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
            if socket_of(connection) is not None and idle_and_clean(connection):
                return connection  # connected, nothing unread, not closed by the server: redis-py's checks pass
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
        try:  # not contextlib.suppress: its object and two calls, at every CF call
            self.pool.put_nowait(connection)
        except Full:
            pass

    def _exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(f"all {self.max_connections} connections to the CF stayed busy for "
                                  f"{self.timeout:g}s")
