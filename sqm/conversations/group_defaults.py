"""The group's defaults for its services' STORE, MAX-UOWS and UWSTATP (cfemu.uow_attributes.UowDefaults, set by
``cfemu define uow-defaults``; docs/uow.md, "Defaults") as a member reads them: the CF's, else the group
repository's (the CF lost them with everything else, and no member has written them back yet), else the built-in
ones. Read at most once a second per member (every send and receive resolves its service's attributes), so a
change reaches every member within about a second."""

from __future__ import annotations

import time

from cfemu.errors import MQError
from cfemu.uow_attributes import UowDefaults
from sqm.core.member import Member

CACHE_S = 1.0
_KEY = "conversations.group-defaults"  # in the queue manager's hooks.state: (read at, defaults)


def group_defaults(qm: Member) -> UowDefaults:
    found = qm.hooks.state.get(_KEY)
    now = time.monotonic()
    last = found[1] if isinstance(found, tuple) else None
    if last is not None and now - found[0] < CACHE_S:  # type: ignore[index]
        return last
    try:
        defaults = qm.cf_call(qm.admin.uow_defaults)
    except MQError:
        if last is None:
            raise
        return last  # the CF is away: the ones read last (what needs the CF fails on its own)
    if defaults is None and qm.repository is not None:
        defaults = qm.repository.uow_defaults()
    defaults = defaults or UowDefaults()
    qm.hooks.state[_KEY] = (now, defaults)
    return defaults


__all__ = ["CACHE_S", "group_defaults"]
