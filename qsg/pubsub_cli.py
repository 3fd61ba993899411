"""`cfemu topic|sub|publish`: durable publish and subscribe as an operator runs it (docs/pubsub.md).

  cfemu topic define NAME --structure S [--no-persistent] [--lifetime S] [--no-durable]
                                        [--subscription-expiration S] [--max-messages N]
  cfemu topic list
  cfemu sub add TOPIC NAME [--durable | --no-durable] --server HOST:PORT
  cfemu sub remove TOPIC NAME --server HOST:PORT
  cfemu sub remove TOPIC --id ID --server HOST:PORT    any owner's, by the id `sub list` shows (an operator's)
  cfemu sub list TOPIC --server HOST:PORT
  cfemu publish TOPIC MESSAGE... --server HOST:PORT      one publication of the messages, committed

Definitions go to the CF and, durably, the group repository (as `cfemu define`); subscriptions and publications go
through a member's service (sqm.service), like `cfemu uow`. Every command takes --json; errors are one line."""

from __future__ import annotations

import argparse
from typing import Any

from cfemu import repository
from cfemu.cf import CF, Structure
from cfemu.clitools import CLIError, Output, add_settings_arguments, settings
from cfemu.topic_attributes import SUB_SUFFIX, publication_queue, subscription_queue
from qsg.cli_common import FIRST_CONNECT_S, Parser, admin_client, run_verb
from sqm.pubsub.pubsub import SUB_LETTER
from sqm.service.client import Client

SUB_FIELDS = ("name", "user", "durable", "position_lrsn", "position_pub", "received", "subscribed_pc", "active_pc",
              "home", "id")


def _client(args: argparse.Namespace) -> Client:
    if not args.server:
        raise CLIError(f"{args.command} {getattr(args, 'action', '')}: give --server HOST:PORT (a member's service: "
                       "subscriptions and publications go through a session on it)".replace("  ", " "))
    found = settings(args)
    return Client(args.server, token=found.token, role=found.token_role, client_name="cfemu",
                  first_connect_timeout=FIRST_CONNECT_S)


def _subscriptions(s: Structure, topic: str) -> int:
    """The topic's subscriptions, every one (their entries' descriptors, a bounded batch per CF call): what an
    operator watches is counted, never its data read, however many there are."""
    ids: set[str] = set()
    cursor = "0"
    while True:
        cursor, found = s.peek_scan(subscription_queue(topic), "c", SUB_LETTER.hex(), cursor, 500, heads=True)
        ids.update(entry.msgid for entry, _ in found)
        if cursor == "0":
            return len(ids)


def cmd_topic(args: argparse.Namespace, out: Output) -> int:
    with admin_client(args) as admin:
        if args.action == "define":
            if not args.name or not args.structure:
                raise CLIError("topic define: give NAME and --structure S")
            attrs = {"persistent": args.persistent, "lifetime_s": args.lifetime, "durable": args.durable,
                     "subscription_expiration_s": args.subscription_expiration, "max_messages": args.max_messages}
            repo = repository.open_group_repository(admin, settings(args).log_root, who="cfemu topic define")
            q = repository.define_queue(admin, repo, args.name, args.structure, topic=attrs, replace=args.replace)
            doc: dict[str, Any] = {"topic": q.name, "structure": q.structure, **q.topic,
                                   "companions": list(q.companions)}
            if args.json:
                out.json(doc)
            else:
                out.table(f"topic {q.name} defined (with {publication_queue(q.name)} and {subscription_queue(q.name)})",
                          ["attribute", "value"], [(k, v) for k, v in doc.items() if k != "companions"])
            return 0
        cf = CF(admin.redis)
        rows = []
        depths: dict[str, dict[str, dict[str, int]]] = {}  # per structure, read once
        for q in admin.queues():
            if not q.topic:
                continue
            s = cf.structure(q.structure)
            state = admin.state(q.structure)
            subs = msgs = None
            if state == "ACTIVE":
                subs = _subscriptions(s, q.name)
                msgs = depths.setdefault(q.structure, s.depths()).get(publication_queue(q.name), {}).get("CP", 0)
            rows.append({"topic": q.name, "structure": q.structure, **q.topic, "subscriptions": subs,
                         "publication_messages": msgs, "state": state})
    if args.json:
        out.json({"topics": rows})
    else:
        cols = ["topic", "structure", "persistent", "lifetime_s", "durable", "subscription_expiration_s",
                "subscriptions", "publication_messages"]
        out.table("topics", cols, [[r[c] for c in cols] for r in rows])
    return 0


