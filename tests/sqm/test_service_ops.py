"""The service's one table of operations (sqm.service.ops): every operation has its roles, its handler and a
client method, and the wire's list of operations, the role check and the dispatcher read the table.

Adding an operation is one row in its owner's module and one client method (docs/architecture.md, "A service
operation"); these tests fail when either is missing."""

from __future__ import annotations

import ast
import inspect
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sqm import operations
from sqm.conversations import conversation
from sqm.conversations import ops as conversation_ops
from sqm.operations import ANY_ROLE, APPLICATION, OPERATOR, ROLES, Operation, Operations
from sqm.pubsub import ops as pubsub_ops
from sqm.service import client, ops, queue_ops
from sqm.service.client import Client
from sqm.service.ops import OPERATIONS, OPS, ROLE_OPS
from sqm.service.server import ServerConfig, SQMServer
from sqm.service.session import Session

HANDSHAKE = {"hello", "auth"}
DISPATCHED = [op for op in OPERATIONS if op.family != "handshake"]


def client_calls() -> dict[str, set[str]]:
    """op name -> the Client methods that send it (``self._call("op", ...)``), over Client and its bases."""
    found: dict[str, set[str]] = {}
    for cls in Client.__mro__:
        if not cls.__module__.startswith("sqm.service"):
            continue
        tree = ast.parse(inspect.getsource(cls).strip())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_call"
                        and node.args and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    found.setdefault(node.args[0].value, set()).add(fn.name)
    return found


# --- the table ----------------------------------------------------------------------------------------------------
def test_every_operation_has_roles_and_a_handler_and_the_handshake_neither() -> None:
    for op in DISPATCHED:
        assert callable(op.handler), f"{op.name}: no handler"
        assert op.roles, f"{op.name}: no role may run it"
        assert OPERATOR in op.roles, f"{op.name}: an operator may run every operation"
        assert op.roles <= set(ROLES), f"{op.name}: unknown roles {op.roles}"
    handshake = [op for op in OPERATIONS if op.family == "handshake"]
    assert {op.name for op in handshake} == HANDSHAKE
    assert all(op.handler is None and not op.roles for op in handshake)


def test_every_operation_has_a_client_method() -> None:
    calls = client_calls()
    missing = [op.name for op in DISPATCHED if op.name not in calls]
    assert not missing, f"operations without a Client method (one that sends them with self._call): {missing}"
    unknown = sorted(set(calls) - set(OPS))
    assert not unknown, f"Client methods send operations the table does not have: {unknown}"


def test_the_wire_op_list_and_the_role_table_are_the_registry() -> None:
    assert tuple(op.name for op in OPERATIONS) == OPS
    assert len(set(OPS)) == len(OPS)
    # The table as the protocol had it before it was one table: the same names, in the same order, the same rights.
    assert OPS == ("hello", "auth", "ping", "put", "get", "browse", "put_batch", "get_batch", "commit", "backout",
                   "prepare", "resolve", "indoubt", "status", "define", "connections", "logon", "send", "receive", "syncpoint",
                   "set_uow_status", "subscribe", "unsubscribe", "subscriptions", "publish", "receive_pub",
                   "pub_commit", "pub_backout")
    conversations = {"logon", "send", "receive", "syncpoint"}
    operators = {"set_uow_status"}  # ETBCMD SET-UOW-STATUS: the operator's only
    pubsub = {"subscribe", "unsubscribe", "subscriptions", "publish", "receive_pub", "pub_commit", "pub_backout"}
    assert set(OPERATIONS.names("conversation")) == conversations | operators
    assert set(OPERATIONS.names("pubsub")) == pubsub
    assert {
        APPLICATION: frozenset({"ping", "put", "get", "browse", "put_batch", "get_batch", "commit", "backout",
                                "prepare", "resolve", "indoubt"}) | conversations | pubsub,
        OPERATOR: frozenset(OPS) - HANDSHAKE,
    } == ROLE_OPS


def test_each_owner_keeps_its_rows() -> None:
    assert {op.name for op in queue_ops.OPERATIONS} == set(OPERATIONS.names("queue"))
    assert {op.name for op in conversation_ops.OPERATIONS} == set(OPERATIONS.names("conversation"))
    assert {op.name for op in pubsub_ops.OPERATIONS} == set(OPERATIONS.names("pubsub"))
    for module, family in ((queue_ops, "queue"), (conversation_ops, "conversation"), (pubsub_ops, "pubsub")):
        assert all(op.family == family for op in module.OPERATIONS), module.__name__


def test_the_client_treats_a_lost_request_as_its_row_says() -> None:
    assert {"ping", "browse", "status", "connections", "indoubt"} == client.READ_ONLY
    assert {"prepare", "resolve", "define", "set_uow_status"} == client.TAKES_EFFECT_ALONE
    assert set(OPERATIONS.names("conversation")) == client.CONVERSATION_OPS
    assert set(OPERATIONS.names("pubsub")) == client.PUBSUB_OPS


