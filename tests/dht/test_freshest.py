"""What a get does with find replies, checked without a network: FreshestRecords (the merge of
one get's records) keeps what RecordStorage would; a reply's copies of records already held are
skipped before validation yet still mark a holder; contacts decoded from the cache equal fresh
ones, and bad ones are refused every time."""

from __future__ import annotations

import time

import pytest

from swarm.dht import DHTConfig, Record, owner_subkey
from swarm.dht.errors import RecordError
from swarm.dht.freshest import FreshestRecords
from swarm.dht.id_proof import node_id_of
from swarm.dht.protocol import decode_contacts, decode_found, encode_found
from swarm.dht.records import pack_value
from swarm.dht.storage import RecordStorage
from swarm.p2p import BadRequest, Identity

NOW = 1_000_000.0
BIG = 1 << 30

# (subkey, expiration) in the order they arrive -> the (subkey, expiration) kept
CASES = [
    ("one record", [("a", 10)], {("a", 10)}),
    ("a later one replaces", [("a", 10), ("a", 20)], {("a", 20)}),
    ("an earlier one does not", [("a", 20), ("a", 10)], {("a", 20)}),
    ("an equal one keeps the first", [("a", 10), ("a", 10)], {("a", 10)}),
    ("subkeys add up", [("a", 10), ("b", 5), ("c", 30)], {("a", 10), ("b", 5), ("c", 30)}),
    ("a plain value expiring after the dictionary replaces it", [("a", 10), ("b", 20), (None, 25)], {(None, 25)}),
    ("a plain value expiring before part of it does not", [("a", 10), ("b", 20), (None, 15)], {("a", 10), ("b", 20)}),
    ("a subkey replaces a plain value it outlives", [(None, 10), ("a", 11)], {("a", 11)}),
    ("a subkey no later than the plain value does not", [(None, 10), ("a", 10)], {(None, 10)}),
    ("plain values by expiration", [(None, 10), (None, 30), (None, 20)], {(None, 30)}),
]


def record(subkey: str | None, expiration: float) -> Record:
    return Record("key", subkey, pack_value(f"{subkey}@{expiration}"), NOW + expiration)


def kept(records: list[Record]) -> set[tuple[str | None, float]]:
    return {(r.subkey, r.expiration - NOW) for r in records}  # type: ignore[misc]


@pytest.mark.parametrize(("arrivals", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_freshest_records_are_what_a_store_would_keep(
    arrivals: list[tuple[str | None, float]], expected: set[tuple[str | None, float]]
) -> None:
    records = [record(s, e) for s, e in arrivals]
    merged = FreshestRecords(records)
    store = RecordStorage(BIG, BIG)
    for r in records:
        try:
            store.put(r, NOW)
        except RecordError:
            pass
    assert kept(merged.records(NOW)) == expected == kept(store.get("key", NOW))


def test_newer_is_false_only_for_a_copy_or_an_older_version() -> None:
    merged = FreshestRecords([record("a", 10)])
    assert not merged.newer("a", NOW + 10) and not merged.newer("a", NOW + 5)
    assert merged.newer("a", NOW + 11) and merged.newer("b", NOW + 1) and merged.newer(None, NOW + 1)
    assert FreshestRecords([record("a", 10)]).records(NOW + 10) == []  # expired at `now`: not returned


def test_a_found_reply_skips_copies_unvalidated_yet_marks_a_holder() -> None:
    config, now = DHTConfig(), time.time()
    owner = Identity.generate()
    mine = Record.create("key", owner_subkey(owner.peer_id), {"step": 3}, now + 60, owner)
    held = FreshestRecords([mine])
    # every holder returns the same records: a copy adds nothing and is not checked again
    records, holds = decode_found("key", encode_found([mine]), config, now, held)
    assert records == [] and holds
    # a copy with a broken signature (a liar's) changes nothing either: it could not replace ours
    broken = [[mine.subkey, mine.value, mine.expiration, b"\x00" * 64]]
    assert decode_found("key", broken, config, now, held) == ([], True)
    # a fresher record is validated: a forged one is refused and marks no holder
    forged = [[mine.subkey, pack_value({"step": 9}), now + 90, b"\x00" * 64]]
    assert decode_found("key", forged, config, now, held) == ([], False)
    newer = Record.create("key", owner_subkey(owner.peer_id), {"step": 4}, now + 90, owner)
    assert decode_found("key", encode_found([newer]), config, now, held) == ([newer], True)
    # without records found yet (a node that holds none of the key), everything is validated
    assert decode_found("key", broken, config, now) == ([], False)


def test_contacts_decode_the_same_from_the_cache_and_bad_ones_are_refused_every_time() -> None:
    config = DHTConfig(id_bits=0)
    peer = Identity.generate().peer_id
    nonce = b"\x01" * 8
    good = [peer.to_bytes(), ["/ip4/127.0.0.1/tcp/1"], nonce]
    for _ in range(2):  # the second from the cache: a fresh, equal contact
        (contact,), dropped = decode_contacts([good], config)
        assert (contact.peer_id, contact.maddrs, contact.nonce) == (peer, ("/ip4/127.0.0.1/tcp/1",), nonce)
        assert contact.node_id == node_id_of(peer, nonce) and not dropped
    strict = DHTConfig(id_bits=30)  # the same contact under a DHT that asks more of an id: dropped
    contacts, dropped = decode_contacts([good], strict)
    assert contacts == [] and [p for p, _ in dropped] == [peer]
    assert decode_contacts([[peer.to_bytes(), ["/ip4/127.0.0.1/tcp/1"], [1]]], config)[0] == []  # unhashable nonce
    for bad_addrs in ([{"x": 1}], [["/ip4"]], "/ip4/127.0.0.1/tcp/1", ["no-slash"]):
        for _ in range(2):
            with pytest.raises(BadRequest, match="address"):
                decode_contacts([[peer.to_bytes(), bad_addrs, nonce]], config)
