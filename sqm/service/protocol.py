"""The SQM wire protocol: length-prefixed msgpack frames over TCP (optionally TLS).

A frame is a big-endian u32 body length followed by a msgpack body. A request is a map
``{"id": int, "op": str, "args": map}``; its reply is ``{"id": int, "ok": true, "result": ...}`` or
``{"id": int, "ok": false, "error": {"reason": int, "reason_name": str, "message": str, "type": str}}``.
``type`` names the exception class (cfemu.errors or this module), so a client re-creates the same exception;
``reason`` is the MQ reason code (MQRC_*), which alone does not always tell two classes apart.

A reply to a request the server could not parse has ``id`` nil. A frame longer than the limit is answered with
an error and the connection is closed: the stream cannot be trusted to re-synchronise after it. A frame within
the limit that the member's budget of request bytes in flight cannot take (sqm.service.transport) is answered with
the same error (FrameTooLargeError), with the request's id when the body's first bytes carry it; its body is read
and dropped, so the stream stays in step and the connection goes on.

Frame limits (docs/architecture.md, "Size limits"). Until it has authenticated a peer may send frames of at most
PRE_HELLO_MAX_FRAME bytes, so an unauthenticated peer cannot make the server buffer much. The hello carries the
client's limit (``max_frame``: the longest frame it accepts) and its reply the server's (``max_frame``: the
longest request it accepts; ``reply_frame``: the longest reply it will send on this connection, the smaller of
the two). By default both carry any message a queue can hold (MAX_FRAME). A request the server's limit cannot
carry is refused by the client before it is sent (a put: MessageTooBigForChannelError); a get whose message a
reply could not carry is refused by the CF and takes nothing (TruncatedMessageError); a browse returns the
messages that fit, with ``more`` set when it left some out. Version 2: hello exchanges limits, and browse
returns ``{"messages": [...], "more": bool}``. Version 3: the challenge-response below.

Authentication (version 3; docs/security.md, "The service"). A connection is authenticated by a challenge and
response, so that no credential crosses the wire and a captured handshake cannot be replayed:

  client -> hello  {client, max_frame, version, nonce: 32 random bytes}
  server <- ok     {qmgr, version, max_frame, reply_frame, session, auth: {required, methods, nonce}}
  client -> auth   {role: "application" | "operator", proof: HMAC-SHA256(role's token, transcript("client"))}
  server <- ok     {role, proof: HMAC-SHA256(role's token, transcript("server")), epoch}

The transcript (``auth_transcript``) binds both nonces, the role, the queue manager, the session number, the
client's name and both frame limits: a proof is good for that connection only (the server's nonce is fresh for
each), and the server's proof shows the client that it talks to a holder of the same token. A wrong proof or an
unknown role is answered MQRC_NOT_AUTHORIZED (the same message for both) and the connection closed. The token of
version 2 (``hello {token}``, a bearer credential) is still accepted on a loopback connection or over TLS, and
refused elsewhere: it was sent in clear, off the host. Each role may run its own operations (the roles of each
operation's row: sqm.service.ops).

Conversations (docs/uow.md): ``logon {user, token}`` makes the connection's session (sqm.conversations.conversation), ``send``,
``receive`` and ``syncpoint`` use it (before a logon they are refused with NotLoggedOnError), and it ends, what it
holds backed out, with the connection: a client that reconnects logs on again. Replies on a logged-on connection
carry ``held``: the session holds a unit of work (being sent or received).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import secrets
import socket
import struct
from typing import Any

import msgpack

from cfemu import errors, thread_packer
from cfemu.errors import MessageTooBigError, MQError
from cfemu.limits import DESCRIPTOR_ALLOWANCE, MAX_MSG_LENGTH, MAX_PROPERTIES_LENGTH
from sqm.core.connection import Message
from sqm.operations import APPLICATION, OPERATOR, ROLES, NotLoggedOnError, arg

HEADER = struct.Struct(">I")
PROTOCOL_VERSION = 3
# What a frame holds beside its messages: the request or reply map, its id, op and flags, argument names.
ENVELOPE = 512
# The most of an error's text a reply that delivers a message with its error carries (error_reply).
DELIVERED_TEXT = 240
# The most of any error's text a reply carries: an error may repeat what the request sent (a queue's name, say),
# which is bounded only by the frame; the rest is cut and its length said.
ERROR_TEXT = 2000
# What a Message costs a reply beyond its data and its descriptor as the CF stores it (which already holds the
# ids, in hex, the queue, the entry id and the properties): the field names and fixed-size values.
MESSAGE_COST = 512
# A frame that carries any message a queue can hold (cfemu.limits): the most a server accepts, and the default.
MAX_FRAME = MAX_MSG_LENGTH + DESCRIPTOR_ALLOWANCE + ENVELOPE
DEFAULT_MAX_FRAME = MAX_FRAME
MIN_FRAME = 4096  # the least a server or a client may set: room for the envelope and a small message
PRE_HELLO_MAX_FRAME = 64 * 2**10  # frames a peer may send before it has authenticated

# --- what a request may decode to ------------------------------------------------------------------------------
# A frame's bytes become Python objects, and few bytes can become many: an empty map is one byte on the wire and
# about 70 in memory, so a frame of 30 MB of them decoded to 2 GB, and making and freeing them held the GIL for
# seconds. A request (and any frame a peer sends before it has proven itself) is therefore decoded within bounds
# taken from what the protocol carries, so that what it decodes to stays within a small multiple of its bytes; a
# frame past them is a ProtocolError, found from a container's declared length before anything is made, or once the
# allowance of items is spent.
# The most messages one put_batch or get_batch request carries, and the longest array any request holds (a
# put_batch's messages, an indoubt's xids); their bytes are bounded by the frame, and MAXUMSGS counts each message.
MAX_BATCH = 1_000
# The largest map a request holds: a message's properties, each of which packs to at least 3 bytes (a one-character
# name and a one-byte value) within cfemu.limits.MAX_PROPERTIES_LENGTH.
MAX_REQUEST_MAP = MAX_PROPERTIES_LENGTH // 3
# What a request may hold in all, counted in items (each array and map, each element of an array and each entry of
# a map; at most about 100 bytes of memory each): REQUEST_ITEMS, plus one for every ITEM_BYTES of its frame. That
# carries any batch of MAX_BATCH messages with every field of a put, and properties of a dozen bytes or more each;
# and it keeps a request within about 7 times its bytes (bodies and strings decode to as many bytes as they take).
REQUEST_ITEMS = 32_768
ITEM_BYTES = 16

# --- roles and authentication ----------------------------------------------------------------------------------
AUTH_METHOD = "hmac-sha256"
NONCE_BYTES = 32
PROOF_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def auth_transcript(side: str, *, role: str, server_nonce: bytes, client_nonce: bytes, qmgr: str, session: int,
                    client: str, client_max_frame: int, server_max_frame: int) -> bytes:
    """What a proof signs: which side ("client" or "server") and every detail of this connection's handshake."""
    return msgpack.packb([f"sqm-auth-v{PROTOCOL_VERSION}", side, role, server_nonce, client_nonce, qmgr, session,
                          client, client_max_frame, server_max_frame], use_bin_type=True)


