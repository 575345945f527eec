"""The handshake (wire.py, HELLO and AUTH, "Handshake and keys"): pure functions and one small
state object, no I/O.

Both sides send HELLO at once, then AUTH as soon as they have the other's HELLO: one round
trip. Each AUTH signs the transcript hash TH of both HELLOs (nonces, ephemeral X25519 keys,
limits, cipher, PeerIDs) plus the signer's role, so a signature can be neither replayed on
another connection (fresh nonces and keys) nor reflected back (the role byte), and a key
swapped on the way is caught. The session keys come from the ephemeral Diffie-Hellman secret
and TH (secure.session_keys).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from swarm.p2p.errors import HandshakeError, IdentityError, ProtocolError
from swarm.p2p.identity import Identity, verify_signature
from swarm.p2p.peer_id import KEY_TYPE_ED25519, PeerID, decode_key_protobuf, encode_key_protobuf
from swarm.p2p.secure import CipherState, session_keys
from swarm.p2p.wire import (
    AUTH_CONTEXT,
    CIPHER_AES256GCM,
    CIPHER_NONE,
    EPHEMERAL_KEY_BYTES,
    NONCE_BYTES,
    PROTOCOL,
    TRANSCRIPT_CONTEXT,
    Kind,
    field,
)

DIALER, LISTENER = "dialer", "listener"
PRE_AUTH_MAX_HEAD = 4096  # a HELLO or AUTH is about 200 bytes; nothing bigger is read unauthenticated
MIN_WINDOW, MIN_HEAD, MIN_BODY = 64 * 1024, 4096, 64 * 1024
CIPHERS = (CIPHER_AES256GCM, CIPHER_NONE)
_LIMITS = struct.Struct(">QQQB")  # w, h, b, probe in hello_bytes


@dataclass(frozen=True, slots=True)
class Hello:
    public_key: bytes
    peer_id: PeerID
    nonce: bytes
    ephemeral: bytes  # X25519 public key of this connection
    cipher: str  # CIPHER_AES256GCM or CIPHER_NONE
    window: int  # per-stream receive window the sender grants
    max_head: int
    max_body: int
    probe: bool = False  # the dialer only tests reachability: do not keep the connection


def make_hello(
    identity: Identity, *, encrypt: bool, window: int, max_head: int, max_body: int, probe: bool = False
) -> tuple[dict[str, Any], X25519PrivateKey]:
    """Our HELLO frame, and the ephemeral private key it announces."""
    ephemeral = X25519PrivateKey.generate()
    fields = {
        "k": Kind.HELLO,
        "p": PROTOCOL,
        "key": encode_key_protobuf(KEY_TYPE_ED25519, identity.public_key),
        "n": os.urandom(NONCE_BYTES),
        "e": ephemeral.public_key().public_bytes_raw(),
        "c": CIPHER_AES256GCM if encrypt else CIPHER_NONE,
        "w": window,
        "h": max_head,
        "b": max_body,
    }
    if probe:
        fields["probe"] = True
    return fields, ephemeral


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
        nonce, ephemeral, cipher = field(head, "n", bytes), field(head, "e", bytes), field(head, "c", str)
        window, max_head, max_body = field(head, "w", int), field(head, "h", int), field(head, "b", int)
    except (ProtocolError, IdentityError) as e:
        raise HandshakeError(f"malformed HELLO: {e}") from None
    if len(nonce) != NONCE_BYTES or len(ephemeral) != EPHEMERAL_KEY_BYTES:
        raise HandshakeError("malformed HELLO: the nonce and the ephemeral key must have 32 bytes")
    if cipher not in CIPHERS:
        raise HandshakeError(f"malformed HELLO: unknown cipher {cipher[:32]!r}")
    if window < MIN_WINDOW or max_head < MIN_HEAD or max_body < MIN_BODY or window >= 2**64:
        raise HandshakeError("HELLO announces limits too small (or too large) to work with")
    probe = head.get("probe") is True
    return Hello(
        public_key, peer_id, nonce, ephemeral, cipher, window, min(max_head, 2**32 - 1), min(max_body, 2**32 - 1), probe
    )


def check_cipher(mine: str, theirs: str) -> None:
    """Both sides must agree: a peer that encrypts never talks in the clear, and back."""
    if mine != theirs:
        raise HandshakeError(
            f"peer's cipher is {theirs!r} but ours is {mine!r}: encryption must be on at both ends"
            " (P2PConfig.encryption)"
        )


def hello_bytes(hello: Hello) -> bytes:
    """One HELLO's part of the transcript (wire.py)."""
    cipher, peer = hello.cipher.encode(), hello.peer_id.to_bytes()
    limits = _LIMITS.pack(hello.window, hello.max_head, hello.max_body, hello.probe)
    return b"".join((hello.nonce, hello.ephemeral, limits, bytes([len(cipher)]), cipher, bytes([len(peer)]), peer))


