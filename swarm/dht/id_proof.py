"""Costly DHT ids: S/Kademlia's static crypto puzzle, bound to the PeerID.

A node's Kademlia id is not a plain hash of its PeerID (anyone could grind key pairs until one
lands next to a chosen key: 21,000 keys in 3 s). It is

    node_id = first 20 bytes of SHA-256(ID_DOMAIN || peer_id_bytes || nonce)

and it is valid only if SHA-256(node_id) starts with `bits` zero bits (DHTConfig.id_bits). Each
nonce tried costs two SHA-256 of a few dozen bytes, so a valid id costs 2^bits tries on
average (bits = 20: about a second of one core with hashlib), while checking one costs two
hashes (a few microseconds). Because the id is the hash, an attacker cannot pick where a valid
id lands: an id within b bits of a target key costs 2^(b + bits) tries instead of 2^b.
(Baumgart and Mies, "S/Kademlia: A practicable approach towards secure key-based routing",
2007, section 4.1; we hash the PeerID and a nonce as the issue asked, so one key pair can move
its id only by paying for a new puzzle.)

The nonce travels with every contact (protocol.py) and is found once per identity: saved in a
small file next to the identity file (load_or_solve), or solved at start in a worker thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from swarm.dht.ids import ID_BYTES
from swarm.p2p.peer_id import PeerID
from swarm.utils.atomic import write_atomic

logger = logging.getLogger(__name__)

ID_DOMAIN = b"swarm-dht-id/1\x00"
NONCE_BYTES = 8  # a big-endian counter; 2^64 tries is far beyond any difficulty we accept
MAX_ID_BITS = 32  # the check reads the first 4 bytes of the digest
PROOF_FILE_SUFFIX = ".dht-id"  # next to the identity file: bootstrap.key -> bootstrap.key.dht-id
_MAX_PROOF_FILE_BYTES = 1024


class BadIdProof(ValueError):
    """A contact's nonce is missing, malformed, or does not meet the required difficulty."""


def node_id_of(peer_id: PeerID, nonce: bytes) -> int:
    """The Kademlia id that (peer_id, nonce) names; says nothing about whether it is valid."""
    digest = hashlib.sha256(ID_DOMAIN + peer_id.to_bytes() + nonce).digest()
    return int.from_bytes(digest[:ID_BYTES], "big")


def leading_zero_bits(node_id: int) -> int:
    digest = hashlib.sha256(node_id.to_bytes(ID_BYTES, "big")).digest()
    value = int.from_bytes(digest, "big")
    return 256 - value.bit_length()


def verify(peer_id: PeerID, nonce: object, bits: int) -> int:
    """The node id proven by nonce, or BadIdProof. Two SHA-256 of ~60 bytes: microseconds."""
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise BadIdProof(f"an id proof is a nonce of {NONCE_BYTES} bytes")
    return _proven_id(peer_id, nonce, bits)


# The same few hundred contacts come back in every lookup's answers: a node of a 16-node swarm
# checked 275,000 proofs in a run, a sixth of its event loop's time. A proof that held once holds
# for good (it is a pure function of these three), so the proven ids are kept, a bounded number:
# a peer that sends new proofs only pushes older ones out. Failed proofs are not kept (an
# exception is never cached).
@functools.lru_cache(maxsize=1 << 14)
def _proven_id(peer_id: PeerID, nonce: bytes, bits: int) -> int:
    node_id = node_id_of(peer_id, nonce)
    if bits and leading_zero_bits(node_id) < bits:
        raise BadIdProof(f"id of {peer_id} does not have {bits} leading zero bits")
    return node_id


def solve(peer_id: PeerID, bits: int, stop: threading.Event | None = None) -> bytes:
    """Search nonces 0, 1, 2, ... until one proves an id with `bits` leading zero bits.
    CPU-bound for about 2^bits tries: call it in a worker thread. `stop` aborts the search
    (a node closed while solving), raising InterruptedError."""
    if not 0 <= bits <= MAX_ID_BITS:
        raise ValueError(f"id bits must be in [0, {MAX_ID_BITS}], got {bits}")
    prefix = hashlib.sha256(ID_DOMAIN + peer_id.to_bytes())
    sha256 = hashlib.sha256
    limit = 1 << (32 - bits)  # the first 4 bytes of SHA-256(node_id) must be below this
    counter = 0
    while True:
        for counter in range(counter, counter + 65536):  # noqa: B020  (a batch between checks of stop)
            nonce = counter.to_bytes(NONCE_BYTES, "big")
            attempt = prefix.copy()
            attempt.update(nonce)
            if int.from_bytes(sha256(attempt.digest()[:ID_BYTES]).digest()[:4], "big") < limit:
                return nonce
        counter += 1
        if stop is not None and stop.is_set():
            raise InterruptedError("id proof search stopped")


def proof_path_for(identity_path: str | os.PathLike[str]) -> Path:
    """Where the nonce of the identity at identity_path is kept."""
    path = Path(identity_path)
    return path.with_name(path.name + PROOF_FILE_SUFFIX)


def load_or_solve(path: Path, peer_id: PeerID, bits: int, stop: threading.Event | None = None) -> bytes:
    """The nonce saved at path if it still proves a valid id for peer_id (the identity or the
    difficulty may have changed since), else a new one, solved and saved (atomically)."""
    try:
        with open(path, "rb") as f:
            saved = json.loads(f.read(_MAX_PROOF_FILE_BYTES))
        if saved.get("peer_id") == str(peer_id):
            nonce = bytes.fromhex(saved["nonce"])
            verify(peer_id, nonce, bits)
            return nonce
        logger.warning("id proof file %s belongs to another identity: solving a new one", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # unreadable, or too weak now
        logger.warning("id proof file %s is not usable (%s): solving a new one", path, e)
    nonce = solve(peer_id, bits, stop)
    write_atomic(path, json.dumps({"peer_id": str(peer_id), "nonce": nonce.hex(), "bits": bits}).encode())
    return nonce