def auth_proof(token: str, transcript: bytes) -> bytes:
    """HMAC-SHA256 of the transcript, keyed with the role's token."""
    return hmac.new(token.encode(), transcript, hashlib.sha256).digest()


def proof_matches(token: str, transcript: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(auth_proof(token, transcript), proof)


class NotAuthorizedError(MQError):
    """The connection did not authenticate (a missing or wrong token)."""

    reason, reason_name = 2035, "MQRC_NOT_AUTHORIZED"


class ConnectionLimitError(MQError):
    """The server refused the connection: one of its connection limits (named in the message) is reached."""

    reason, reason_name = 2025, "MQRC_MAX_CONNS_LIMIT_REACHED"


class FrameTooLargeError(MQError):
    """A frame is longer than the negotiated maximum."""

    reason, reason_name = 2010, "MQRC_DATA_LENGTH_ERROR"


class MessageTooBigForChannelError(MessageTooBigError):
    """A put whose request is longer than the connection's frame limit: refused by the client before anything is
    sent (MQ's client channel MAXMSGL); the queue might hold it, this connection cannot carry it."""

    reason, reason_name = 2218, "MQRC_MSG_TOO_BIG_FOR_CHANNEL"


class ProtocolError(MQError):
    """A frame that is not a well-formed request (not msgpack, not a map, a missing or mistyped field)."""

    reason, reason_name = 2046, "MQRC_OPTIONS_ERROR"


class SessionLostError(MQError):
    """The connection was lost while the client was logged on and held no unit of work: the session ended with it
    (nothing was backed out); log on again."""

    reason, reason_name = 2009, "MQRC_CONNECTION_BROKEN"


class QuiescingError(MQError):
    """The server is shutting down: the request was not carried out."""

    reason, reason_name = 2161, "MQRC_Q_MGR_QUIESCING"


class QueueManagerUnavailableError(MQError):
    """No endpoint of the queue-sharing group accepted a connection."""

    reason, reason_name = 2059, "MQRC_Q_MGR_NOT_AVAILABLE"


def _error_classes() -> dict[str, type[MQError]]:
    found: dict[str, type[MQError]] = {}
    for module_vars in (vars(errors), globals()):
        for name, value in module_vars.items():
            if isinstance(value, type) and issubclass(value, MQError):
                found[name] = value
    return found


ERROR_CLASSES = _error_classes()


# --- frames ------------------------------------------------------------------------------------------------
def encode_frame(obj: Any) -> bytes:
    body = thread_packer.pack(obj)  # the thread's Packer: a reply's frame is packed by its connection's thread
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | bytearray | memoryview) -> Any:
    """Unpack a frame body (where it lies, given a memoryview); anything msgpack cannot read is a ProtocolError.
    Unbounded: for what a peer that has proven itself sends (a member's replies, after the handshake)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None


def request_items(length: int) -> int:
    """The items (arrays, maps, their elements and entries) a frame body of ``length`` bytes may decode to."""
    return REQUEST_ITEMS + length // ITEM_BYTES


class _Items:
    """The allowance of items of one decode, spent as each array or map is made (msgpack's hooks: a container is
    passed once it is whole, so its elements, and the containers inside it, have been counted by then)."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, container: Any) -> Any:
        self.left -= len(container) + 1
        if self.left < 0:
            raise _TooManyItems
        return container


