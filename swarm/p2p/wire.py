"""The swarm wire protocol, version 1. This module is the spec; the code follows it.

Transport: one TCP connection per pair of peers (TCP_NODELAY), multiplexing many calls.

Frame (every byte on the wire after the TCP connect is part of a frame)::

    offset  size  field
    0       4     head_len   u32 big-endian: length of the msgpack head
    4       4     body_len   u32 big-endian: length of the raw body (0 for most frames)
    8       H     head       msgpack map (string keys) -- see the kinds below
    8+H     B     body       raw bytes, only in DATA frames (tensor chunks travel here, so a
                             receiver reads them straight into their final buffer: no msgpack
                             copy, no per-element work)

Head keys: ``k`` frame kind (int), ``i`` call id (u32). The peer that dialed the connection
numbers its calls with odd ids, the peer that accepted it with even ids, so a frame's id alone
says whose call it belongs to and both sides can call each other on one connection.

Kinds (``k``) and their other keys:

    0  HELLO   handshake, first frame of each side: ``p`` protocol (PROTOCOL), ``key`` libp2p
               protobuf PublicKey (Ed25519), ``n`` 32-byte random nonce, ``w`` the per-stream
               receive window this side grants, ``h`` the largest head it accepts, ``b`` the
               largest body it accepts; optional ``probe`` true from a dialer that only tests
               whether it can reach the listener (a dial-back, autonat.py): the listener does
               not keep that connection for calls.
    1  AUTH    handshake, second frame of each side: ``s`` = Ed25519 signature over
               AUTH_CONTEXT + role (b"D" dialer / b"L" listener) + dialer nonce + listener nonce
               + dialer PeerID bytes + listener PeerID bytes. Nothing else is accepted before
               both AUTH frames verify; a HELLO/AUTH after that is a protocol error.
    2  CALL    start a call: ``m`` method name (str, e.g. ``dht.find``), ``a`` arguments (any
               msgpack value), ``s`` true for a stream call (both sides may then send DATA and
               END), false for a unary call (answered by one REPLY or ERROR).
    3  REPLY   result of a unary call: ``r`` (any msgpack value).
    4  ERROR   a call failed: ``c`` error code (ErrorCode), ``e`` message (str). Ends the call,
               stream or not, in both directions.
    5  DATA    one chunk of a stream call, in the body. Counts against the receiver's window.
    6  END     the sender will send no more DATA on this call (half-close). A stream call is
               finished when both sides sent END, or either sent ERROR or CANCEL.
    7  CANCEL  the caller gives up the call (its timeout passed, or it closed the stream); the
               callee stops the handler and sends nothing more for it.
    8  CREDIT  flow control: ``n`` more body bytes the sender of CREDIT is ready to receive on
               this stream. Each side starts with the window the other announced in HELLO.

Errors: a frame that cannot be parsed, an unknown kind, a missing or mistyped key, a frame over
the announced size limits, or DATA beyond the granted window is a protocol violation: the
receiver logs it and closes the connection. A bad *request* (unknown method, arguments of the
wrong types) is answered with an ERROR frame and the connection stays up.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

import msgpack

from swarm.p2p.errors import ProtocolError

PROTOCOL = "swarm/1"
AUTH_CONTEXT = b"swarm/1 handshake auth\x00"
NONCE_BYTES = 32

FRAME_PREFIX = struct.Struct(">II")  # head_len, body_len
PREFIX_BYTES = FRAME_PREFIX.size
MAX_METHOD_CHARS = 128
MAX_ERROR_MESSAGE_CHARS = 4096
MAX_CALL_ID = 2**32 - 1


class Kind(IntEnum):
    HELLO = 0
    AUTH = 1
    CALL = 2
    REPLY = 3
    ERROR = 4
    DATA = 5
    END = 6
    CANCEL = 7
    CREDIT = 8


class ErrorCode:
    """Codes carried by ERROR frames (strings, so new codes stay readable by old peers)."""

    UNKNOWN_METHOD = "unknown_method"  # no handler registered under that name
    BAD_REQUEST = "bad_request"  # arguments of the wrong types, sizes or values
    BUSY = "busy"  # the callee is at its limit of concurrent calls
    NOT_FOUND = "not_found"  # the callee does not hold what was asked for (any more)
    TOO_LARGE = "too_large"  # a reply would exceed the caller's limits
    TIMEOUT = "timeout"  # the callee's own deadline for the handler passed
    CANCELLED = "cancelled"  # the callee is shutting down
    INTERNAL = "internal"  # the handler failed unexpectedly (the callee logs the traceback)


def encode_head(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def decode_head(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode and minimally check a head: a map with an int kind and an int call id."""
    try:
        head = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"frame head is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"frame head is a {type(head).__name__}, not a map")
    kind = head.get("k")
    if type(kind) is not int or not Kind.HELLO <= kind <= Kind.CREDIT:
        raise ProtocolError(f"frame has an unknown kind {kind!r}")
    call_id = head.get("i", 0)
    if type(call_id) is not int or not 0 <= call_id <= MAX_CALL_ID:
        raise ProtocolError(f"frame has a bad call id {call_id!r}")
    return head


def field(head: dict[str, Any], key: str, expected: type | tuple[type, ...]) -> Any:
    """A typed field of a head, or ProtocolError naming it."""
    value = head.get(key)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ProtocolError(f"{Kind(head['k']).name} frame: field {key!r} is missing or mistyped")
    return value
