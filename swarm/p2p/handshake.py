"""The mutual authentication handshake (wire.py, HELLO and AUTH), as pure functions.

Both sides send HELLO at once, then AUTH as soon as they have the other's HELLO: one round
trip. Each AUTH signs both nonces and both PeerIDs plus the signer's role, so a signature can
be neither replayed on another connection (fresh nonces) nor reflected back (the role byte).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from swarm.p2p.errors import HandshakeError, IdentityError, ProtocolError
from swarm.p2p.identity import Identity, verify_signature
from swarm.p2p.peer_id import KEY_TYPE_ED25519, PeerID, decode_key_protobuf, encode_key_protobuf
from swarm.p2p.wire import AUTH_CONTEXT, NONCE_BYTES, PROTOCOL, Kind, field

DIALER, LISTENER = "dialer", "listener"
PRE_AUTH_MAX_HEAD = 4096  # a HELLO or AUTH is about 150 bytes; nothing bigger is read unauthenticated
MIN_WINDOW, MIN_HEAD, MIN_BODY = 64 * 1024, 4096, 64 * 1024


@dataclass(frozen=True, slots=True)
class Hello:
    public_key: bytes
    peer_id: PeerID
    nonce: bytes
    window: int  # per-stream receive window the sender grants
    max_head: int
    max_body: int
    probe: bool = False  # the dialer only tests reachability: do not keep the connection


def make_hello(
    identity: Identity, *, window: int, max_head: int, max_body: int, probe: bool = False
) -> tuple[dict[str, Any], bytes]:
    nonce = os.urandom(NONCE_BYTES)
    key = encode_key_protobuf(KEY_TYPE_ED25519, identity.public_key)
    fields = {"k": Kind.HELLO, "p": PROTOCOL, "key": key, "n": nonce, "w": window, "h": max_head, "b": max_body}
    if probe:
        fields["probe"] = True
    return fields, nonce


def parse_hello(head: dict[str, Any]) -> Hello:
    if head.get("k") != Kind.HELLO:
        raise HandshakeError("expected a HELLO frame first")
    try:
        protocol = field(head, "p", str)
        if protocol != PROTOCOL:
            raise HandshakeError(f"peer speaks {protocol[:32]!r}, we speak {PROTOCOL!r}")
        key_type, public_key = decode_key_protobuf(field(head, "key", bytes))
        if key_type != KEY_TYPE_ED25519:
            raise HandshakeError(f"peer key type {key_type} is not Ed25519")
        peer_id = PeerID.from_public_key(public_key)
        nonce = field(head, "n", bytes)
        window, max_head, max_body = field(head, "w", int), field(head, "h", int), field(head, "b", int)
    except (ProtocolError, IdentityError) as e:
        raise HandshakeError(f"malformed HELLO: {e}") from None
    if len(nonce) != NONCE_BYTES:
        raise HandshakeError("malformed HELLO: the nonce must have 32 bytes")
    if window < MIN_WINDOW or max_head < MIN_HEAD or max_body < MIN_BODY:
        raise HandshakeError("HELLO announces limits too small to work with")
    probe = head.get("probe") is True
    return Hello(public_key, peer_id, nonce, window, min(max_head, 2**32 - 1), min(max_body, 2**32 - 1), probe)


def auth_message(role: str, dialer_nonce: bytes, listener_nonce: bytes, dialer: PeerID, listener: PeerID) -> bytes:
    role_byte = b"D" if role == DIALER else b"L"
    return AUTH_CONTEXT + role_byte + dialer_nonce + listener_nonce + dialer.to_bytes() + listener.to_bytes()


def check_auth(head: dict[str, Any], remote: Hello, message: bytes) -> None:
    if head.get("k") != Kind.AUTH:
        raise HandshakeError("expected an AUTH frame after HELLO")
    signature = head.get("s")
    if not isinstance(signature, bytes) or not verify_signature(remote.public_key, signature, message):
        raise HandshakeError(f"peer failed to prove it holds the key of {remote.peer_id}")
