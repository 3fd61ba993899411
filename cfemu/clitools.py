"""What every command line of the project shares (cfemu, sqm, cfbackup, cfrestore).

* Settings: ``add_settings_arguments`` gives a parser the flags of cfemu.settings (--redis-url, --log-root,
  --backup-dir, --token, --cluster-dir, --cf-dir) with one help text each, and ``settings(args)`` resolves them:
  flag, environment, the nearest cluster, the ``cfemu cf start`` CF, the default.
* Output: ``Output`` prints rich tables on a terminal, plain columns otherwise, or one JSON document (--json).
* Errors: ``run_command`` runs a verb; an expected error is one line on stderr, ``PROG: error: ...``, exit status 2,
  and --verbose adds the traceback. Ctrl-C is ``PROG: interrupted``, exit status 130.
* Arguments: ``Parser`` says a usage error in one line, exit status 2; ``whole``, ``seconds``, ``number``,
  ``input_file``, ``output_file``, ``directory`` and ``cf_name`` are argument types that refuse a value out of range
  (NaN and infinity included), a missing file, a file in no directory or in one this user may not write, a directory
  that is a file or cannot be made, or a bad CF name as the command line is parsed, naming the option and the value,
  before anything runs; ``check_output_path`` and ``check_directory`` are the same checks for a path from elsewhere
  (a setting, the environment).
* Progress: ``PhaseBars`` draws the cfemu.progress port as one rich bar per phase.
* Daemons (``sqm run``, ``cfbackup schedule``): ``configure_logging`` writes their log lines, as JSON with --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import ssl
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import redis
from rich import box
from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from cfemu import keys
from cfemu import settings as _settings
from cfemu.admin import AdminError
from cfemu.connection import ConnectionConfigError, check_url
from cfemu.errors import MQError
from cfemu.settings import Settings


class CLIError(Exception):
    """A one-line error for the operator."""


# What any verb may raise for a reason the operator can act on; each CLI adds its own (run_command's expected).
COMMON_ERRORS: tuple[type[BaseException], ...] = (
    CLIError, MQError, AdminError, ConnectionConfigError, ValueError, OSError, redis.exceptions.RedisError)

# --- settings --------------------------------------------------------------------------------------------------
SETTINGS_HELP = {
    "redis_url": f"the CF (default ${_settings.ENV_URL}, the cluster's, or the 'cfemu cf start' CF's)",
    "log_root": f"the members' logs (default ${_settings.ENV_LOG_ROOT}, the cluster's, or "
                f"{_settings.DEFAULT_LOG_ROOT})",
    "backup_dir": f"the backup root (default ${_settings.ENV_BACKUP_DIR}, the cluster's, or "
                  f"{_settings.DEFAULT_BACKUP_DIR})",
    "token": (f"the SQM servers' token of this command's role (cfemu: the operator's, default "
              f"${_settings.ENV_OPERATOR_TOKEN}; others: the application's, default ${_settings.ENV_TOKEN}; "
              "else the group's secrets directory). Prefer the variable or the file: ps shows a flag"),
    "cluster_dir": f"a 'cfemu cluster' directory to take settings from (default ${_settings.ENV_CLUSTER_DIR} or "
                   f"the nearest {_settings.DEFAULT_CLUSTER_DIR})",
    "log_archive_dir": f"where linear logging archives inactive log segments, DIR/<member> (default "
                       f"${_settings.ENV_LOG_ARCHIVE_DIR}, the cluster's, else each member's log directory's archive/)",
    "cf_dir": f"a 'cfemu cf start' directory (default ${_settings.ENV_CF_DIR} or the nearest "
              f"{_settings.DEFAULT_CF_DIR})",
    "memory_limit": f"restore's working memory, e.g. 512MiB or 4GiB (default ${_settings.ENV_MEMORY_LIMIT} or "
                    f"{_settings.DEFAULT_MEMORY_LIMIT}): the local engine plans in partitions that fit it; the "
                    "process needs about 150 MiB besides (docs/runbook.md)",
    "workers": f"the local restore engine's worker processes, each settling one partition at a time (default "
               f"${_settings.ENV_RESTORE_WORKERS} or one a core, at most {_settings.MAX_DEFAULT_RESTORE_WORKERS}; "
               "1: all in this process)",
    "backup_share": f"the share of the time the backup works while the CF serves the group's work, above 0 and at "
                    f"most 1 (default ${_settings.ENV_BACKUP_SHARE} or {_settings.DEFAULT_BACKUP_SHARE}): it pauses "
                    "between batches the rest of the time; on an idle CF it never pauses; 1: never pauses",
    "max_umsgs": f"MAXUMSGS: the messages an application may put and get in one unit of work, 1-"
                 f"{_settings.MAX_MAX_UMSGS} (default ${_settings.ENV_MAX_UMSGS} or {_settings.DEFAULT_MAX_UMSGS}); the "
                 "put or get past it is refused with MQRC_SYNCPOINT_LIMIT_REACHED (2024), the unit of work left open",
}


def add_settings_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """Add the settings flags ``names`` (keys of SETTINGS_HELP; default: all). Every default is None: the
    resolver, not argparse, decides what an absent flag means."""
    for name in names or tuple(SETTINGS_HELP):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=SETTINGS_HELP[name])


def settings(args: argparse.Namespace) -> Settings:
    """The settings for a parsed command line (flags it does not have count as not given), with the CF user of
    the command's role (``cf_role``, set by each command's parser: cfemu.credentials.ROLES)."""
    check_directory_settings(args)
    return _settings.resolve(role=getattr(args, "cf_role", "operator"),
                             **{name: getattr(args, name, None) for name in SETTINGS_HELP})


def check_directory_settings(args: argparse.Namespace, *names: str) -> None:
    """Check the directory settings ``names`` (default: every one in DIRECTORY_SETTINGS) given by flag, else by
    their variable: a file, or a place no directory can be made, is a CLIError in one line naming the flag or
    variable (check_directory)."""
    for name in names or tuple(DIRECTORY_SETTINGS):
        env_name = DIRECTORY_SETTINGS[name]
        if getattr(args, name, None):
            check_directory(getattr(args, name), "--" + name.replace("_", "-"))
        elif os.environ.get(env_name):
            check_directory(os.environ[env_name], f"${env_name}")


# The settings that name a directory, with their variables: each given one is checked (check_directory) before the
# settings are resolved.
DIRECTORY_SETTINGS = {"cluster_dir": _settings.ENV_CLUSTER_DIR, "cf_dir": _settings.ENV_CF_DIR,
                      "log_root": _settings.ENV_LOG_ROOT, "backup_dir": _settings.ENV_BACKUP_DIR,
                      "log_archive_dir": _settings.ENV_LOG_ARCHIVE_DIR}


def require_url(s: Settings) -> str:
    """The CF URL, or the error that says every way to give one."""
    if not s.redis_url and s.cluster_dir is not None:  # found the group, stopped: say so, not "no CF"
        raise CLIError(f"the cluster in {s.cluster_dir} is down (its CF does not run): start it with 'cfemu cluster "
                       f"up --dir {s.cluster_dir}', or pass --redis-url")
    if not s.redis_url:
        raise CLIError(f"no CF found: pass --redis-url, set ${_settings.ENV_URL}, or start one ('cfemu cluster up' "
                       "or 'cfemu cf start')")
    return check_url(s.redis_url)


# --- output -----------------------------------------------------------------------------------------------------
def console(width: int = 250) -> Console:
    """A rich console; plain (no colour, wide) when the output is not a terminal, so that pipes get columns."""
    c = Console()
    return c if c.is_terminal else Console(width=width, no_color=True, highlight=False)


def styled_table(console: Console, *columns: str, title: str | None = None) -> Table:
    """A table in the house style: rounded boxes on a terminal, bare columns otherwise."""
    return Table(*columns, title=title, title_justify="left", box=box.ROUNDED if console.is_terminal else None)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        try:
            return obj.decode()
        except UnicodeDecodeError:
            return obj.hex()
    return str(obj)


def dumps(obj: Any, *, indent: int | None = 1) -> str:
    """JSON as every command prints it: sorted keys, bytes as text (hex when not UTF-8), anything else str()."""
    return json.dumps(obj, indent=indent, sort_keys=True, default=_json_default)


class Output:
    """Rich tables on a terminal, plain columns otherwise, or one JSON document with --json."""

    def __init__(self, as_json: bool = False, width: int = 250) -> None:
        self.as_json = as_json
        self.console = console(width)
        self.wrote_json = False  # a document is out: an error after it (a partial answer) adds no second one

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        t = styled_table(self.console, *columns, title=title)
        for row in rows:
            t.add_row(*("-" if v is None else str(v) for v in row))
        self.console.print(t)

    def print(self, *renderables: RenderableType) -> None:
        self.console.print(*renderables)

    def json(self, obj: Any) -> None:
        print(dumps(obj))
        self.wrote_json = True

    def line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)


# --- errors -----------------------------------------------------------------------------------------------------
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141: what a shell reports for a process ended by SIGPIPE


def error_line(e: BaseException) -> str:
    """An expected error in one line. redis-py's connection errors name only an address ("Error 111 connecting to
    127.0.0.1:1"): the only Redis servers these commands reach are the CF's, so the line says it is the CF."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"cannot reach the CF: {text}"
    return text


