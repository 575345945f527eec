"""The DHT's RPCs, as a spec: method names, argument and reply shapes, and their parsers.

Every request carries "a": the sender's announced multiaddrs, or None for a node in client mode
(it asks but does not serve; nobody adds it to a routing table), and "n": the 8-byte nonce that
proves the sender's DHT id (id_proof.py: node_id = SHA-256(domain || PeerID || nonce)[:20],
valid when SHA-256(node_id) has DHTConfig.id_bits leading zero bits). The sender's PeerID is the
authenticated one of the connection, never a field. A contact (a peer as the DHT passes it on)
is [peer_id_bytes, [maddr...], nonce].

    dht.ping   {"a": addrs, "n": nonce}
           ->  {"a": addrs, "n": nonce}
    dht.find   {"a": addrs, "n": nonce, "id": bytes20, "key"?: key, "peers"?: bool}
           ->  {"peers"?: [[peer_id_bytes, [maddr...], nonce], ...],
                "records"?: [[subkey, value, expiration, signature], ...]}
    dht.store  {"a": addrs, "n": nonce, "records": [[key, subkey, value, expiration, signature], ...], "cache"?: bool}
           ->  {"results": ["ok" | error code, ...]}

find returns up to k peers closest to "id" (never the asker) and, when "key" is given, the live
records this node holds (or caches) for it; with "peers": false, a node that returns records
leaves the peers out (the asker stops at the first holder). store answers each record on its own: "ok", or the
code of the RecordError that refused it (errors.RECORD_ERRORS). Requests of the wrong shape get
the p2p layer's bad_request error.

Proofs are checked by every receiver before it trusts an id: a sender whose "n" is missing or
does not prove an id is served but never added to a routing table, and a contact in a find
reply whose nonce does not prove its id is dropped (the rest of the reply is kept) and logged
once per peer. Nodes of one DHT must agree on id_bits: a node refuses ids weaker than its own.
"""

from __future__ import annotations

import functools
from typing import Any

from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
from swarm.dht.freshest import FreshestRecords
from swarm.dht.id_proof import BadIdProof, verify
from swarm.dht.ids import ID_BYTES, Key, id_from_bytes
from swarm.dht.records import Record
from swarm.dht.routing import Contact
from swarm.p2p.errors import BadRequest, IdentityError
from swarm.p2p.peer_id import PeerID

PING = "dht.ping"
FIND = "dht.find"
STORE = "dht.store"
OK = "ok"


def parse_addrs(args: Any, config: DHTConfig) -> tuple[str, ...] | None:
    """The sender's announced maddrs from a request or reply; None means client mode."""
    if not isinstance(args, dict):
        raise BadRequest("arguments must be a map")
    addrs = args.get("a")
    if addrs is None:
        return None
    return check_maddrs(addrs, config)


def parse_sender_id(args: dict[str, Any], peer_id: PeerID, config: DHTConfig) -> Contact | None:
    """The sender of a request (or of a ping reply) as a contact whose id proof checks out;
    None for a node in client mode. BadIdProof when it announces addresses without a valid proof."""
    addrs = parse_addrs(args, config)
    if addrs is None:
        return None
    nonce = args.get("n")
    return Contact(peer_id, addrs, verify(peer_id, nonce, config.id_bits), nonce)


def proves_id(nonce: Any, peer_id: PeerID, config: DHTConfig) -> bool:
    try:
        verify(peer_id, nonce, config.id_bits)
    except BadIdProof:
        return False
    return True


def check_maddrs(addrs: Any, config: DHTConfig) -> tuple[str, ...]:
    return _checked_maddrs(addrs, config.max_maddrs_per_peer, config.max_maddr_chars)


def _checked_maddrs(addrs: Any, max_maddrs: int, max_chars: int) -> tuple[str, ...]:
    if not isinstance(addrs, list | tuple) or len(addrs) > max_maddrs:
        raise BadRequest(f"addresses must be a list of at most {max_maddrs}")
    for addr in addrs:
        if not isinstance(addr, str) or not addr.startswith("/") or len(addr) > max_chars:
            raise BadRequest(f"an address must be a multiaddr string of at most {max_chars} chars")
    return tuple(addrs)


def parse_find(args: dict[str, Any], config: DHTConfig) -> tuple[int, Key | None]:
    raw_id = args.get("id")
    if not isinstance(raw_id, bytes) or len(raw_id) != ID_BYTES:
        raise BadRequest(f"find needs an id of {ID_BYTES} bytes")
    key = args.get("key")
    if key is not None and (not isinstance(key, str | bytes) or len(key) > config.max_key_bytes):
        raise BadRequest(f"a key must be str or bytes of at most {config.max_key_bytes} bytes")
    return id_from_bytes(raw_id), key


