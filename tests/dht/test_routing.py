"""The routing table on its own (no network): buckets split as in the Kademlia paper (§2.2, §2.4),
least-recently-seen eviction through a ping, and closest() against a brute-force sort."""

from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.dht.ids import ID_BITS, ID_SPACE
from swarm.dht.routing import RoutingTable
from swarm.p2p.peer_id import PeerID

ADDR = ("/ip4/127.0.0.1/tcp/1",)


def random_peer(rng: random.Random | None = None) -> PeerID:
    return PeerID.from_public_key(rng.randbytes(32) if rng else os.urandom(32))


def peers_where(predicate, count: int, rng: random.Random | None = None) -> list[PeerID]:
    """PeerIDs whose DHT id satisfies predicate: DHT ids are hashes, so generate and pick."""
    found: list[PeerID] = []
    for _ in range(200 * count + 1000):
        peer = random_peer(rng)
        if predicate(peer.dht_id):
            found.append(peer)
            if len(found) == count:
                return found
    raise AssertionError("could not generate enough peers with the wanted ids")


def top_bit(node_id: int) -> int:
    return node_id >> (ID_BITS - 1)


def far_bucket_peers(own_id: int, count: int) -> list[PeerID]:
    """Peers in the half of the id space that does not hold own_id: one bucket after the first split."""
    return peers_where(lambda i: top_bit(i) != top_bit(own_id), count)


def full_far_bucket(k: int = 3) -> tuple[RoutingTable, list[PeerID]]:
    """A table whose far half [not own's top bit] is one full bucket of k contacts."""
    own = random_peer()
    table = RoutingTable(own.dht_id, k)
    peers = far_bucket_peers(own.dht_id, k)
    near = peers_where(lambda i: top_bit(i) == top_bit(own.dht_id), 1)
    for peer in peers:
        assert table.add(peer, ADDR, now=1.0) is None
    assert table.add(near[0], ADDR, now=1.0) is None  # k + 1 contacts: the first bucket splits
    assert len(table.buckets) >= 2
    bucket = table.bucket_for(peers[0].dht_id)
    assert list(bucket.contacts) == peers and not bucket.covers(own.dht_id)
    return table, peers


# --- splitting --------------------------------------------------------------------------------


def check_partition(table: RoutingTable) -> None:
    buckets = table.buckets
    assert buckets[0].lo == 0 and buckets[-1].hi == ID_SPACE
    for left, right in itertools.pairwise(buckets):
        assert left.hi == right.lo, "gap or overlap between buckets"
    for bucket in buckets:
        size = bucket.hi - bucket.lo
        assert size > 0 and size & (size - 1) == 0 and bucket.lo % size == 0, "not a prefix bucket"
        assert len(bucket.contacts) <= table.k
        assert len(bucket.replacements) <= table.k
        assert all(bucket.covers(c.node_id) for c in bucket.contacts.values())
        assert all(bucket.covers(c.node_id) for c in bucket.replacements.values())
    assert sum(b.covers(table.own_id) for b in buckets) == 1
    assert [b.lo for b in buckets] == table._lows


@pytest.mark.parametrize("k", [1, 2, 5, 20])
def test_buckets_partition_the_id_space_and_only_the_own_bucket_split(k: int) -> None:
    rng = random.Random(k)
    own = random_peer(rng)
    table = RoutingTable(own.dht_id, k)
    added = [random_peer(rng) for _ in range(600)]
    for peer in added:
        table.add(peer, ADDR, now=0.0)
        assert table.bucket_for(peer.dht_id).covers(peer.dht_id)
    check_partition(table)
    # Only the bucket covering our id ever splits, so every other bucket is the sibling of a
    # bucket on the path to our id: its parent range covers our id.
    for bucket in table.buckets:
        if not bucket.covers(own.dht_id):
            size = bucket.hi - bucket.lo
            parent_lo = bucket.lo - bucket.lo % (2 * size)
            assert parent_lo <= own.dht_id < parent_lo + 2 * size, "a bucket off our path was split"
    assert len(table.buckets) > 2  # 600 ids with small k do split the table several times
    # What each bucket holds: the first k peers that arrived in its range (a bucket covering our
    # id splits instead of refusing, so nothing that arrived early was ever dropped).
    for bucket in table.buckets:
        arrived = [p for p in added if bucket.covers(p.dht_id)]
        assert list(bucket.contacts) == arrived[:k]
        assert set(bucket.replacements) == set(arrived[k:][-k:])
    assert len(table) == sum(min(k, sum(b.covers(p.dht_id) for p in added)) for b in table.buckets)