def transcript_hash(dialer: Hello, listener: Hello) -> bytes:
    return hashlib.sha256(TRANSCRIPT_CONTEXT + hello_bytes(dialer) + hello_bytes(listener)).digest()


def auth_message(role: str, transcript: bytes) -> bytes:
    return AUTH_CONTEXT + (b"D" if role == DIALER else b"L") + transcript


def check_auth(head: dict[str, Any], remote: Hello, message: bytes) -> None:
    if head.get("k") != Kind.AUTH:
        raise HandshakeError("expected an AUTH frame after HELLO")
    signature = head.get("s")
    if not isinstance(signature, bytes) or not verify_signature(remote.public_key, signature, message):
        raise HandshakeError(f"peer failed to prove it holds the key of {remote.peer_id}")


class Handshake:
    """One side's handshake: our HELLO and ephemeral key, then the keys once the peer's HELLO
    is in. The connection sends `hello_fields`, answers the peer's HELLO with on_hello() (our
    AUTH, and the cipher of what we send from then on) and checks its AUTH with on_auth() (the
    cipher of what it sends from then on)."""

    def __init__(
        self, identity: Identity, role: str, *, encrypt: bool, window: int, max_head: int, max_body: int, probe: bool
    ) -> None:
        self.identity = identity
        self.role = role
        self.hello_fields, self._ephemeral = make_hello(
            identity, encrypt=encrypt, window=window, max_head=max_head, max_body=max_body, probe=probe
        )
        self.mine = parse_hello(self.hello_fields)  # read back as the peer reads it: the same TH
        self.remote: Hello | None = None
        self._transcript = b""
        self._receive_key: bytes | None = None

    def on_hello(self, remote: Hello) -> tuple[dict[str, Any], CipherState | None]:
        """Our AUTH frame for the peer's HELLO, and the cipher of the frames we send after it
        (None when both sides turned encryption off)."""
        check_cipher(self.mine.cipher, remote.cipher)
        self.remote = remote
        dialer, listener = (self.mine, remote) if self.role == DIALER else (remote, self.mine)
        self._transcript = transcript_hash(dialer, listener)
        auth = {"k": Kind.AUTH, "s": self.identity.sign(auth_message(self.role, self._transcript))}
        ephemeral, self._ephemeral = self._ephemeral, None  # forward secrecy: used once, then dropped
        if self.mine.cipher == CIPHER_NONE or ephemeral is None:
            return auth, None
        try:
            shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(remote.ephemeral))
        except ValueError:  # a low-order point: the "shared" secret would be all zeros
            raise HandshakeError("peer's ephemeral key is not a usable X25519 key") from None
        to_listener, to_dialer = session_keys(shared, self._transcript)
        send, self._receive_key = (to_listener, to_dialer) if self.role == DIALER else (to_dialer, to_listener)
        return auth, CipherState(send)

    def on_auth(self, head: dict[str, Any]) -> CipherState | None:
        """Check the peer's AUTH (HandshakeError if it fails); the cipher of its later frames."""
        assert self.remote is not None
        their_role = LISTENER if self.role == DIALER else DIALER
        check_auth(head, self.remote, auth_message(their_role, self._transcript))
        key, self._receive_key = self._receive_key, None
        return None if key is None else CipherState(key)
