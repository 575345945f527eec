"""The Kademlia routing table: k-buckets over the 160-bit id space, split as in the paper.

A bucket covers ids [lo, hi) and holds at most k contacts, least recently seen first. A full
bucket that covers our own id splits in two; any other full bucket keeps its contacts: the
newcomer waits in the bucket's replacement cache while the least recently seen contact is
pinged, and takes its place only if that ping fails (old contacts that stay up are the most
likely to stay up longer: the paper's argument). The table itself does no I/O: add() returns
the contact to ping and the node reports the outcome.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from swarm.dht.ids import ID_SPACE
from swarm.p2p.peer_id import PeerID


@dataclass(slots=True)
class Contact:
    """A peer as the DHT knows it: its PeerID, addresses, and its Kademlia id with the nonce
    that proves it (id_proof.py; checked before a contact is built from a peer's word)."""

    peer_id: PeerID
    maddrs: tuple[str, ...]
    node_id: int
    nonce: bytes = b""
    last_seen: float = 0.0


@dataclass(slots=True)
class KBucket:
    lo: int
    hi: int
    contacts: OrderedDict[PeerID, Contact] = field(default_factory=OrderedDict)  # least recently seen first
    replacements: OrderedDict[PeerID, Contact] = field(default_factory=OrderedDict)
    last_updated: float = 0.0
    pinging: PeerID | None = None  # the stale contact being pinged, at most one per bucket

    def covers(self, node_id: int) -> bool:
        return self.lo <= node_id < self.hi

    def depth(self) -> int:
        """How many leading bits all ids in this bucket share."""
        return 160 - (self.hi - self.lo).bit_length() + 1


class RoutingTable:
    def __init__(self, own_id: int, k: int) -> None:
        self.own_id = own_id
        self.k = k
        self.buckets: list[KBucket] = [KBucket(0, ID_SPACE)]
        self._lows: list[int] = [0]  # bucket lower bounds, sorted, for bisect
        self._ids: dict[PeerID, int] = {}  # node id of every peer in a bucket or its replacements

    def __len__(self) -> int:
        return sum(len(b.contacts) for b in self.buckets)

    def __contains__(self, peer_id: PeerID) -> bool:
        return self.get(peer_id) is not None

    def get(self, peer_id: PeerID) -> Contact | None:
        node_id = self._ids.get(peer_id)
        return None if node_id is None else self.bucket_for(node_id).contacts.get(peer_id)

    def node_id_of(self, peer_id: PeerID) -> int | None:
        """The id this table holds for peer_id (a contact or a replacement), if any."""
        return self._ids.get(peer_id)

    def bucket_index(self, node_id: int) -> int:
        return bisect.bisect_right(self._lows, node_id) - 1

    def bucket_for(self, node_id: int) -> KBucket:
        return self.buckets[self.bucket_index(node_id)]

    def contacts(self) -> list[Contact]:
        return [c for bucket in self.buckets for c in bucket.contacts.values()]

    def add(
        self,
        peer_id: PeerID,
        maddrs: tuple[str, ...],
        now: float | None = None,
        *,
        node_id: int | None = None,
        nonce: bytes = b"",
        own_word: bool = True,
    ) -> Contact | None:
        """Record that we heard from peer_id at node_id (its proof already checked by the
        caller; None: the plain hash PeerID.dht_id, for tables outside a DHT). Returns a stale
        contact the caller should ping (then call ping_failed or ping_succeeded), or None. A
        known peer that announces another id itself (own_word) moves there; another peer's word
        (a find reply) cannot move it: a proof solved for someone else's PeerID moves nothing."""
        node_id = peer_id.dht_id if node_id is None else node_id
        if node_id == self.own_id:
            return None
        known = self._ids.get(peer_id)
        if known is not None and known != node_id:
            if not own_word:
                return None
            self.remove(peer_id)
        now = time.monotonic() if now is None else now
        while True:
            bucket = self.bucket_for(node_id)
            contact = bucket.contacts.get(peer_id)
            if contact is not None:
                contact.last_seen = now
                if maddrs:
                    contact.maddrs = maddrs
                bucket.contacts.move_to_end(peer_id)
                bucket.last_updated = now
                return None
            if len(bucket.contacts) < self.k:
                bucket.contacts[peer_id] = Contact(peer_id, maddrs, node_id, nonce, now)
                bucket.replacements.pop(peer_id, None)
                bucket.last_updated = now
                self._ids[peer_id] = node_id
                return None
            if bucket.covers(self.own_id):
                self._split(bucket)
                continue
            bucket.replacements.pop(peer_id, None)
            bucket.replacements[peer_id] = Contact(peer_id, maddrs, node_id, nonce, now)
            self._ids[peer_id] = node_id
            while len(bucket.replacements) > self.k:
                dropped, _ = bucket.replacements.popitem(last=False)
                self._ids.pop(dropped, None)
            if bucket.pinging is not None:
                return None
            stale = next(iter(bucket.contacts.values()))
            bucket.pinging = stale.peer_id
            return stale

    def ping_succeeded(self, peer_id: PeerID, now: float | None = None) -> None:
        node_id = self._ids.get(peer_id)
        if node_id is None:
            return
        bucket = self.bucket_for(node_id)
        if bucket.pinging == peer_id:
            bucket.pinging = None
        contact = bucket.contacts.get(peer_id)
        if contact is not None:
            contact.last_seen = time.monotonic() if now is None else now
            bucket.contacts.move_to_end(peer_id)

    def ping_failed(self, peer_id: PeerID) -> None:
        node_id = self._ids.get(peer_id)
        if node_id is None:
            return
        bucket = self.bucket_for(node_id)
        if bucket.pinging == peer_id:
            bucket.pinging = None
        self.remove(peer_id)

    def remove(self, peer_id: PeerID) -> bool:
        """Drop a peer that failed; its bucket's most recent replacement takes the slot."""
        node_id = self._ids.pop(peer_id, None)
        if node_id is None:
            return False
        bucket = self.bucket_for(node_id)
        if bucket.pinging == peer_id:
            bucket.pinging = None
        bucket.replacements.pop(peer_id, None)
        if bucket.contacts.pop(peer_id, None) is None:
            return False
        if bucket.replacements:
            _, replacement = bucket.replacements.popitem(last=True)
            bucket.contacts[replacement.peer_id] = replacement
        return True

    def closest(self, target: int, count: int, exclude: PeerID | None = None) -> list[Contact]:
        """Up to `count` known contacts closest to `target` by XOR distance, closest first.

        A bucket is an aligned prefix range, so XOR with the target maps it onto one aligned
        range of distances, disjoint from every other bucket's: visiting buckets by their
        smallest possible distance, the first buckets that hold `count` contacts hold the answer.
        """

        def nearest_distance(bucket: KBucket) -> int:
            low_bits = (bucket.hi - bucket.lo).bit_length() - 1
            return ((bucket.lo ^ target) >> low_bits) << low_bits

        chosen: list[Contact] = []
        for bucket in sorted(self.buckets, key=nearest_distance):
            chosen.extend(c for c in bucket.contacts.values() if c.peer_id != exclude)
            if len(chosen) >= count:
                break
        return heapq.nsmallest(count, chosen, key=lambda c: c.node_id ^ target)

    def stale_buckets(self, now: float, interval: float) -> list[KBucket]:
        return [b for b in self.buckets if now - b.last_updated >= interval]

    def _split(self, bucket: KBucket) -> None:
        index = self.buckets.index(bucket)
        middle = (bucket.lo + bucket.hi) // 2
        low, high = KBucket(bucket.lo, middle), KBucket(middle, bucket.hi)
        for half in (low, high):
            half.last_updated = bucket.last_updated
        for source, kind in ((bucket.contacts, "contacts"), (bucket.replacements, "replacements")):
            for peer_id, contact in source.items():
                getattr(low if contact.node_id < middle else high, kind)[peer_id] = contact
        self.buckets[index : index + 1] = [low, high]
        self._lows[index : index + 1] = [low.lo, high.lo]