def test_own_id_is_never_added() -> None:
    me = random_peer()
    table = RoutingTable(me.dht_id, 20)
    assert table.add(me, ADDR, now=0.0) is None
    assert len(table) == 0 and me not in table and table.get(me) is None
    other = random_peer()
    table.add(other, ADDR, now=0.0)
    assert table.add(me, ADDR, now=1.0) is None
    assert [c.peer_id for c in table.contacts()] == [other]
    assert table.closest(me.dht_id, 5) == table.closest(me.dht_id, 5, exclude=me)


# --- a full bucket that does not cover our id ---------------------------------------------------


def test_full_far_bucket_asks_to_ping_the_least_recently_seen() -> None:
    table, peers = full_far_bucket(k=3)
    bucket = table.bucket_for(peers[0].dht_id)
    newcomer = peers_where(bucket.covers, 1)[0]
    stale = table.add(newcomer, ADDR, now=2.0)
    assert stale is not None and stale.peer_id == peers[0]
    assert newcomer not in table and list(bucket.contacts) == peers
    assert list(bucket.replacements) == [newcomer]
    assert bucket.pinging == peers[0]
    # one ping per bucket at a time: a second newcomer waits in the replacements too
    second = peers_where(bucket.covers, 1)[0]
    assert table.add(second, ADDR, now=3.0) is None
    assert list(bucket.replacements) == [newcomer, second]


def test_failed_ping_evicts_the_stale_contact_and_promotes_the_newcomer() -> None:
    table, peers = full_far_bucket(k=3)
    bucket = table.bucket_for(peers[0].dht_id)
    newcomer = peers_where(bucket.covers, 1)[0]
    stale = table.add(newcomer, ("/ip4/127.0.0.1/tcp/7",), now=2.0)
    assert stale is not None
    table.ping_failed(stale.peer_id)
    assert stale.peer_id not in table
    assert list(bucket.contacts) == [*peers[1:], newcomer]  # the newcomer is now most recent
    assert table.get(newcomer).maddrs == ("/ip4/127.0.0.1/tcp/7",)
    assert not bucket.replacements and bucket.pinging is None
    # the bucket is full again and its least recently seen is now peers[1]
    third = peers_where(bucket.covers, 1)[0]
    stale = table.add(third, ADDR, now=3.0)
    assert stale is not None and stale.peer_id == peers[1]


def test_successful_ping_keeps_the_stale_contact_and_the_newcomer_stays_out() -> None:
    table, peers = full_far_bucket(k=3)
    bucket = table.bucket_for(peers[0].dht_id)
    newcomer = peers_where(bucket.covers, 1)[0]
    stale = table.add(newcomer, ADDR, now=2.0)
    assert stale is not None
    table.ping_succeeded(stale.peer_id, now=5.0)
    assert newcomer not in table
    assert list(bucket.contacts) == [*peers[1:], peers[0]]  # moved to most recently seen
    assert table.get(peers[0]).last_seen == 5.0
    assert bucket.pinging is None
    assert newcomer in bucket.replacements  # a later failure may still promote it
    stale = table.add(peers_where(bucket.covers, 1)[0], ADDR, now=6.0)
    assert stale is not None and stale.peer_id == peers[1]


