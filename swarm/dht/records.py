"""Records: what the DHT stores, their wire form, owner markers and signatures.

A record is (key, subkey, value, expiration, signature). `value` is the msgpack form of the
user's value, so nodes store and sign opaque bytes. `subkey` is None for a plain value.

Owned records: a subkey (or, for a plain value, the key) that starts with `[owner:<PeerID>]`
may only be written by that PeerID. Its record must carry an Ed25519 signature by the key the
PeerID inlines, over SIGNING_DOMAIN + msgpack([key, subkey, value, expiration]). A replay of an
older signed record cannot replace a newer one because the newer expiration always wins.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack

from swarm.dht.config import DHTConfig
from swarm.dht.errors import BadRecord, BadSignature, ExpirationOutOfRange, ValueTooLarge
from swarm.dht.ids import Key
from swarm.dht.ttl_caps import max_ttl_for
from swarm.p2p.errors import IdentityError
from swarm.p2p.identity import Identity, verify_signature
from swarm.p2p.peer_id import PeerID

OWNER_PREFIX = "[owner:"
SIGNING_DOMAIN = b"swarm-dht-record/1\x00"


def owner_subkey(peer_id: PeerID, name: str = "") -> str:
    """A subkey that only `peer_id` may write, e.g. for "who is ready for step N"."""
    return f"{OWNER_PREFIX}{peer_id}]{name}"


def owner_of(field: Key | None) -> PeerID | None:
    """The PeerID a key or subkey names as its owner, None when unowned; BadRecord if malformed."""
    if isinstance(field, bytes):
        if not field.startswith(OWNER_PREFIX.encode()):
            return None
        try:
            field = field.decode("ascii")
        except UnicodeDecodeError:
            raise BadRecord("owner marker is not ASCII") from None
    if not isinstance(field, str) or not field.startswith(OWNER_PREFIX):
        return None
    end = field.find("]", len(OWNER_PREFIX))
    if end < 0:
        raise BadRecord("owner marker has no closing ']'")
    try:
        return PeerID.from_base58(field[len(OWNER_PREFIX) : end])
    except IdentityError as e:
        raise BadRecord(f"owner marker does not hold a PeerID: {e}") from None


def record_owner(key: Key, subkey: Key | None) -> PeerID | None:
    return owner_of(subkey) if subkey is not None else owner_of(key)


def signing_message(key: Key, subkey: Key | None, value: bytes, expiration: float) -> bytes:
    return SIGNING_DOMAIN + msgpack.packb([key, subkey, value, float(expiration)], use_bin_type=True)


def pack_value(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRecord(f"value cannot be serialized with msgpack: {e}") from None


def unpack_value(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


@dataclass(frozen=True, slots=True)
class Record:
    key: Key
    subkey: Key | None
    value: bytes  # msgpack form of the user's value
    expiration: float  # absolute, seconds since the epoch (time.time())
    signature: bytes | None = None

    @classmethod
    def create(
        cls, key: Key, subkey: Key | None, value: Any, expiration: float, identity: Identity | None = None
    ) -> Record:
        """A record of a user's value, signed by `identity` when key or subkey names it as owner."""
        packed = pack_value(value)
        owner = record_owner(key, subkey)
        signature = None
        if owner is not None:
            if identity is None or owner != identity.peer_id:
                raise BadSignature(f"only {owner} can write this record; this node is not it")
            signature = identity.sign(signing_message(key, subkey, packed, expiration))
        return cls(key, subkey, packed, float(expiration), signature)

    def to_wire(self) -> list[Any]:
        return [self.key, self.subkey, self.value, self.expiration, self.signature]

    @classmethod
    def from_wire(cls, item: Any) -> Record:
        """Parse the wire form, checking types only (validate() checks the rest)."""
        if not isinstance(item, list | tuple) or len(item) != 5:
            raise BadRecord("a record is a list [key, subkey, value, expiration, signature]")
        key, subkey, value, expiration, signature = item
        if not isinstance(key, str | bytes):
            raise BadRecord("a key must be str or bytes")
        if subkey is not None and not isinstance(subkey, str | bytes):
            raise BadRecord("a subkey must be str, bytes or None")
        if not isinstance(value, bytes):
            raise BadRecord("a value must travel as bytes")
        if isinstance(expiration, bool) or not isinstance(expiration, int | float):
            raise BadRecord("an expiration must be a number")
        if signature is not None and not isinstance(signature, bytes):
            raise BadRecord("a signature must be bytes or None")
        return cls(key, subkey, value, float(expiration), signature)

    def validate(self, config: DHTConfig, now: float) -> None:
        """Raise a RecordError subclass unless this record may be stored at time `now`."""
        if len(msgpack.packb(self.key, use_bin_type=True)) > config.max_key_bytes:
            raise BadRecord(f"key longer than {config.max_key_bytes} bytes")
        if self.subkey is not None and len(msgpack.packb(self.subkey, use_bin_type=True)) > config.max_subkey_bytes:
            raise BadRecord(f"subkey longer than {config.max_subkey_bytes} bytes")
        if len(self.value) > config.max_value_bytes:
            raise ValueTooLarge(f"value of {len(self.value)} bytes exceeds {config.max_value_bytes}")
        try:
            unpack_value(self.value)  # a value nobody can read must not break readers' get()
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise BadRecord(f"value is not valid msgpack: {type(e).__name__}") from None
        if not math.isfinite(self.expiration) or self.expiration <= now:
            raise ExpirationOutOfRange("record is already expired")
        max_ttl = max_ttl_for(self.key, config)
        if self.expiration > now + max_ttl + config.max_clock_skew:
            raise ExpirationOutOfRange(f"expiration more than {max_ttl:.0f}s ahead")
        owner = record_owner(self.key, self.subkey)
        if owner is None:
            if self.signature is not None:
                raise BadRecord("signature on a record that names no owner")
            return
        if self.signature is None:
            raise BadSignature(f"record owned by {owner} is not signed")
        message = signing_message(self.key, self.subkey, self.value, self.expiration)
        seen = hashlib.sha256(owner.to_bytes() + self.signature + message).digest()
        if seen in _VERIFIED:  # the same record again (every holder returns it): verified once
            _VERIFIED.move_to_end(seen)
            return
        try:
            public_key = owner.public_key()
        except IdentityError as e:
            raise BadSignature(f"owner {owner} has no inlined Ed25519 key: {e}") from None
        if not verify_signature(public_key, self.signature, message):
            raise BadSignature(f"signature does not verify for owner {owner}")
        _VERIFIED[seen] = None
        if len(_VERIFIED) > MAX_VERIFIED:
            _VERIFIED.popitem(last=False)


# Digests of (owner, signature, signed message) that verified. A lookup with `latest` reads a
# record from every one of the k holders, and matchmaking polls: without this, one outer step
# of 64 nodes checked ~500,000 Ed25519 signatures (scripts/bench/scale.py). Only successes are
# kept, so a forged record is checked (and refused) every time.
MAX_VERIFIED = 1 << 16
_VERIFIED: OrderedDict[bytes, None] = OrderedDict()


@dataclass(frozen=True, slots=True)
class ValueWithExpiration:
    """What get() returns: a value and its expiration. For a key with subkeys, `value` is a dict
    {subkey: ValueWithExpiration} and `expiration` the latest of theirs (as in hivemind)."""

    value: Any
    expiration: float