def test_a_bad_table_is_refused_when_it_is_made() -> None:
    def handler(svc: Any, session: Any, args: dict[str, Any]) -> None:
        return None

    with pytest.raises(ValueError, match="twice"):
        Operations([Operation("x", "queue", ANY_ROLE, handler), Operation("x", "queue", ANY_ROLE, handler)])
    with pytest.raises(ValueError, match="handler"):
        Operations([Operation("x", "queue", ANY_ROLE, None)])
    with pytest.raises(ValueError, match="roles"):
        Operations([Operation("x", "queue", frozenset(), handler)])
    with pytest.raises(ValueError, match="roles"):
        Operations([Operation("x", "queue", frozenset({APPLICATION}), handler)])
    with pytest.raises(ValueError, match="unknown roles"):
        Operations([Operation("x", "queue", frozenset({OPERATOR, "root"}), handler)])


# --- the owners' modules stand where their wings will --------------------------------------------------------------
def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (in functions and under TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


@pytest.mark.parametrize("module,forbidden", [
    (operations, ("sqm.service",)),
    (conversation_ops, ("sqm.service", "sqm.pubsub")),
    (pubsub_ops, ("sqm.service", "sqm.conversation")),
], ids=["operations", "conversation_ops", "pubsub_ops"])
def test_the_operation_types_and_the_feature_rows_import_nothing_of_the_service(
        module: types.ModuleType, forbidden: tuple[str, ...]) -> None:
    assert module.__file__ is not None
    bad = sorted(m for m in imported_modules(Path(module.__file__))
                 if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not bad, f"{module.__name__} imports {bad}"


def test_a_subscription_owner_is_bounded_like_a_logon() -> None:
    assert operations.MAX_USER == conversation.MAX_USER


# --- the dispatcher reads the table --------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path: Path) -> SQMServer:
    qm: Any = types.SimpleNamespace(name="QMT")  # refusals read only its name
    return SQMServer(ServerConfig(name="QMT", log_root=tmp_path, token="app-token", operator_token="op-token"),
                     qm=qm)


@pytest.fixture
def executor() -> Any:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=False)


def session_of(role: str, executor: ThreadPoolExecutor) -> Session:
    return Session(1, "127.0.0.1:1", executor, authenticated=True, request_limit=2**20, reply_limit=2**20,
                   peer_ip="127.0.0.1", role=role)


@pytest.mark.parametrize("role", ROLES)
def test_the_role_check_and_the_logon_check_read_the_table(server: SQMServer, executor: ThreadPoolExecutor,
                                                           role: str) -> None:
    for op in DISPATCHED:
        refused = server.refusal(session_of(role, executor), 7, op.name)
        if role not in op.roles:
            assert refused is not None and refused["error"]["type"] == "NotAuthorizedError", op.name
        elif op.needs_logon:
            assert refused is not None and refused["error"]["type"] == "NotLoggedOnError", op.name
        else:
            assert refused is None, (op.name, refused)
    assert {op.name for op in DISPATCHED if op.needs_logon} == {"send", "receive", "syncpoint"}


def test_an_unknown_operation_is_refused_naming_the_table(server: SQMServer, executor: ThreadPoolExecutor) -> None:
    for name in ("nosuch", "hello", "auth"):  # the handshake's are never dispatched
        refused = server.refusal(session_of(OPERATOR, executor), 3, name)
        assert refused is not None and refused["error"]["type"] == "BadRequestError"
        assert refused["error"]["message"].endswith(f"known: {', '.join(OPS)}")


def test_every_row_is_reachable_through_the_service_table() -> None:
    assert ops.OPERATIONS is OPERATIONS
    assert all(OPERATIONS[op.name] is op for op in OPERATIONS)


def test_a_batch_that_fails_whole_names_each_request_s_own_operation(server: SQMServer,
                                                                     executor: ThreadPoolExecutor) -> None:
    """A batch of puts and gets run together (begin_together) that fails as a whole tells each request of its own
    operation: the get hears "get", not the put's name."""
    class Failing:
        def begin(self, calls: Any) -> Any:
            raise RuntimeError("the batch broke")

    server.lifecycles = Failing()  # type: ignore[assignment]
    session = session_of(APPLICATION, executor)
    t = server.begin_together([(session, 1, "put", {"queue": "Q1", "body": b"x", "syncpoint": False}),
                               (session, 2, "get", {"queue": "Q1", "syncpoint": False})])
    assert t.begun is not None
    errors = [e.args[0] for e in t.begun.out if e is not None]
    assert errors[0].startswith("internal error in put: RuntimeError: the batch broke"), errors
    assert errors[1].startswith("internal error in get: RuntimeError: the batch broke"), errors
