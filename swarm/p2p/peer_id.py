"""PeerID: the libp2p peer id of an Ed25519 public key.

As in the libp2p peer-id spec: the public key is protobuf-encoded as
``PublicKey { required KeyType Type = 1; required bytes Data = 2; }`` (KeyType Ed25519 = 1),
and because that encoding is at most 42 bytes it is wrapped in an *identity* multihash
(code 0x00, then the length) instead of being hashed. The text form is base58btc
(``12D3KooW...`` for Ed25519). Ids of other key types (sha2-256 multihash) parse and compare,
but only Ed25519 ids can yield a public key.
"""

from __future__ import annotations

import functools
import hashlib

import base58

from swarm.p2p.errors import IdentityError

KEY_TYPE_ED25519 = 1
ED25519_KEY_BYTES = 32
_MULTIHASH_IDENTITY = 0x00
_MULTIHASH_SHA2_256 = 0x12
_MAX_INLINE_KEY = 42  # libp2p inlines keys whose protobuf encoding is at most 42 bytes
_MAX_PEER_ID_TEXT = 128
DHT_ID_BITS = 160


def encode_key_protobuf(key_type: int, data: bytes) -> bytes:
    """Protobuf encoding of libp2p's PublicKey/PrivateKey message (two required fields)."""
    if len(data) >= 128:
        raise IdentityError(f"key data of {len(data)} bytes is longer than we encode")
    return bytes([0x08, key_type, 0x12, len(data)]) + data


def decode_key_protobuf(blob: bytes) -> tuple[int, bytes]:
    """Inverse of encode_key_protobuf; strict: exactly the two fields, nothing after them."""
    if len(blob) < 4 or blob[0] != 0x08 or blob[2] != 0x12 or blob[1] >= 0x80:
        raise IdentityError("not a libp2p key protobuf (expected fields Type=1, Data=2)")
    length = blob[3]
    if length >= 0x80 or len(blob) != 4 + length:
        raise IdentityError(f"libp2p key protobuf has a bad length: {len(blob)} bytes in all")
    return blob[1], bytes(blob[4:])


@functools.total_ordering
class PeerID:
    """The id of a node: a multihash over its public key. Immutable, hashable, ordered by bytes."""

    __slots__ = ("_bytes", "_dht_id", "_hash", "_text")

    def __init__(self, multihash: bytes) -> None:
        _check_multihash(multihash)
        self._bytes = bytes(multihash)
        self._text: str | None = None  # base58 costs ~40 µs; DHT replies decode many ids never printed
        self._dht_id: int | None = None
        self._hash = hash(self._bytes)  # ids are dict keys everywhere in the DHT

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        """PeerID of a raw 32-byte Ed25519 public key."""
        if len(public_key) != ED25519_KEY_BYTES:
            raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
        encoded = encode_key_protobuf(KEY_TYPE_ED25519, public_key)
        return cls(bytes([_MULTIHASH_IDENTITY, len(encoded)]) + encoded)

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        if not isinstance(text, str) or not 0 < len(text) <= _MAX_PEER_ID_TEXT:
            raise IdentityError(f"not a PeerID: {str(text)[:64]!r}")
        return _from_base58(text)

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._text is None:
            self._text = base58.b58encode(self._bytes).decode("ascii")
        return self._text

    def public_key(self) -> bytes:
        """The raw Ed25519 public key this id inlines; IdentityError for hashed ids."""
        if self._bytes[0] != _MULTIHASH_IDENTITY:
            raise IdentityError(f"{self} is a hashed id: the public key is not inlined")
        key_type, data = decode_key_protobuf(self._bytes[2:])
        if key_type != KEY_TYPE_ED25519 or len(data) != ED25519_KEY_BYTES:
            raise IdentityError(f"{self} is not an Ed25519 key id (key type {key_type})")
        return data

    @property
    def dht_id(self) -> int:
        """The 160-bit Kademlia id: the first 20 bytes of SHA-256 over the id's bytes."""
        if self._dht_id is None:
            digest = hashlib.sha256(self._bytes).digest()
            self._dht_id = int.from_bytes(digest[: DHT_ID_BITS // 8], "big")
        return self._dht_id

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and self._bytes == other._bytes

    def __lt__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[PeerID], tuple[bytes]]:
        return PeerID, (self._bytes,)


# Records name their owners in base58 (subkeys, keys), and every read of a key validates each
# record again: decoding took a tenth of a sixteen-node swarm's event loop (profiled). A PeerID is
# immutable, so the decoded ones are kept, a bounded number; a bad text is never kept.
@functools.lru_cache(maxsize=1 << 14)
def _from_base58(text: str) -> PeerID:
    try:
        raw = base58.b58decode(text)
    except ValueError as e:
        raise IdentityError(f"not a PeerID (bad base58): {text[:64]!r}") from e
    return PeerID(raw)


def _check_multihash(raw: bytes) -> None:
    if len(raw) < 2:
        raise IdentityError("not a PeerID: too short")
    code, length = raw[0], raw[1]
    if code == _MULTIHASH_IDENTITY:
        if not 0 < length <= _MAX_INLINE_KEY or len(raw) != 2 + length:
            raise IdentityError("not a PeerID: bad identity multihash length")
    elif code == _MULTIHASH_SHA2_256:
        if length != 32 or len(raw) != 34:
            raise IdentityError("not a PeerID: bad sha2-256 multihash length")
    else:
        raise IdentityError(f"not a PeerID: unsupported multihash code 0x{code:02x}")
