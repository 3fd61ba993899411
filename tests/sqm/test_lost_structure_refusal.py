"""A put to a queue whose structure the CF lost is refused as MQRC_CF_STRUC_FAILED, and the refusal says what
brings the structure back as the group repository defines it: RECAUTO when it is on for the structure, the
operator's restore when it is off."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import StructureFailedError
from tests.support.group import start_qm
from tests.support.harness import lose_cf


def test_the_refusal_names_recauto_only_where_it_is_on(redis_url: str, tmp_path: Path) -> None:
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, tmp_path / "logs", who="test")
    repository.ensure_structure(admin, repo, "AUTO1", ("QA",), recauto=True)
    repository.ensure_structure(admin, repo, "MANUAL1", ("QM",), recauto=False)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        lose_cf(client)  # the CF came back empty: the repository still defines both
        conn = qm.connect()
        with pytest.raises(StructureFailedError) as auto:
            conn.put("QA", b"x", syncpoint=False)
        assert "RECAUTO will restore it" in str(auto.value)
        with pytest.raises(StructureFailedError) as manual:
            conn.put("QM", b"x", syncpoint=False)
        text = str(manual.value)
        assert "RECAUTO is off" in text and "cfrestore run MANUAL1" in text
        assert "recovered automatically" not in text and "RECAUTO will" not in text
    finally:
        qm.stop()
        client.close()
