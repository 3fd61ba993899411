"""One record of each kind in sqm.core.records.KINDS, built with its constructor, beside the map it must be on disk (the
short keys and values old logs hold). Adding a kind means adding its sample here: tests/sqm/test_records.py fails
until there is one."""

from __future__ import annotations

from cfemu.entry import Entry
from sqm.core import records
from sqm.core.records import Record

SS = {"APP1": 3, "APP2": 1}
ENTRY = Entry(id="e1", queue="Q1", priority=4).wire()
GOT = Entry(id="e2", queue="Q2", state="UG", uow="QM1.1.2", lrsn=30).wire()
CARRIED = [["APP1", GOT, b"got"]]
UOWS = {"QM1.1.3": {"st": "INDOUBT", "ss": {"APP1": 3}, "x": "xid-1", "dl": 0, "p": True}}

# kind -> (built by its constructor, the map on disk)
PASSES = {"APP1": {"cpl": [[5, 6], [70, 75]], "gen": 3, "w": 6, "b": 78, "e": 80, "held": []}}
RELOGGED = {**ENTRY, "st": "UG", "u": "QM1.1.2", "l": 30, "o1": 12, "o2": 10}
SAMPLES: dict[str, tuple[Record, Record]] = {
    "PUT": (records.put("QM1.1.1", 10, structure="APP1", gen=3, entry=ENTRY, data=b"body"),
            {"k": "PUT", "l": 10, "u": "QM1.1.1", "s": "APP1", "g": 3, "e": ENTRY, "d": b"body"}),
    "GET": (records.get("QM1.1.2", 30, structure="APP1", gen=3, entry_id="e2", queue="Q2"),
            {"k": "GET", "l": 30, "u": "QM1.1.2", "s": "APP1", "g": 3, "i": "e2", "q": "Q2"}),
    "PREPARE": (records.prepare("QM1.1.3", 40, SS, xid="xid-1"),
                {"k": "PREPARE", "l": 40, "u": "QM1.1.3", "x": "xid-1", "ss": SS}),
    "COMMIT": (records.commit("QM1.1.1", 20, SS),
               {"k": "COMMIT", "l": 20, "u": "QM1.1.1", "ss": SS}),
    "BACKOUT": (records.backout("QM1.1.2", 50, SS, reason="restart", data=CARRIED),
                {"k": "BACKOUT", "l": 50, "u": "QM1.1.2", "ss": SS, "r": "restart", "dd": CARRIED}),
    "RECOVERY": (records.recovery("QM2.1.7", 60, SS, commit=False, of="QM2", by="QM1", data=CARRIED, at=45),
                 {"k": "RECOVERY", "l": 60, "u": "QM2.1.7", "ss": SS, "o": "B", "of": "QM2", "by": "QM1",
                  "at": 45, "dd": CARRIED}),
    "END": (records.end("QM1.1.1", 25),
            {"k": "END", "l": 25, "u": "QM1.1.1"}),
    "EXPIRE": (records.expire(70, structure="APP1", ids=["e3", "e4"]),
               {"k": "EXPIRE", "l": 70, "s": "APP1", "ids": ["e3", "e4"]}),
    "CHECKPOINT": (records.checkpoint(80, uows=UOWS, n=12, why="logload", passes=PASSES),
                   {"k": "CHECKPOINT", "l": 80, "uows": UOWS, "n": 12, "why": "logload", "rl": PASSES}),
    "BACKUP": (records.backup(95, structure="APP1", backup_id="b-1", gen=3, replay_from=40, floor=41, end=94),
               {"k": "BACKUP", "l": 95, "s": "APP1", "b": "b-1", "g": 3, "rf": 40, "fl": 41, "el": 94}),
    "RELOG": (records.relog(90, structure="APP1", gen=3, entry=RELOGGED, data=b"body"),
              {"k": "RELOG", "l": 90, "s": "APP1", "g": 3, "e": RELOGGED, "d": b"body"}),
}
