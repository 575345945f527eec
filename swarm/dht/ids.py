"""Kademlia ids: 160-bit integers; a key's id is the first 20 bytes of SHA-256 over its msgpack form.

Hashing the msgpack form keeps the str key "a" and the bytes key b"a" apart. Node ids come from
PeerID.dht_id (SHA-256 over the PeerID's bytes), so nodes and keys share one id space.
"""

from __future__ import annotations

import hashlib
import random

import msgpack

from swarm.p2p.peer_id import DHT_ID_BITS

ID_BITS = DHT_ID_BITS
ID_BYTES = ID_BITS // 8
ID_SPACE = 1 << ID_BITS

Key = str | bytes


def key_id(key: Key) -> int:
    digest = hashlib.sha256(msgpack.packb(key, use_bin_type=True)).digest()
    return int.from_bytes(digest[:ID_BYTES], "big")


def id_to_bytes(value: int) -> bytes:
    return value.to_bytes(ID_BYTES, "big")


def id_from_bytes(raw: bytes) -> int:
    if len(raw) != ID_BYTES:
        raise ValueError(f"a DHT id is {ID_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def random_id_between(lo: int, hi: int, rng: random.Random | None = None) -> int:
    """A random id in [lo, hi): the target of a bucket refresh."""
    return (rng or random).randrange(lo, hi)