def run_command(prog: str, args: argparse.Namespace, func: Callable[[argparse.Namespace, Output], int],
                expected: tuple[type[BaseException], ...] = (),
                exit_code: Callable[[BaseException], int] | None = None) -> int:
    """Run a verb with an Output (JSON when args.json): an expected error (COMMON_ERRORS or ``expected``) is one
    line on stderr and exit status 2 (or what ``exit_code`` makes of the error); --verbose adds the traceback above
    it."""
    # Whatever a command creates (reports, archives, chaos histories, a cluster's files) holds message bodies or
    # secrets: its owner's only, whatever the caller's umask. The data files set their modes themselves as well.
    os.umask(0o077)
    out = Output(bool(getattr(args, "json", False)))
    try:
        return int(func(args, out))
    except BrokenPipeError:
        # The reader of the output has gone (`... | head`): stop without a word, as other tools do, with the status
        # a shell gives a process SIGPIPE ended; what is left to flush goes nowhere.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (*COMMON_ERRORS, *expected) as e:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        line = error_line(e)
        print(f"{prog}: error: {line}", file=sys.stderr)
        code = exit_code(e) if exit_code is not None else 2
        if out.as_json and not out.wrote_json:  # a script reading stdout gets the failure as JSON, not nothing
            print(json.dumps({"error": line, "exit": code}))
        return code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