class _TooManyItems(Exception):
    pass


def decode_request(body: bytes | bytearray | memoryview) -> Any:
    """Unpack the body of a frame from a peer not trusted with the member's memory (any request; a server's reply
    before it has proven itself), within the bounds above: a ProtocolError, in time bounded by the allowance, for a
    frame that holds more than a request carries."""
    length = len(body)
    bounds: dict[str, Any] = {"max_array_len": MAX_BATCH, "max_map_len": MAX_REQUEST_MAP, "max_ext_len": 0,
                              "max_str_len": length, "max_bin_len": length}
    allowed = request_items(length)
    if length > allowed:  # each item takes at least a byte: a shorter body cannot hold more than its allowance
        items = _Items(allowed)
        bounds["object_hook"] = bounds["list_hook"] = items.spend
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, **bounds)
    except _TooManyItems:
        raise ProtocolError(f"frame of {length} bytes holds more than the {allowed} arrays, maps and their "
                            f"elements a request of its length may (at most {REQUEST_ITEMS} and one for every "
                            f"{ITEM_BYTES} bytes)") from None
    except ValueError as e:  # msgpack's bounds: "<n> exceeds max_array_len(<limit>)" and the like
        if "exceeds max_" in str(e):
            raise ProtocolError(f"frame holds more than a request carries: {e} (at most {MAX_BATCH} elements in an "
                                f"array, {MAX_REQUEST_MAP} entries in a map, no extension types)") from None
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
    except Exception as e:  # msgpack raises several unrelated types (ExtraData, FormatError, StackError, ...)
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None


def check_length(length: int, max_frame: int, why: str = "") -> None:
    if length > max_frame:
        raise FrameTooLargeError(f"frame of {length} bytes exceeds the limit of {max_frame} bytes{why}")


