"""The service's one table of operations: the handshake's, then each owner's rows (sqm.operations.Operation).

The wire protocol's list of operations (``OPS``), what each role may run (``ROLE_OPS``), the server's dispatcher
and the client library's treatment of a request lost with its connection all read it; tests/sqm/test_service_ops.py
fails when a row lacks its roles or its handler, or the client a method for it. Adding an operation: one row in
its owner's module, one client method (docs/architecture.md, "A service operation")."""

from __future__ import annotations

from sqm.conversations import ops as conversation_ops
from sqm.operations import NO_ROLE, ROLES, Operation, Operations
from sqm.pubsub import ops as pubsub_ops
from sqm.service import conn_ops, queue_ops

# hello and auth: the handshake's (sqm.service.auth), run by the transport before the connection has a role.
HANDSHAKE = (
    Operation("hello", "handshake", NO_ROLE, None),
    Operation("auth", "handshake", NO_ROLE, None),
)

OPERATIONS = Operations((*HANDSHAKE, *queue_ops.OPERATIONS, *conn_ops.OPERATIONS, *conversation_ops.OPERATIONS, *pubsub_ops.OPERATIONS))

# Every operation the server understands (the client library uses the same names), in the table's order.
OPS = OPERATIONS.names()
# What each role may run.
ROLE_OPS: dict[str, frozenset[str]] = {role: OPERATIONS.for_role(role) for role in ROLES}

__all__ = ["HANDSHAKE", "OPERATIONS", "OPS", "ROLE_OPS"]