# --- progress ---------------------------------------------------------------------------------------------------
class PhaseBars:
    """A cfemu.progress.Progress drawn as one rich bar per phase (restore's read backup ... load, backup's five
    copy steps). Phases come one after another, so one that never reported a total is shown complete once the
    next one starts. Use as a context manager; with disabled=True (not a terminal, or --json) it shows nothing."""

    def __init__(self, console: Console, *, disabled: bool = False, width: int = 12) -> None:
        self.bars = Progress(TextColumn(f"{{task.description:<{width}}}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, disable=disabled)
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        task = self.tasks.get(phase)
        if task is None:
            for t in self.bars.tasks:
                if t.total is None:
                    self.bars.update(t.id, total=t.completed or 1, completed=t.completed or 1)
            task = self.tasks[phase] = self.bars.add_task(phase, total=total)
        self.bars.update(task, completed=done, total=total)

    def __enter__(self) -> PhaseBars:
        self.bars.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.bars.stop()


# --- daemons ----------------------------------------------------------------------------------------------------
class JsonLogFormatter(logging.Formatter):
    """One JSON object per log line: time (UTC, ISO 8601), level, logger, thread, message (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "thread": record.threadName,
            "message": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return dumps(doc, indent=None)


def configure_logging(verbose: bool = False, as_json: bool = False) -> None:
    """The log of a daemon verb on stderr: INFO (DEBUG with --verbose), text or (--json) JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(threadName)s]: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


EXIT_USAGE = 2  # argparse's own: a bad command line


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr, exit status 2:
    ``cfemu put: error: argument --count: must be a whole number from 1 to 10000000, not -5 (see 'cfemu put --help')``.
    Sub-parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


# The longest wait, lease or interval a command takes: a year (a timed wait of more overflows the platform's time_t
# or threading.TIMEOUT_MAX; none is meant).
MAX_SECONDS = 366 * 86400
MAX_MS = MAX_SECONDS * 1000
#: A member's lease in the admin structure (--lease-ms of `sqm run`, of `cfemu cluster up` for its members, of a
#: cfemu command's in-process member): at least 500 ms, a member renewing it every third of it.
MIN_LEASE_MS = 500


def whole(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argument type: a whole number in [low, high] (either bound may be open)."""
    return _number(int, "a whole number", low, high)


def number(low: float | None = None, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argument type: a number, fractions allowed (a size in MiB, a share), >= low (> low with above), <= high;
    never NaN or infinite."""
    return _number(float, "a number", low, high, above=above)


def lease_ms(text: str) -> int:
    """An argument type: a member's lease in ms, MIN_LEASE_MS to MAX_MS."""
    return whole(MIN_LEASE_MS, MAX_MS)(text)


def seconds(low: float | None = 0.0, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argument type: a number of seconds >= low (> low with above), <= high."""
    return number(low, high, above=above)


def input_file(text: str) -> str:
    """An argument type: a file the command reads (a certificate, a key): it must be a readable file now, not a
    missing one found once the command has started."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"must be a file that exists, not {text!r}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"must be a file this user may read, not {text!r}")
    return text


def check_output_path(text: str | os.PathLike[str], *, parents: bool = False) -> Path:
    """A file the command writes later (a ready file, a report, a metrics file): refused now, with ValueError in one
    line, when it is a directory, when its directory does not exist (with parents, the command makes it: when it
    cannot be made), or when this user may not write it there, so that a mistyped path is refused before the command
    starts work it would then leave half done."""
    raw = os.fspath(text)
    path = Path(raw)
    if not raw or path.is_dir():
        raise ValueError(f"must be a file, not the directory {raw!r}" if raw else "must be a file, not ''")
    parent = path.absolute().parent
    if parents and not parent.is_dir():
        try:
            check_directory(parent, "its directory")
        except CLIError as e:
            raise ValueError(f"must be a file in a directory that can be made, not {raw!r} ({e})") from None
        return path
    if not parent.is_dir():
        raise ValueError(f"must be a file in a directory that exists, not {raw!r} (no directory {str(parent)!r})")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"must be a file this user may write, not {raw!r}")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"must be a file in a directory this user may write, not {raw!r}")
    return path