def test_removing_a_contact_promotes_the_most_recent_replacement() -> None:
    table, peers = full_far_bucket(k=3)
    bucket = table.bucket_for(peers[0].dht_id)
    first, second = peers_where(bucket.covers, 2)
    table.add(first, ADDR, now=2.0)
    table.add(second, ADDR, now=3.0)
    assert table.remove(peers[1]) is True
    assert list(bucket.contacts) == [peers[0], peers[2], second]
    assert list(bucket.replacements) == [first]
    assert table.remove(peers[1]) is False  # already gone: nothing else changes
    assert list(bucket.contacts) == [peers[0], peers[2], second]


def test_readding_keeps_least_recently_seen_order() -> None:
    own = random_peer()
    table = RoutingTable(own.dht_id, 4)
    a, b, c = far_bucket_peers(own.dht_id, 3)
    for i, peer in enumerate((a, b, c)):
        table.add(peer, ADDR, now=float(i))
    table.add(a, (), now=10.0)  # heard from again, with no addresses: keeps the known ones
    bucket = table.bucket_for(a.dht_id)
    assert list(bucket.contacts) == [b, c, a]
    assert table.get(a).last_seen == 10.0 and table.get(a).maddrs == ADDR
    table.add(b, ("/ip4/127.0.0.1/tcp/9",), now=11.0)
    assert list(bucket.contacts) == [c, a, b]
    assert table.get(b).maddrs == ("/ip4/127.0.0.1/tcp/9",)
    assert len(table) == 3


def test_readding_a_contact_of_a_full_bucket_needs_no_ping() -> None:
    table, peers = full_far_bucket(k=3)
    assert table.add(peers[0], ADDR, now=9.0) is None
    bucket = table.bucket_for(peers[0].dht_id)
    assert list(bucket.contacts) == [peers[1], peers[2], peers[0]] and not bucket.replacements
    stale = table.add(peers_where(bucket.covers, 1)[0], ADDR, now=10.0)
    assert stale is not None and stale.peer_id == peers[1]


# --- closest ----------------------------------------------------------------------------------

peer_lists = st.lists(
    st.binary(min_size=32, max_size=32).map(PeerID.from_public_key), min_size=0, max_size=120, unique=True
)


@settings(max_examples=60, deadline=None)
@given(
    own=st.binary(min_size=32, max_size=32).map(PeerID.from_public_key),
    peers=peer_lists,
    target=st.integers(0, ID_SPACE - 1),
    count=st.integers(0, 30),
    k=st.sampled_from([2, 5, 200]),
)
def test_closest_matches_brute_force(own: PeerID, peers: list[PeerID], target: int, count: int, k: int) -> None:
    table = RoutingTable(own.dht_id, k)
    for peer in peers:
        table.add(peer, ADDR, now=0.0)
    known = [c.peer_id for c in table.contacts()]
    if k == 200:  # nothing was dropped: the table knows every peer but ourselves
        assert sorted(known) == sorted(p for p in peers if p != own)
    expected = sorted(known, key=lambda p: p.dht_id ^ target)[:count]
    got = [c.peer_id for c in table.closest(target, count)]
    assert got == expected
    if known:
        excluded = known[len(known) // 2]
        expected = sorted((p for p in known if p != excluded), key=lambda p: p.dht_id ^ target)[:count]
        assert [c.peer_id for c in table.closest(target, count, exclude=excluded)] == expected


def test_closest_on_a_seeded_large_table() -> None:
    rng = random.Random(7)
    own = random_peer(rng)
    table = RoutingTable(own.dht_id, 20)
    for _ in range(2000):
        table.add(random_peer(rng), ADDR, now=0.0)
    known = [c.peer_id for c in table.contacts()]
    assert len(known) > 100
    for _ in range(50):
        target = rng.randrange(ID_SPACE)
        count = rng.randrange(1, 40)
        got = table.closest(target, count)
        assert [c.peer_id for c in got] == sorted(known, key=lambda p: p.dht_id ^ target)[:count]
        assert len(got) == count
    some = known[3]
    assert table.closest(some.dht_id, 1)[0].peer_id == some
    assert table.closest(some.dht_id, 1, exclude=some)[0].peer_id != some
