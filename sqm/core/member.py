"""What the helpers of a queue manager use of it, as narrow protocols instead of the whole QueueManager.

``Member`` is what a feature (sqm.conversations, sqm.pubsub) and RECAUTO (sqm.core.recauto) use: the member's
identity and settings, the group's definitions, CF calls, the application's handle, and the hooks it plugs into.
``LogUser`` is what relogging and log retention use; ``RecoveringMember`` is what restart and peer recovery use
(both, and the completion of units of work). sqm.core.manager.QueueManager is all three. A helper changes the
queue manager's state only through its methods (log_failure, complete, apply, checkpoint), never a private name."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol

from cfemu.admin import Admin
from cfemu.cf import Structure
from cfemu.repository import GroupRepository
from sqm.core.config import QueueManagerConfig
from sqm.core.connection import Connection, MemberWork, QueueManagerPort
from sqm.core.hooks import Hooks
from sqm.core.uow import UnitOfWork
from sqm.log import RecordLog


class MemberIdentity(Protocol):
    """Who the member is: its name, its settings, and the group's definitions."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> QueueManagerConfig: ...
    @property
    def admin(self) -> Admin: ...


class LogUser(MemberIdentity, MemberWork, Protocol):
    """What relogging (sqm.core.relog) and log retention (sqm.core.retention) use: the member's log, its clock and
    its UOW table, and the CF."""

    @property
    def log(self) -> RecordLog | None: ...
    @property
    def uow_lock(self) -> AbstractContextManager[Any]: ...
    @property
    def log_reserve(self) -> int: ...

    def log_failure(self, e: OSError) -> NoReturn: ...
    def cf_call(self, fn: Callable[[], Any]) -> Any: ...
    def structure(self, name: str) -> Structure: ...


class Member(MemberIdentity, QueueManagerPort, Protocol):
    """What a feature (a wing) and RECAUTO use: what a connection runs on (a wing makes its own connections), the
    member's identity and settings, the group's definitions, its UOW table (read), and the hooks it plugs into."""

    @property
    def repository(self) -> GroupRepository | None: ...
    @property
    def hooks(self) -> Hooks: ...

    def connect(self) -> Connection: ...


class RecoveringMember(Member, LogUser, Protocol):
    """What restart and peer recovery (sqm.core.recovery) use."""

    backups_noted: dict[str, dict[str, Any]]  # sqm.core.backupnote: restart seeds it from the log
    backups_checked_at: float
    relog_passes: dict[str, dict[str, Any]]  # carried from the last checkpoint (sqm.core.relog.last_passes)

    @property
    def pending(self) -> dict[str, Callable[[], None]]: ...
    @property
    def fenced(self) -> bool: ...

    def append(self, record: dict[str, Any], *, uow: UnitOfWork | None = None, state: str | None = None) -> None: ...
    def apply(self, uow: UnitOfWork, commit: bool, *, for_member: str | None = None) -> None: ...
    def checkpoint(self, why: str) -> None: ...
    def manage_log(self) -> object: ...


__all__ = ["LogUser", "Member", "MemberIdentity", "RecoveringMember"]