def output_file(text: str) -> Path:
    """An argument type: a file the command writes later (check_output_path)."""
    try:
        return check_output_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def output_file_in_new_directory(text: str) -> Path:
    """An argument type: a file the command writes later, making its directory when missing (check_output_path
    with parents)."""
    try:
        return check_output_path(text, parents=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tls_server_context(cert: str | os.PathLike[str], key: str | os.PathLike[str],
                       ca: str | os.PathLike[str] | None = None, *, flags: tuple[str, str, str] = (
                           "--tls-cert", "--tls-key", "--tls-ca")) -> ssl.SSLContext:
    """A TLS server context from a certificate, its key and (mutual TLS) a CA, all PEM: a file that is missing,
    unreadable or not PEM, or a key that is not the certificate's, is a CLIError in one line naming the flag
    (``flags``) and the file, before a server is started with them."""
    for flag, path in zip(flags, (cert, key, ca), strict=True):
        if path is not None and not os.path.isfile(path):
            what = "not a file" if os.path.exists(path) else "no such file"
            raise CLIError(f"{flag}: {what}: {os.fspath(path)}")
        if path is not None and not os.access(path, os.R_OK):
            raise CLIError(f"{flag}: {os.fspath(path)}: this user may not read it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise CLIError(f"{flags[0]} {os.fspath(cert)} and {flags[1]} {os.fspath(key)}: not a PEM certificate and its "
                       f"private key ({getattr(e, 'reason', None) or e})") from None
    if ca is not None:
        try:
            ctx.load_verify_locations(ca)
        except (ssl.SSLError, OSError) as e:
            raise CLIError(f"{flags[2]} {os.fspath(ca)}: not a PEM certificate ({getattr(e, 'reason', None) or e})") \
                from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def check_directory(text: str | os.PathLike[str], what: str) -> Path:
    """A directory the command uses or creates (a log root, a data directory): CLIError in one line, naming
    ``what``, when it is a file, or when it is missing and cannot be made (its nearest existing ancestor is not a
    directory this user may write). Nothing is created."""
    raw = os.fspath(text)
    path = Path(raw)
    if not raw:
        raise CLIError(f"{what}: must be a directory, not ''")
    if path.exists():
        if not path.is_dir():
            raise CLIError(f"{what}: {raw!r} is not a directory")
        return path
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CLIError(f"{what}: {raw!r} cannot be made: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"{what}: {raw!r} cannot be made: this user may not write in {str(ancestor)!r}")
    return path


def directory(what: str) -> Callable[[str], Path]:
    """An argument type: a directory the command uses or creates (check_directory)."""
    def parse(text: str) -> Path:
        try:
            return check_directory(text, what)
        except CLIError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{what}: ")) from None
    return parse


def cf_name(kind: str, *, empty: bool = False) -> Callable[[str], str]:
    """An argument type: a CF name (kind "structure" or "queue": cfemu.keys.check_name; "member":
    check_member_name), refused as the command line is parsed; with empty, '' (none) is taken too."""
    check = keys.check_member_name if kind == "member" else (lambda name: keys.check_name(kind, name))

    def parse(text: str) -> str:
        if empty and text == "":
            return text
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _shown(bound: float) -> str:
    """A bound as people write it: whole numbers in full (104857600, not 1.04858e+08)."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _number(kind: Callable[[str], Any], what: str, low: Any, high: Any, *, above: bool = False) -> Any:
    if low is not None and high is not None:
        wanted = (f"{what} > {_shown(low)} and <= {_shown(high)}" if above
                  else f"{what} from {_shown(low)} to {_shown(high)}")
    elif low is not None:
        wanted = f"{what} {'>' if above else '>='} {_shown(low)}"
    else:
        wanted = f"{what} <= {_shown(high)}" if high is not None else what

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, not {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or \
                (low is not None and (value <= low if above else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, not {text}")
        return value

    return parse
