"""A manifest that parses as JSON but is not of the format's shape (edited by hand, or damaged into other valid JSON)
is a LogFormatError naming the file and the field, for the writer and every reader alike, and ``sqm log print``
says so in one line; before, a KeyError, TypeError or AttributeError from deep inside a reader was all there was."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sqm.cli import main
from sqm.log import LogFormatError, LogReader, RecordLog
from sqm.log.format import MANIFEST_NAME

Edit = Callable[[dict[str, Any]], None]

EDITS: dict[str, tuple[Edit, str]] = {
    "a copy without its path": (lambda m: m.update(copies=[{"segment": 1}]), "an entry of 'copies'"),
    "a checkpoint without its position": (lambda m: m.update(checkpoints=[{"lrsn": 3}]), "an entry of 'checkpoints'"),
    "segments not a list": (lambda m: m.update(segments="x"), "'segments' must be a list"),
    "a segment entry not a map": (lambda m: m.update(segments=[7]), "an entry of 'segments'"),
    "an archived entry without its path": (lambda m: m.update(archived=[dict(m["segments"][0])]),
                                           "an entry of 'archived'"),
    "a position of three numbers": (lambda m: m["checkpoints"][0].update(position=[1, 2, 3]),
                                    "an entry of 'checkpoints'"),
    "pruned not a number": (lambda m: m.update(pruned="x"), "'pruned' must be a whole number"),
    "member not a name": (lambda m: m.update(member=["QM1"]), "'member' must be a member name"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_malformed_manifest_is_named_in_one_line(tmp_path: Path, edit: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        for i in range(30):
            log.append_forced({"k": "PUT", "l": i, "d": b"x" * 60})
        log.checkpoint({"k": "CHECKPOINT", "l": 100, "uows": {}, "n": 30, "why": "start"})
    path = d / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change, what = EDITS[edit]
    change(manifest)
    path.write_text(json.dumps(manifest))
    for act in (lambda: list(LogReader(d).records()), lambda: LogReader(d).segments(),
                lambda: LogReader(d).last_checkpoint(), lambda: RecordLog(d, "QM1", segment_bytes=1024)):
        with pytest.raises(LogFormatError) as caught:
            act()
        assert str(path) in str(caught.value) and what in str(caught.value)
    rc = main(["log", "print", "--member", "QM1", "--log-root", str(tmp_path)])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and what in err
