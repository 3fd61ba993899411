"""Every kind of log record, registered in one table (like PostgreSQL's resource managers).

Each kind names its fields, whether it is forced (write-ahead: it decides an outcome), what it means for restart
(the UOW state it leaves behind), what it means for restore (an event on one entry, or an outcome of a UOW), and
how the log printer describes it. Records are msgpack maps with short keys:

  k kind   l LRSN   u UOW id   s structure   g structure generation   ss {structure: generation}
  e entry descriptor (cfemu.entry wire form)   d data
  i entry id   q queue   x XA transaction id   dd [[structure, descriptor, data], ...]   r reason
  o outcome 'C' | 'B'   of member whose UOW a recovery record decides   by who decided
  (m is not a record field: the merged log adds it, naming the log a record came from)   ids entry ids
  uows {uow: {st, ss, x}} (checkpoint)   n activity count
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]

# UOW states (seed 000 / seed 002): in-flight, in-doubt, in-commit, in-backout, complete.
INFLIGHT, INDOUBT, INCOMMIT, INBACKOUT, DONE = "INFLIGHT", "INDOUBT", "INCOMMIT", "INBACKOUT", "DONE"


@dataclass(frozen=True)
class RecordKind:
    code: str
    forced: bool  # forced to disk before the operation goes on (write-ahead)
    restore_role: str  # 'entry' (an event on entries), 'outcome' (a UOW's outcome), or 'none'
    uow_state: str | None  # the UOW state the record leaves for restart, None when it names no UOW state
    describe: Callable[[Record], str]


def _entry_desc(r: Record) -> str:
    e = r["e"]
    return (f"put {e['id']} on {r['s']}/{e['q']} prio {e['p']} {len(r.get('d', b''))}B"
            + (f" uow {r['u']}" if r.get("u") else ""))


def _data_note(r: Record) -> str:
    return f", carries data of {len(r['dd'])} gets" if r.get("dd") else ""


KINDS: dict[str, RecordKind] = {k.code: k for k in [
    RecordKind("PUT", False, "entry", INFLIGHT, _entry_desc),
    RecordKind("GET", False, "entry", INFLIGHT,
               lambda r: f"get {r['i']} from {r['s']}/{r['q']} uow {r['u']}"),
    RecordKind("PREPARE", True, "outcome", INDOUBT,
               lambda r: f"prepare uow {r['u']} xid {r.get('x', '')} (in doubt)"),
    RecordKind("COMMIT", True, "outcome", INCOMMIT,
               lambda r: f"commit uow {r['u']} on {', '.join(r.get('ss', {})) or '-'}"),
    RecordKind("BACKOUT", True, "outcome", INBACKOUT,
               lambda r: f"backout uow {r['u']} ({r.get('r', 'application')}){_data_note(r)}"),
    RecordKind("RECOVERY", True, "outcome", None,
               lambda r: (f"{'commit' if r['o'] == 'C' else 'backout'} of {r['of']}'s uow {r['u']} "
                          f"decided by {r['by']}{_data_note(r)}")),
    RecordKind("END", False, "none", DONE, lambda r: f"uow {r['u']} complete on the CF"),
    RecordKind("EXPIRE", False, "entry", None,
               lambda r: f"expired {len(r['ids'])} messages on {r['s']}"),
    RecordKind("CHECKPOINT", True, "none", None,
               lambda r: f"checkpoint: {len(r.get('uows', {}))} active UOWs, activity {r.get('n', 0)}"
                         + (f" ({r['why']})" if r.get("why") else "")),
]}


class UnknownRecordError(ValueError):
    pass


def kind_of(record: Record) -> RecordKind:
    try:
        return KINDS[record["k"]]
    except KeyError:
        raise UnknownRecordError(f"unknown log record kind {record.get('k')!r} at LRSN {record.get('l')}") from None


def describe(record: Record) -> str:
    return kind_of(record).describe(record)


def entry_ids(record: Record) -> list[str]:
    """The entries a record is about (for filters and for restore's grouping by entry)."""
    k = record["k"]
    if k == "PUT":
        return [record["e"]["id"]]
    if k == "GET":
        return [record["i"]]
    if k == "EXPIRE":
        return list(record["ids"])
    if record.get("dd"):
        return [d[1]["id"] for d in record["dd"]]
    return []


def queues_of(record: Record) -> list[str]:
    k = record["k"]
    if k == "PUT":
        return [record["e"]["q"]]
    if k == "GET":
        return [record["q"]]
    return [d[1]["q"] for d in record.get("dd", [])]
