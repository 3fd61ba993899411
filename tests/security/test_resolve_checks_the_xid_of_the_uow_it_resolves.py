"""An application's resolve is checked against the xid of the unit of work the queue manager finds in doubt.

The service checked the xid against a list of in-doubt UOWs it read first, and let the request through when the UOW
was not in that list: a UOW prepared between that look and the resolve (its id is predictable, QM.<epoch>.<seq>)
was resolved for whoever guessed it. The interleaving is forced here on a real queue manager and CF: the victim
prepares while the service looks, if it looks.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cfemu.errors import BadRequestError
from sqm.service import queue_ops
from sqm.service.protocol import NotAuthorizedError
from tests.support.group import define_group, start_qm


def test_a_uow_prepared_while_the_service_looks_is_not_resolved_with_a_wrong_xid(
        redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1")
    try:
        victim = qm.connect()
        victim.put("Q1", b"alice's transfer", syncpoint=True)
        prepared: list[str] = []
        real_indoubt = qm.indoubt

        def look_while_the_victim_prepares() -> Any:
            seen = real_indoubt()
            t = threading.Thread(target=lambda: prepared.append(victim.prepare("alice-xid")))
            t.start()
            t.join()
            return seen

        qm.indoubt = look_while_the_victim_prepares  # type: ignore[method-assign]
        svc = SimpleNamespace(qm=qm)
        app = SimpleNamespace(role="application")
        assert victim.uow is not None
        uow_id = victim.uow.id
        try:
            queue_ops.resolve(svc, app, {"uow": uow_id, "commit": True, "xid": "a-guess"})  # type: ignore[arg-type]
        except (NotAuthorizedError, BadRequestError):
            pass  # refused, or not in doubt yet when the queue manager looked
        finally:
            qm.indoubt = real_indoubt  # type: ignore[method-assign]
        if not prepared:  # the service did not look: the victim prepares now, and the guess is refused
            prepared.append(victim.prepare("alice-xid"))
            with pytest.raises(NotAuthorizedError, match="not prepared with that xid"):
                queue_ops.resolve(svc, app, {"uow": uow_id, "commit": True, "xid": "a-guess"})  # type: ignore[arg-type]
        assert prepared == [uow_id]
        assert [u.id for u in qm.indoubt()] == [uow_id], "a wrong xid resolved someone else's unit of work"
        queue_ops.resolve(svc, app, {"uow": uow_id, "commit": False, "xid": "alice-xid"})  # type: ignore[arg-type]
        assert qm.indoubt() == []
    finally:
        qm.stop()