def cmd_sub(args: argparse.Namespace, out: Output) -> int:
    if args.action in ("add", "remove") and not args.name and not (args.action == "remove" and args.id):
        raise CLIError(f"sub {args.action}: give TOPIC NAME" + (" or TOPIC --id ID" if args.action == "remove" else ""))
    if args.id and (args.action != "remove" or args.name):
        raise CLIError("sub: --id names the subscription to remove: give it to 'sub remove TOPIC' without NAME")
    with _client(args) as c:
        if args.action == "add":
            doc: Any = c.subscribe(args.topic, args.name, durable=args.durable)
        elif args.action == "remove":
            doc = c.unsubscribe(args.topic, id=args.id) if args.id else c.unsubscribe(args.topic, args.name)
        else:
            doc = {"topic": args.topic, "subscriptions": c.subscriptions(args.topic)}
    if args.json:
        out.json(doc)
    elif args.action == "list":
        out.table(f"subscriptions of {args.topic} (on {args.topic}{SUB_SUFFIX})", list(SUB_FIELDS),
                  [[s.get(f) for f in SUB_FIELDS] for s in doc["subscriptions"]])
    else:
        verb = "subscribed" if args.action == "add" else "unsubscribed"
        out.line(f"{doc['name']} {verb} to {doc['topic']} ({'durable' if doc['durable'] else 'not durable'}; "
                 f"position {doc['position_lrsn']})")
    return 0


def cmd_publish(args: argparse.Namespace, out: Output) -> int:
    with _client(args) as c:
        for body in args.messages:
            pub = c.publish(args.topic, body.encode())
        c.pub_commit()
    doc = {"topic": args.topic, "pub": pub["pub"], "messages": len(args.messages), "committed": True}
    if args.json:
        out.json(doc)
    else:
        out.line(f"publication {doc['pub']} of {doc['messages']} message(s) committed to {args.topic}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    add_settings_arguments(common, "redis_url", "log_root", "token")
    common.add_argument("--server", action="append", default=[], metavar="HOST:PORT",
                        help="a member's service (repeat for failover)")
    parser = Parser(prog="cfemu", description="Publish and subscribe (docs/pubsub.md).")
    sub = parser.add_subparsers(dest="command", required=True)

    topic = sub.add_parser("topic", parents=[common], help="define or list topics")
    topic.add_argument("action", choices=["define", "list"])
    topic.add_argument("name", nargs="?", default="")
    topic.add_argument("--structure", default="")
    topic.add_argument("--no-persistent", dest="persistent", action="store_false",
                       help="publications are not persistent (lost with the CF)")
    topic.add_argument("--lifetime", type=int, default=86400, help="a publication's lifetime, seconds of up-time")
    topic.add_argument("--no-durable", dest="durable", action="store_false",
                       help="no durable subscriptions on this topic")
    topic.add_argument("--subscription-expiration", type=int, default=7 * 86400,
                       help="SUBSCRIPTION-EXPIRATION: an idle subscription goes after this many seconds of up-time")
    topic.add_argument("--max-messages", type=int, default=100, help="messages in one publication")
    topic.add_argument("--replace", action="store_true")

    subs = sub.add_parser("sub", parents=[common], help="subscriptions, through a member's service")
    subs.add_argument("action", choices=["add", "remove", "list"])
    subs.add_argument("topic")
    subs.add_argument("name", nargs="?", default="")
    subs.add_argument("--id", default="", help="remove: the subscription with this id (sub list's), whoever its owner")
    dur = subs.add_mutually_exclusive_group()
    dur.add_argument("--durable", dest="durable", action="store_true", default=None)
    dur.add_argument("--no-durable", dest="durable", action="store_false")

    pub = sub.add_parser("publish", parents=[common], help="publish one publication, through a member's service")
    pub.add_argument("topic")
    pub.add_argument("messages", nargs="+", metavar="MESSAGE")
    return parser


COMMANDS = {"topic": cmd_topic, "sub": cmd_sub, "publish": cmd_publish}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_verb("cfemu", args, COMMANDS[args.command])


__all__ = ["main", "build_parser"]
