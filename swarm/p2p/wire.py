"""The swarm wire protocol, version 2. This module is the spec; the code follows it.

Transport: one TCP connection per pair of peers (TCP_NODELAY), multiplexing many calls. The
first frames (HELLO, AUTH) are in the clear; every frame after a side's AUTH is encrypted and
authenticated (see "Encryption" below) unless both peers turned encryption off.

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

    0  HELLO   handshake, first frame of each side, in the clear: ``p`` protocol (PROTOCOL),
               ``key`` libp2p protobuf PublicKey (Ed25519), ``n`` 32-byte random nonce, ``e``
               32-byte X25519 public key made for this connection only, ``c`` cipher
               ("aes256gcm", or "none" from a peer with encryption off: both must say the
               same), ``w`` the credit every stream starts with on this side (its initial
               receive window; more comes in CREDIT as the reader reads), ``h`` the largest
               head it accepts, ``b`` the largest body it accepts; optional ``probe`` true from
               a dialer that only tests whether it can reach the listener (a dial-back,
               autonat.py): the listener does not keep that connection for calls.
    1  AUTH    handshake, second frame of each side, in the clear: ``s`` = Ed25519 signature
               over AUTH_CONTEXT + role (b"D" dialer / b"L" listener) + TH (below). Nothing else
               is accepted before the peer's AUTH verifies; a HELLO/AUTH after that is a
               protocol error.
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
               A receiver grants more only as its reader takes data, within a budget shared
               by all the streams of the connection (budget.py), so credit may come in pieces:
               a sender sends what it was granted, splitting chunks when it must.

Handshake and keys. Both sides send HELLO at once and AUTH as soon as they hold the other's
HELLO: one round trip. This follows Noise XX as libp2p uses it (ephemeral X25519 agreement,
identity keys signing the handshake), with the identities in the clear (a dialer names the
PeerID it dials anyway) and signatures over the whole transcript instead of Noise's hash chain::

    hello_bytes = n (32) || e (32) || u64 w || u64 h || u64 b || u8 probe || u8 len(c) || c
                  || u8 len(peer) || peer      (peer: the PeerID's bytes, from ``key``;
                                                h and b capped at 2**32 - 1 as both sides read them)
    TH          = SHA-256(TRANSCRIPT_CONTEXT || hello_bytes(dialer) || hello_bytes(listener))
    shared      = X25519(own ephemeral private key, peer's ``e``)   (all-zero result: refused)
    k_dl || k_ld = HKDF-SHA256(salt=TH, ikm=shared, info=KEYS_INFO, length=64)

k_dl protects what the dialer sends, k_ld what the listener sends. Each AUTH signs TH, so a
changed nonce, ephemeral key, limit, cipher or PeerID on the way fails the peer's AUTH check
(the man in the middle cannot sign for either identity); the role byte stops reflection, the
fresh nonces and ephemeral keys stop replay. The ephemeral private keys are dropped once the
keys are derived: traffic recorded today stays secret if an identity key leaks later.

Encryption. Every frame a side sends after its own AUTH is one or two AES-256-GCM records; the
8-byte prefix stays in the clear (with the plaintext lengths) and is each record's associated
data::

    prefix (8) || seal(head) (H + 16) || seal(body) (B + 16, only when B > 0)

seal(x) = AES-256-GCM(key, nonce, x, associated data = prefix): ciphertext then 16-byte tag.
Nonce: 4 zero bytes || u64 big-endian record counter. Each direction counts its records from 0
(head record, then body record, frame after frame), so the receiver knows the one nonce the
next record must have: a record modified, replayed, reordered or dropped fails to open, the
receiver logs a ProtocolError and closes the connection, and no byte of it reaches a handler.
A counter never reaches 2**64 - 1: the sender closes the connection first. Once the records
sealed under one key hold REKEY_BYTES of plaintext or more, the next record uses
HMAC-SHA256(key, REKEY_INFO) as its key (the counter runs on); both ends count the same
records, so they switch in lockstep. Frame limits apply to the plaintext lengths. Bodies of
OFFLOAD_BYTES (secure.py) or more are sealed and opened in worker threads, in wire order.
Left visible to an observer: both PeerIDs (HELLO), frame lengths and timing.

Errors: a frame that cannot be parsed, an unknown kind, a missing or mistyped key, a frame over
the announced size limits, a record that fails authentication, or DATA beyond the granted window
is a protocol violation: the receiver logs it and closes the connection. A bad *request*
(unknown method, arguments of the wrong types) is answered with an ERROR frame and the
connection stays up.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

import msgpack

from swarm.p2p.errors import ProtocolError

PROTOCOL = "swarm/2"
AUTH_CONTEXT = b"swarm/2 handshake auth\x00"
TRANSCRIPT_CONTEXT = b"swarm/2 handshake transcript\x00"
KEYS_INFO = b"swarm/2 session keys"
REKEY_INFO = b"swarm/2 rekey"
NONCE_BYTES = 32
EPHEMERAL_KEY_BYTES = 32  # X25519 public key
TAG_BYTES = 16  # AES-GCM tag at the end of each record
NONCE_PAD = bytes(4)  # the record nonce: these 4 zero bytes, then the u64 big-endian counter
CIPHER_AES256GCM = "aes256gcm"  # the HELLO ``c`` of a peer that encrypts (the default)
CIPHER_NONE = "none"  # the HELLO ``c`` of a peer with P2PConfig(encryption=False)
REKEY_BYTES = 2**32  # plaintext bytes under one key (AES-GCM stays far inside its usage bounds)

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
    NO_RESERVATION = "no_reservation"  # a relay asked for a circuit to a peer it holds no reservation for
    CIRCUIT_LIMIT = "circuit_limit"  # a relay closed a circuit at its byte or time limit
    CIRCUIT_CLOSED = "circuit_closed"  # a relay closed a circuit because its other end went away


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