async def read_frame_length(reader: asyncio.StreamReader, max_frame: int, why: str = "") -> int | None:
    """The next frame's length from its header, or None at a clean end of stream (between frames). A frame longer
    than max_frame raises FrameTooLargeError here, before its body is read (``why`` says which limit applied)."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    (length,) = HEADER.unpack(head)
    check_length(length, max_frame, why)
    return int(length)


async def read_frame(reader: asyncio.StreamReader, max_frame: int, why: str = "") -> bytes | None:
    """The next frame's body, or None at a clean end of stream (between frames). A longer frame is refused from
    its header, before its body is read (``why`` says which limit applied)."""
    length = await read_frame_length(reader, max_frame, why)
    return None if length is None else await reader.readexactly(length)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the server")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_frame: int, *, trusted: bool = True) -> Any:
    """The next frame from a blocking socket, decoded (within a request's bounds unless the peer is ``trusted``)."""
    (length,) = HEADER.unpack(recv_exactly(sock, HEADER.size))
    check_length(length, max_frame)
    body = recv_exactly(sock, length)
    return decode_body(body) if trusted else decode_request(body)


def recv_frame_length(sock: socket.socket, buf: bytearray, max_frame: int, chunk: int = 65536) -> int | None:
    """The next frame's length from a blocking socket, reading ahead into buf (kept by the caller: it holds the
    header and whatever came after it), or None at a clean end of stream between frames. A frame longer than
    max_frame raises FrameTooLargeError here, before its body is read."""
    while len(buf) < HEADER.size:
        got = sock.recv(chunk)
        if not got:
            if buf:
                raise ConnectionError("the peer closed the connection in the middle of a frame")
            return None
        buf += got
    (length,) = HEADER.unpack_from(buf)
    check_length(length, max_frame)
    return int(length)


def recv_until(sock: socket.socket, buf: bytearray, end: int, chunk: int) -> None:
    """Read from a blocking socket into buf until it holds ``end`` bytes (``chunk`` at most a recv)."""
    while len(buf) < end:
        got = sock.recv(chunk)
        if not got:
            raise ConnectionError("the peer closed the connection in the middle of a frame")
        buf += got


# --- requests and replies ----------------------------------------------------------------------------------
def parse_request(obj: Any) -> tuple[int, str, dict[str, Any]]:
    """(id, op, args) of a decoded request; a malformed one raises ProtocolError (with the id when known)."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a request must be a map, not {type(obj).__name__}")
    rid = obj.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("a request needs an integer 'id'")
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError(f"request {rid}: 'op' must be a string")
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(f"request {rid}: 'args' must be a map, not {type(args).__name__}")
    return rid, op, args


def ok_reply(rid: int | None, result: Any, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, "result": result, **extra}


def error_reply(rid: int | None, exc: MQError, **extra: Any) -> dict[str, Any]:
    """The reply to a request refused by ``exc``. An error that delivered a message all the same (a get whose commit
    is pending: OutcomePendingError.message) carries it in "delivered", in the reply's own form of it."""
    message = str(exc.args[0]) if exc.args else ""
    if len(message) > ERROR_TEXT:
        message = f"{message[:ERROR_TEXT]}...({len(message)} chars)"
    error: dict[str, Any] = {"reason": exc.reason, "reason_name": exc.reason_name, "message": message,
                             "type": type(exc).__name__}
    delivered = getattr(exc, "message", None)
    if dataclasses.is_dataclass(delivered) and not isinstance(delivered, type):
        error["delivered"] = {f.name: getattr(delivered, f.name) for f in dataclasses.fields(delivered)}
        # The get was bounded to the reply's room for one message (ENVELOPE): the text must not crowd it out, or
        # the reply would be refused and the message consumed for nobody.
        error["message"] = str(message)[:DELIVERED_TEXT]
    return {"id": rid, "ok": False, "error": error, **extra}


def error_from_wire(err: Any) -> MQError:
    """Re-create the exception a reply describes (by class name, else a generic MQError with its reason)."""
    if not isinstance(err, dict):
        return ProtocolError(f"malformed error reply: {err!r}")
    message = str(err.get("message", ""))
    cls = ERROR_CLASSES.get(str(err.get("type", "")))
    if cls is not None and cls.__init__ is MQError.__init__:
        known = cls(message)
        if isinstance(err.get("delivered"), dict):  # its wire form: the call that raises it reads it as it would
            known.message = err["delivered"]  # type: ignore[attr-defined]
        return known
    exc = MQError(message)
    exc.reason = int(err.get("reason", MQError.reason))
    exc.reason_name = str(err.get("reason_name", MQError.reason_name))
    return exc


# --- messages ------------------------------------------------------------------------------------------------
# A message's fields, read once: dataclasses.asdict (a recursive deep copy) and fields() per message cost about as
# much CPU as the rest of a request's handling (bench/profile_service.py; BENCHMARKS.md, "peers"). The wire form is
# a shallow map: it is packed at once.
_MESSAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Message))
_MESSAGE_NAMES = frozenset(_MESSAGE_FIELDS)


def message_to_wire(m: Message) -> dict[str, Any]:
    return {name: getattr(m, name) for name in _MESSAGE_FIELDS}


def message_from_wire(obj: dict[str, Any]) -> Message:
    """The Message a reply's map describes; fields this side does not know (a newer server's) are left out."""
    if obj.keys() <= _MESSAGE_NAMES:  # the usual case, checked in C: no map made again
        return Message(**obj)
    return Message(**{k: v for k, v in obj.items() if k in _MESSAGE_NAMES})


__all__ = ["APPLICATION", "AUTH_METHOD", "DEFAULT_MAX_FRAME", "ENVELOPE", "ERROR_CLASSES", "NONCE_BYTES", "OPERATOR",
           "ROLES", "ConnectionLimitError", "FrameTooLargeError", "HEADER", "MAX_FRAME",
           "MAX_BATCH", "MAX_REQUEST_MAP", "MESSAGE_COST", "MIN_FRAME", "MessageTooBigForChannelError", "NotAuthorizedError", "NotLoggedOnError",
           "SessionLostError",
           "ITEM_BYTES", "PRE_HELLO_MAX_FRAME", "PROOF_BYTES", "PROTOCOL_VERSION", "REQUEST_ITEMS", "auth_proof", "auth_transcript", "new_nonce", "proof_matches", "ProtocolError", "QueueManagerUnavailableError",
           "QuiescingError", "arg", "check_length", "decode_body", "decode_request", "encode_frame", "error_from_wire", "error_reply",
           "message_from_wire", "message_to_wire", "ok_reply", "parse_request", "read_frame", "read_frame_length",
           "recv_frame", "recv_frame_length", "recv_until", "request_items"]