def encode_contacts(contacts: list[Contact]) -> list[list[Any]]:
    return [[c.peer_id.to_bytes(), list(c.maddrs), c.nonce] for c in contacts]


def decode_contacts(items: Any, config: DHTConfig) -> tuple[list[Contact], list[tuple[PeerID, str]]]:
    """Peers from a find reply: (contacts whose id proofs check out, [(peer, why) dropped]).
    A malformed entry makes the whole reply bad (BadRequest, ProtocolError upstream)."""
    if not isinstance(items, list) or len(items) > config.k:
        raise BadRequest(f"peers must be a list of at most k={config.k}")
    contacts, dropped = [], []
    limits = (config.id_bits, config.max_maddrs_per_peer, config.max_maddr_chars)
    for item in items:
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], bytes):
            raise BadRequest("a peer is [peer_id_bytes, [maddr...], nonce]")
        raw, addrs, nonce = item
        try:
            try:
                peer_id, maddrs, node_id = _known_contact(raw, tuple(addrs) if isinstance(addrs, list) else addrs,
                                                          nonce, *limits)  # fmt: skip
            except TypeError:  # an unhashable address or nonce: checked without the cache (refused or dropped)
                peer_id, maddrs, node_id = _checked_contact(raw, addrs, nonce, *limits)
        except BadIdProof as e:
            dropped.append((PeerID(raw), str(e)))
            continue
        contacts.append(Contact(peer_id, maddrs, node_id, nonce))
    return contacts, dropped


def _checked_contact(
    raw: bytes, addrs: Any, nonce: Any, id_bits: int, max_maddrs: int, max_chars: int
) -> tuple[PeerID, tuple[str, ...], int]:
    """A contact's PeerID, addresses and proven id: BadRequest for a malformed one, BadIdProof
    for a nonce that proves no id."""
    try:
        peer_id = PeerID(raw)
    except IdentityError as e:
        raise BadRequest(f"bad peer id: {e}") from None
    maddrs = _checked_maddrs(addrs, max_maddrs, max_chars)
    return peer_id, maddrs, verify(peer_id, nonce, id_bits)


# The same few hundred contacts come back in every find reply, about twenty to a reply: parsing
# their ids and addresses again was a tenth of a 16-node swarm's event loop. What checked out
# once checks out again (a pure function of these arguments); failures raise and are not kept,
# and a peer that sends new contacts only pushes older ones out. At most 4,096 entries of at
# most a few KiB (an id, the addresses DHTConfig allows): a bounded cost whoever sends them.
_known_contact = functools.lru_cache(maxsize=1 << 12)(_checked_contact)


def encode_found(records: list[Record]) -> list[list[Any]]:
    return [[r.subkey, r.value, r.expiration, r.signature] for r in records]


def decode_found(
    key: Key, items: Any, config: DHTConfig, now: float, found: FreshestRecords | None = None
) -> tuple[list[Record], bool]:
    """Records a peer returned for `key` that are fresher than those `found` holds, each
    validated as if it were being stored here: a peer cannot make us return a forged, oversized
    or expired record. Copies of found records (every holder of a key returns the same) are
    skipped unvalidated: they could not replace what is held. Also whether the peer returned any
    record that validated or was such a copy: it holds the key."""
    if not isinstance(items, list) or len(items) > config.max_subkeys_per_key:
        raise BadRequest(f"records must be a list of at most {config.max_subkeys_per_key}")
    records, holds = [], False
    for item in items:
        if not isinstance(item, list) or len(item) != 4:
            raise BadRequest("a found record is [subkey, value, expiration, signature]")
        try:
            record = Record.from_wire([key, *item])
            if found is not None and not found.newer(record.subkey, record.expiration):
                holds = True
                continue
            record.validate(config, now)
        except RecordError:
            continue  # expired in transit, or a bad peer: skip this record, keep the rest
        records.append(record)
        holds = True
    return records, holds


def parse_store(args: dict[str, Any], config: DHTConfig) -> tuple[list[Any], bool]:
    items = args.get("records")
    if not isinstance(items, list) or not 0 < len(items) <= config.max_store_batch:
        raise BadRequest(f"store needs a list of 1 to {config.max_store_batch} records")
    return items, bool(args.get("cache", False))
