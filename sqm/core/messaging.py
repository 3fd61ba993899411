"""The messaging API every application handle shares (MQI's put, get, browse and syncpoint).

Two classes have it: sqm.core.connection.Connection (in process, on a QueueManager) and sqm.service.client.Client
(through ``sqm run``). ``Messaging`` is the declared type code can take to work with either; ``UnitOfWorkScope``
gives both the one ``unit_of_work()`` context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, Self

from cfemu.errors import MQError


class Messaging(Protocol):
    """What an application does with a handle: put, get, browse, commit, backout, close."""

    def put(self, queue: str, body: bytes, *, persistent: bool = ..., syncpoint: bool = ..., priority: int = ...,
            msgid: bytes | None = ..., correlid: bytes = ..., expiry_ms: int = ...,
            properties: dict[str, Any] | None = ...) -> Any: ...

    def get(self, queue: str, *, syncpoint: bool = ..., wait_ms: int = ..., msgid: bytes | None = ...,
            correlid: bytes | None = ...) -> Any: ...

    def browse(self, queue: str, limit: int = ...) -> list[Any]: ...

    def commit(self) -> None: ...

    def backout(self) -> None: ...

    def close(self) -> None: ...


class UnitOfWorkScope:
    """``with handle.unit_of_work(): ...`` commits on success and backs out on an exception."""

    def commit(self) -> None:
        raise NotImplementedError

    def backout(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def unit_of_work(self) -> Iterator[Self]:
        try:
            yield self
        except BaseException:
            with contextlib.suppress(MQError):
                self.backout()
            raise
        self.commit()
