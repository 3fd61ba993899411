"""`cfemu cf` and `cfemu secrets`: an embedded CF (redis-server) running detached in a directory, and the
group's secrets (the CF's users, the service's tokens) for a CF this command does not start.

  cfemu cf start|stop|status [--cf-dir DIR] [--port N] [--appendonly]
  cfemu secrets init --dir DIR [--acl-file FILE [--acl-owner UID]]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from cfemu import credentials
from cfemu.clitools import CLIError, Output
from cfemu.embedded import EmbeddedRedis, ServerError
from cfemu.private_files import write_private
from cfemu.settings import find_cf_dir
from qsg.cli_common import Parents, whole


def cmd_cf(args: argparse.Namespace, out: Output) -> int:
    cf_dir = find_cf_dir(args.cf_dir)
    if args.action == "start":
        try:
            running: EmbeddedRedis | None = EmbeddedRedis.attach(cf_dir)
        except ServerError:
            running = None
        if running is not None:
            raise CLIError(f"a CF already runs from {cf_dir} at {running.url} (pid {running.pid})")
        # Secured from its first start: the default user off, one user per role, passwords in cf_dir/secrets.
        passwords = credentials.create(cf_dir / credentials.SECRETS_DIR)
        srv = EmbeddedRedis(port=args.port, data_dir=cf_dir, appendonly=args.appendonly, detach=True,
                            acl_users=credentials.acl_lines(passwords)).start()
        info = {"url": srv.url, "pid": srv.pid, "dir": str(srv.data_dir),
                "secrets": str((cf_dir / credentials.SECRETS_DIR).resolve())}
    elif args.action == "stop":
        srv = EmbeddedRedis.attach(cf_dir)
        srv.stop()
        info = {"stopped": srv.url, "dir": str(cf_dir)}
    else:
        try:
            srv = EmbeddedRedis.attach(cf_dir)
            info = {"running": True, "url": srv.url, "pid": srv.pid, "dir": str(cf_dir)}
        except ServerError:
            info = {"running": False, "dir": str(cf_dir)}
    if args.json:
        out.json(info)
    else:
        out.table(f"CF ({args.action})", ["field", "value"], sorted(info.items()))
    return 0 if args.action != "status" or info.get("running") else 1


def cmd_secrets(args: argparse.Namespace, out: Output) -> int:
    """cfemu secrets init: the group's secrets in DIR (kept when they exist), and optionally the CF's ACL file for
    them (for a CF this command does not start: docker-compose's redis-server, or an external Redis)."""
    directory = Path(args.dir)
    passwords = credentials.create(directory)
    info: dict[str, Any] = {"dir": str(directory.resolve()), "files": sorted(p.name for p in directory.iterdir())}
    if args.acl_file:
        acl = Path(args.acl_file)
        write_private(acl, "".join(line + "\n" for line in credentials.acl_lines(passwords)).encode())
        if args.acl_owner is not None:  # the redis-server that reads it may run as another user (its image's)
            os.chown(acl, args.acl_owner, -1)
        info["acl_file"] = str(acl.resolve())
    if args.json:
        out.json(info)
    else:
        out.table("group secrets (values are never printed)", ["field", "value"],
                  [(k, ", ".join(v) if isinstance(v, list) else v) for k, v in sorted(info.items())])
    return 0



def cf_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--cf-dir", "--dir", dest="cf_dir",
                   help="data directory (default $CFEMU_CF_DIR, else the nearest var/cf, else var/cf)")
    p.add_argument("--port", type=whole(1, 65535), default=None, help="TCP port (default: a free one)")
    p.add_argument("--appendonly", action="store_true", help="keep an AOF (the CF survives a restart)")


def secrets_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("action", choices=["init"])
    p.add_argument("--dir", required=True, help="the secrets directory (made 0700; files 0600)")
    p.add_argument("--acl-file", help="also write the CF's ACL file for these secrets here (0600)")
    p.add_argument("--acl-owner", type=whole(0), default=None, help="uid to own the ACL file (the redis-server's)")
