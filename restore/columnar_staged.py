"""The columnar plan's survivors as the load's prepared batches, made in C (cfemu.bulk.prepare_columns) from the
rows of the plan's survivors query: each base descriptor's bytes and data (read back by restore.columns.Pieces),
the fold's mask and the fields it sets, whether the copy is a backup's. Decoding every descriptor into a dict, a
Settled made of it (restore.engine_columnar's survivors), and then bulk.prepare packing each one again had been the
load's preparing thread's CPU (BENCHMARKS.md, "A load prepared in C").

The batches are those of restore.load.staged, cut by the same rule (restore.load.batches: `batch` entries, or fewer
once their data reach `batch_bytes`) and byte for byte the same Staged. A batch the C path does not take exactly (a
control entry, whose data the pseudo-clock floor reads and which the restart tables may have ruled on; a
descriptor or a value prepare would convert, refuse or decode otherwise: cfemu/_bulk.c lists them) is read as the
Python path reads it (the plan's survivors, PseudoClockFloor, bulk.prepare), so its errors and edge cases stay as
they are."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cfemu import bulk
from cfemu.uow_attributes import CONTROL_SUFFIX
from restore.columns import Pieces
from restore.load import PseudoClockFloor
from restore.settle import Settled

# A batch of the survivors query's rows read as Settled entries (the Python path: restore.engine_columnar).
Survivors = Callable[[pa.RecordBatch, Pieces], list[Settled]]
PLACES = ("f", "boff", "blen", "doff", "dlen")  # where a row's base descriptor and data are (Pieces.read)


class _Pending:
    """The rows read and not yet in a batch: as the C path's columns, and as the record batches they came from
    (a batch that goes to Python is read again from those)."""

    def __init__(self, fields: Sequence[tuple[str, int]]) -> None:
        if dict(fields) != {name: 1 << j for j, name in enumerate(bulk.OVERRIDES)}:
            raise ValueError(f"the fold's fields {fields} are not those cfemu.bulk.OVERRIDES names")
        self.ids: list[str] = []
        self.descs: list[bytes] = []
        self.datas: list[bytes] = []
        self.masks: list[int] = []
        self.backup: list[bool] = []
        self.overrides: list[list[Any]] = [[] for _ in bulk.OVERRIDES]
        self.rows: list[pa.RecordBatch] = []
        self.ruled: list[int] = []  # the control entries' places among the rows (ascending)

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, rows: pa.RecordBatch, pieces: Pieces) -> None:
        n = len(rows)
        descs, datas = pieces.read(*(rows.column(k) for k in PLACES))
        ruled = rows.column("blob")
        if ruled.null_count < n:  # a control entry as the restart tables keep it: its batch goes to Python
            data = rows.column("data")
            for k in pc.indices_nonzero(pc.is_valid(ruled)).to_pylist():
                datas[k] = data[k].as_py()  # the data its batch is cut by
                self.ruled.append(len(self) + k)
        masks = rows.column("mask")
        needed = 0
        for m in pc.unique(masks).to_pylist():
            needed |= m or 0
        self.ids += rows.column("eid").to_pylist()
        self.descs += descs
        self.datas += datas
        self.masks += masks.to_pylist()
        self.backup += pc.equal(rows.column("src"), "B").to_pylist()
        for j, name in enumerate(bulk.OVERRIDES):
            self.overrides[j] += rows.column(name).to_pylist() if needed & (1 << j) else [None] * n
        self.rows.append(rows)

    def ruled_before(self, end: int) -> bool:
        """Whether a control entry is among the first `end` rows."""
        return bool(self.ruled) and self.ruled[0] < end

    def take(self, end: int) -> list[pa.RecordBatch]:
        """Drop the first `end` rows: returns the record batches they were."""
        self.ruled = [k - end for k in self.ruled if k >= end]
        columns: list[list[Any]] = [self.ids, self.descs, self.datas, self.masks, self.backup, *self.overrides]
        for column in columns:
            del column[:end]
        taken: list[pa.RecordBatch] = []
        left = end
        while left:
            rows = self.rows[0]
            if len(rows) <= left:
                taken.append(self.rows.pop(0))
                left -= len(rows)
            else:
                taken.append(rows.slice(0, left))
                self.rows[0] = rows.slice(left)
                left = 0
        return taken


def staged(structure: str, rows: Iterable[pa.RecordBatch], pieces: Pieces, survivors: Survivors,
           fields: Sequence[tuple[str, int]], batch: int, batch_bytes: int = 0) -> Iterator[tuple[bulk.Staged, int]]:
    """restore.load.staged of the survivors query's `rows` (in load order): each batch prepared, with the
    pseudo-clock floor of the batches so far. fields: the fold's (name, mask bit) (bulk.OVERRIDES' order)."""
    clock = PseudoClockFloor()
    pending = _Pending(fields)

    def stage(end: int) -> bulk.Staged:
        st = None if pending.ruled_before(end) else bulk.prepare_columns(
            structure, pending.ids, pending.descs, pending.datas, pending.masks, pending.backup, pending.overrides,
            0, end, aside_suffix=CONTROL_SUFFIX)
        taken = pending.take(end)
        if st is None:
            chunk = [s for part in taken for s in survivors(part, pieces)]
            st = bulk.prepare(structure, list(clock.watch(chunk)))
        return st

    for part in rows:
        pending.add(part, pieces)
        while (end := bulk.batch_end(pending.datas, 0, batch, batch_bytes)) > 0:
            yield stage(end), clock.floor
    if pending:
        yield stage(len(pending)), clock.floor
