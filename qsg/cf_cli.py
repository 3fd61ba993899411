"""`cfemu cf` and `cfemu secrets`: an embedded CF (redis-server) running detached in a directory, and the
group's secrets (the CF's users, the service's tokens) for a CF this command does not start.

  cfemu cf start|stop|status [--cf-dir DIR] [--port N] [--appendonly] [--server-binary PATH]
                            [--tls-cert F --tls-key F [--tls-ca F]]

It listens on its TCP port and on a Unix-domain socket in its directory (cf.sock, 0600 in a 0700 directory): members
on this host may use ``unix://DIR/cf.sock`` as their CF URL, with the same users and passwords. A CF with TLS
listens on its TLS port only (a socket in clear would let a client in without the certificate the port asks for).
The CF runs the newest server that runs here (cfemu.embedded.find_server; with TLS the newest built with TLS);
--server-binary (else $CFEMU_REDIS_SERVER) forces one. start and status say which binary and version run.
  cfemu secrets init --dir DIR [--acl-file FILE [--acl-owner UID]]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from cfemu import credentials
from cfemu.clitools import (
    CLIError,
    Output,
    check_directory,
    check_directory_settings,
    check_output_path,
    tls_server_context,
)
from cfemu.embedded import EmbeddedRedis, ServerError, find_server
from cfemu.private_files import write_private
from cfemu.settings import find_cf_dir
from qsg.cli_common import Parents, whole


def cmd_cf(args: argparse.Namespace, out: Output) -> int:
    check_directory_settings(args, "cf_dir")
    cf_dir = find_cf_dir(args.cf_dir)
    if args.action == "start":
        try:
            running: EmbeddedRedis | None = EmbeddedRedis.attach(cf_dir)
        except ServerError:
            running = None
        if running is not None:
            raise CLIError(f"a CF already runs from {cf_dir} at {running.url} (pid {running.pid})")
        # What the arguments name is checked before anything is made: a start refused leaves no directory behind.
        if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_ca and not args.tls_cert):
            raise CLIError("TLS needs both --tls-cert and --tls-key (and --tls-ca only with them)")
        if args.tls_cert is not None:  # each file PEM, the key the certificate's: refused before anything is made
            tls_server_context(args.tls_cert, args.tls_key, args.tls_ca)
        try:
            server = find_server(tls=args.tls_cert is not None, forced=args.server_binary)
        except ServerError as e:
            raise CLIError(str(e)) from None
        # Secured from its first start: the default user off, one user per role, passwords in cf_dir/secrets.
        passwords = credentials.create(cf_dir / credentials.SECRETS_DIR)
        srv = EmbeddedRedis(port=args.port, data_dir=cf_dir, appendonly=args.appendonly, detach=True,
                            acl_users=credentials.acl_lines(passwords), binary=server.path,
                            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                            unix_socket=args.tls_cert is None).start()
        info = {"running": True, "answering": srv.answers(), "url": srv.url, "pid": srv.pid,
                "dir": str(srv.data_dir), **_server_fields(srv),
                "secrets": str((cf_dir / credentials.SECRETS_DIR).resolve())}
    elif args.action == "stop":
        srv = EmbeddedRedis.attach(cf_dir)
        srv.stop()
        info = {"stopped": srv.url, "dir": str(cf_dir)}
    else:
        try:
            srv = EmbeddedRedis.attach(cf_dir)
            info = {"running": True, "answering": srv.answers(), "url": srv.url, "pid": srv.pid, "dir": str(cf_dir),
                    **_server_fields(srv)}
        except ServerError:
            info = {"running": False, "dir": str(cf_dir)}
    if args.json:
        out.json(info)
    else:
        out.table(f"CF ({args.action})", ["field", "value"], sorted(info.items()))
    # status: 1 (a negative answer) when no CF runs, or when its process runs but does not answer (hung)
    return 0 if args.action != "status" or (info.get("running") and info.get("answering")) else 1


def _server_fields(srv: EmbeddedRedis) -> dict[str, Any]:
    """Which server runs: its binary, product and version, whether it listens with TLS only, and the URL of its
    Unix-domain socket (for members on this host: sqm run --redis-url unix://...)."""
    server = srv.server
    return {"binary": server.path, "server": server.product, "version": server.version_text, "tls": srv.tls,
            **({"unix_url": srv.unix_url} if srv.socket_path is not None else {})}


def cmd_secrets(args: argparse.Namespace, out: Output) -> int:
    """cfemu secrets init: the group's secrets in DIR (kept when they exist), and optionally the CF's ACL file for
    them (for a CF this command does not start: docker-compose's redis-server, or an external Redis)."""
    directory = Path(args.dir)
    acl = Path(args.acl_file) if args.acl_file else None
    # Checked before anything is made. The ACL file is written in the path's place (a new file renamed over it):
    # a device, a pipe, a directory or a link there would be replaced (run as root, /dev/null was).
    if acl is not None and (acl.is_symlink() or (acl.exists() and not acl.is_file())):
        raise CLIError(f"--acl-file: {acl} exists and is not a regular file: name a new file or the ACL file itself")
    if acl is not None:
        try:
            check_output_path(acl)
        except ValueError as e:
            raise CLIError(f"--acl-file: {e}") from None
    check_directory(directory, "--dir")
    if acl is None and args.acl_owner is not None:
        raise CLIError("--acl-owner owns the ACL file: it needs --acl-file")
    existing = _passwords(directory)
    if acl is not None and acl.is_file() and not args.force and (
            existing is None or acl.read_bytes() != _acl_text(existing)):
        # Another group's ACL file (or an older one) may be what a running CF reads: written over only when asked.
        raise CLIError(f"--acl-file: {acl} exists and holds another ACL: pass --force to write over it, or name a "
                       "new file")
    passwords = credentials.create(directory)
    info: dict[str, Any] = {"dir": str(directory.resolve()), "files": sorted(p.name for p in directory.iterdir())}
    if acl is not None:
        write_private(acl, _acl_text(passwords))
        if args.acl_owner is not None:  # the redis-server that reads it may run as another user (its image's)
            os.chown(acl, args.acl_owner, -1)
        info["acl_file"] = str(acl.resolve())
    if args.json:
        out.json(info)
    else:
        out.table("group secrets (values are never printed)", ["field", "value"],
                  [(k, ", ".join(v) if isinstance(v, list) else v) for k, v in sorted(info.items())])
    return 0



def _acl_text(passwords: dict[str, str]) -> bytes:
    """The CF's ACL file for these passwords."""
    return "".join(line + "\n" for line in credentials.acl_lines(passwords)).encode()


def _passwords(directory: Path) -> dict[str, str] | None:
    """The CF passwords already in the secrets directory, made by nothing here (None: not all of them are there)."""
    found = {role: credentials.read_password(directory, role) for role in credentials.ROLES} \
        if directory.is_dir() else {}
    return {role: pw for role, pw in found.items() if pw} if found and all(found.values()) else None


def cf_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--cf-dir", "--dir", dest="cf_dir",
                   help="data directory (default $CFEMU_CF_DIR, else the nearest var/cf, else var/cf)")
    p.add_argument("--port", type=whole(1, 65535), default=None, help="TCP port (default: a free one)")
    p.add_argument("--appendonly", action="store_true", help="keep an AOF (the CF survives a restart)")
    p.add_argument("--server-binary", default=None,
                   help="the redis-server or valkey-server to run (default $CFEMU_REDIS_SERVER, else the newest "
                        "that runs here)")
    p.add_argument("--tls-cert", default=None, help="the CF's TLS certificate (PEM): it then listens with TLS only")
    p.add_argument("--tls-key", default=None, help="the key of --tls-cert (PEM)")
    p.add_argument("--tls-ca", default=None,
                   help="the CA of the clients' certificates: given, every client must present one (mutual TLS)")


def secrets_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("action", choices=["init"])
    p.add_argument("--dir", required=True, help="the secrets directory (made 0700; files 0600)")
    p.add_argument("--acl-file", help="also write the CF's ACL file for these secrets here (0600)")
    p.add_argument("--acl-owner", type=whole(0), default=None, help="uid to own the ACL file (the redis-server's)")
    p.add_argument("--force", action="store_true",
                   help="write over an --acl-file that holds another ACL (by default refused: a CF may read it)")
