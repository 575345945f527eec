"""The DHT's RPCs, as a spec: method names, argument and reply shapes, and their parsers.

Every request carries "a": the sender's announced multiaddrs, or None for a node in client mode
(it asks but does not serve; nobody adds it to a routing table). The sender's PeerID is the
authenticated one of the connection, never a field.

    dht.ping   {"a": addrs}
           ->  {"a": addrs}
    dht.find   {"a": addrs, "id": bytes20, "key"?: key, "peers"?: bool}
           ->  {"peers"?: [[peer_id_bytes, [maddr...]], ...], "records"?: [[subkey, value, expiration, signature], ...]}
    dht.store  {"a": addrs, "records": [[key, subkey, value, expiration, signature], ...], "cache"?: bool}
           ->  {"results": ["ok" | error code, ...]}

find returns up to k peers closest to "id" (never the asker) and, when "key" is given, the live
records this node holds (or caches) for it; with "peers": false, a node that returns records
leaves the peers out (the asker stops at the first holder). store answers each record on its own: "ok", or the
code of the RecordError that refused it (errors.RECORD_ERRORS). Requests of the wrong shape get
the p2p layer's bad_request error.
"""

from __future__ import annotations

from typing import Any

from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
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


def check_maddrs(addrs: Any, config: DHTConfig) -> tuple[str, ...]:
    if not isinstance(addrs, list | tuple) or len(addrs) > config.max_maddrs_per_peer:
        raise BadRequest(f"addresses must be a list of at most {config.max_maddrs_per_peer}")
    for addr in addrs:
        if not isinstance(addr, str) or not addr.startswith("/") or len(addr) > config.max_maddr_chars:
            raise BadRequest(f"an address must be a multiaddr string of at most {config.max_maddr_chars} chars")
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
    return [[c.peer_id.to_bytes(), list(c.maddrs)] for c in contacts]


def decode_contacts(items: Any, config: DHTConfig) -> list[tuple[PeerID, tuple[str, ...]]]:
    """Peers from a find reply; malformed entries are a bad reply (ProtocolError upstream)."""
    if not isinstance(items, list) or len(items) > config.k:
        raise BadRequest(f"peers must be a list of at most k={config.k}")
    peers = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], bytes):
            raise BadRequest("a peer is [peer_id_bytes, [maddr...]]")
        try:
            peer_id = PeerID(item[0])
        except IdentityError as e:
            raise BadRequest(f"bad peer id: {e}") from None
        peers.append((peer_id, check_maddrs(item[1], config)))
    return peers


def encode_found(records: list[Record]) -> list[list[Any]]:
    return [[r.subkey, r.value, r.expiration, r.signature] for r in records]


def decode_found(key: Key, items: Any, config: DHTConfig, now: float) -> list[Record]:
    """Records a peer returned for `key`, each validated as if it were being stored here: a
    peer cannot make us return a forged, oversized or expired record."""
    if not isinstance(items, list) or len(items) > config.max_subkeys_per_key:
        raise BadRequest(f"records must be a list of at most {config.max_subkeys_per_key}")
    records = []
    for item in items:
        if not isinstance(item, list) or len(item) != 4:
            raise BadRequest("a found record is [subkey, value, expiration, signature]")
        try:
            record = Record.from_wire([key, *item])
            record.validate(config, now)
        except RecordError:
            continue  # expired in transit, or a bad peer: skip this record, keep the rest
        records.append(record)
    return records


def parse_store(args: dict[str, Any], config: DHTConfig) -> tuple[list[Any], bool]:
    items = args.get("records")
    if not isinstance(items, list) or not 0 < len(items) <= config.max_store_batch:
        raise BadRequest(f"store needs a list of 1 to {config.max_store_batch} records")
    return items, bool(args.get("cache", False))
