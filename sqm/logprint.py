"""``sqm log print``: the log printer (one member's record log, or the merged log of every member).

    sqm log print --member QM1 [--log-root DIR]
    sqm log print --all --queue Q1 --from-lrsn N --to-lrsn M
    sqm log print --all --message ENTRY_ID_OR_MSGID_HEX --json
    sqm log print --member QM2 --uow QM2.18f3a.7 --kind COMMIT,BACKOUT

--queue and --message select the records about that queue or message and, with them, the outcome records
(COMMIT, BACKOUT, END, PREPARE, RECOVERY) of the UOWs those records belong to, so the output tells what became of
the message. Output is a table (plain when stdout is not a terminal) or, with --json, one JSON object per line
(bytes as hex). The logs are read only: a member may be running and appending meanwhile.

The log root is found as by every command (cfemu.settings): --log-root, $CFEMU_LOG_ROOT, the nearest
'cfemu cluster' directory's, else var/logs. sqm.cli wires the verb: add_log_parser(subparsers) adds ``log print``,
cmd_log(args, out) runs it (through cfemu.clitools.run_command: errors are one line, exit status 2).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfemu.clitools import Output, add_settings_arguments, cf_name, settings, styled_table, whole
from cfemu.settings import ENV_LOG_ROOT
from sqm.core.records import KINDS, Record, Role, UnknownRecordError, describe, entry_ids, lookup, queues_of
from sqm.log import LogCorruptError, LogFormatError, LogReader, find_log_dirs, merged_records

# An LRSN is a count of microseconds (sqm.core.clock), written as an unsigned 64-bit msgpack integer at most.
MAX_LRSN = 2**64 - 1
LRSN = whole(0, MAX_LRSN)


class LogPrintError(Exception):
    """Bad input to the log printer: a one-line message for the user."""


@dataclass(frozen=True)
class LogFilter:
    uow: str | None = None
    queue: str | None = None
    message: str | None = None  # entry id or message id, hex
    kinds: frozenset[str] | None = None

    def select(self, records: list[Record]) -> list[Record]:
        """The records that pass every filter, in their original order."""
        if self.queue is not None or self.message is not None:
            records = self._about_target(records)
        return [r for r in records
                if (self.uow is None or r.get("u") == self.uow) and (self.kinds is None or r["k"] in self.kinds)]

    def _about_target(self, records: list[Record]) -> list[Record]:
        if self.message is not None:
            wanted = self.message.lower()
            ids = {wanted} | {d["id"] for r in records for d in lookup(r).descriptors(r) if d.get("mid") == wanted}

            def about(r: Record) -> bool:
                return not ids.isdisjoint(entry_ids(r))
        else:
            def about(r: Record) -> bool:
                return self.queue in queues_of(r)

        hits = [about(r) for r in records]
        uows = {r["u"] for r, hit in zip(records, hits) if hit and r.get("u")}
        # With the records about the target come the outcomes of their UOWs (but not the UOWs' other puts/gets).
        return [r for r, hit in zip(records, hits)
                if hit or (r.get("u") in uows and lookup(r).role in (Role.OUTCOME, Role.END))]


def parse_kinds(value: list[str] | None) -> frozenset[str] | None:
    if not value:
        return None
    kinds = frozenset(k.strip().upper() for v in value for k in v.split(",") if k.strip())
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        raise LogPrintError(f"unknown record kind {', '.join(unknown)} (kinds: {', '.join(KINDS)})")
    return kinds


def read_records(log_root: Path, member: str | None, min_lrsn: int | None,
                 max_lrsn: int | None) -> list[Record]:
    """One member's log in append order, or (member None) the merged log of every member under log_root in
    LRSN order; each record annotated with "m", the member whose log it comes from."""
    if not log_root.is_dir():
        raise LogPrintError(f"log root {log_root} does not exist (set --log-root or ${ENV_LOG_ROOT})")
    dirs = find_log_dirs(log_root)
    if member is None:
        if not dirs:
            raise LogPrintError(f"no record logs under {log_root}")
        return merged_records(dirs, min_lrsn=min_lrsn, max_lrsn=max_lrsn)
    if not (log_root / member).is_dir():
        known = ", ".join(d.name for d in dirs) or "none"
        raise LogPrintError(f"no log for member {member} under {log_root} (members: {known})")
    reader = LogReader(log_root / member)
    out = []
    for _, rec in reader.records(min_lrsn=min_lrsn):
        if max_lrsn is None or rec["l"] <= max_lrsn:
            out.append({**rec, "m": reader.member})
    return out


def describe_safely(r: Record) -> str:
    try:
        return describe(r)
    except UnknownRecordError as e:
        return str(e)
    except (KeyError, IndexError, TypeError) as e:  # a record of a known kind missing a field: show, don't die
        return f"malformed {r.get('k')} record (missing {e})"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def print_json(records: Iterable[Record]) -> None:
    for r in records:
        line = {"lrsn": r["l"], "member": r["m"], "kind": r["k"], "uow": r.get("u", ""),
                "description": describe_safely(r), "record": _jsonable({k: v for k, v in r.items() if k != "m"})}
        print(json.dumps(line, sort_keys=True))


def print_table(records: list[Record], title: str, out: Output) -> None:
    table = styled_table(out.console, "LRSN", "member", "kind", "UOW", "description", title=title)
    for r in records:
        table.add_row(str(r["l"]), r["m"], r["k"], r.get("u", "") or "-", describe_safely(r))
    out.print(table)


def add_log_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """Add ``log`` with its verb ``print`` to an argparse subparsers object (sqm.cli calls this); returns the
    verbs, to which sqm.logadmin adds status, archive and prune."""
    log_parser = subparsers.add_parser("log", help="read the record logs",
                                       description="Read the record logs of the queue-sharing group.")
    verbs = log_parser.add_subparsers(dest="log_command", required=True)
    p = verbs.add_parser("print", help="print one member's log or the merged log of all",
                         description="Print one member's record log (--member) or the merged log of all "
                                     "members (--all), filtered by UOW, queue, message, LRSN range or kind. "
                                     "--queue and --message also show the outcomes of the UOWs involved.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--member", type=cf_name("member"), help="print this member's log (in append order)")
    which.add_argument("--all", action="store_true", help="print the merged log of every member (LRSN order)")
    add_settings_arguments(p, "log_root", "cluster_dir")
    p.add_argument("--uow", help="only this unit of work's records")
    p.add_argument("--queue", help="records about this queue, with the outcomes of their UOWs")
    p.add_argument("--message", help="records about this message (entry id or message id, hex), with outcomes")
    p.add_argument("--from-lrsn", type=LRSN, metavar="N", help=f"only records with LRSN >= N (0-{MAX_LRSN})")
    p.add_argument("--to-lrsn", type=LRSN, metavar="N", help=f"only records with LRSN <= N (0-{MAX_LRSN})")
    p.add_argument("--kind", action="append", metavar="KIND[,KIND...]",
                   help=f"only these record kinds ({', '.join(KINDS)}); repeatable")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("-v", "--verbose", action="store_true", help="a traceback with errors")
    p.set_defaults(func=cmd_log)
    return verbs


# What ``sqm log print`` reports as a one-line error (beyond clitools.COMMON_ERRORS).
LOG_ERRORS = (LogPrintError, LogCorruptError, LogFormatError)


def cmd_log(args: argparse.Namespace, out: Output) -> int:
    """Run ``sqm log print`` (parsed by add_log_parser's parser); the process exit code."""
    if args.from_lrsn is not None and args.to_lrsn is not None and args.from_lrsn > args.to_lrsn:
        raise LogPrintError(f"--from-lrsn {args.from_lrsn} is above --to-lrsn {args.to_lrsn}")
    log_filter = LogFilter(uow=args.uow, queue=args.queue, message=args.message, kinds=parse_kinds(args.kind))
    log_root = settings(args).log_root
    records = log_filter.select(read_records(log_root, None if args.all else args.member,
                                             args.from_lrsn, args.to_lrsn))
    if out.as_json:
        print_json(records)  # one object per line, so that a long log streams into jq/grep
    else:
        what = "merged log of all members" if args.all else f"log of {args.member}"
        print_table(records, f"{what} under {log_root}: {len(records)} records", out)
    return 0
