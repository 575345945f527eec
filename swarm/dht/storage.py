"""RecordStorage: a node's bounded store of expiring records, with subkeys.

Rules (hivemind's, written down):
- per (key, subkey) the record with the later expiration wins; an equal one keeps the old;
- a key holds either one plain value (subkey None) or a dictionary of subkeys; a write of the
  other kind replaces the entry only if it expires after everything the entry holds;
- when full (max_records, or max_subkeys under one key), the record that expires first is
  evicted if the newcomer expires later; otherwise the newcomer is refused (StorageFull);
- expired records are never returned and are purged as time passes.

With `quotas` (a node's storage and cache; quotas.py has the rules and why), every record is
charged to the peer that sent it: per-source record and byte quotas, a byte cap on the whole
store with fair-share eviction, and the per-key subkey admission that favours owners with a
costly id and recent activity replace the two "when full" rules above.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from swarm.dht.errors import Outdated, StorageFull
from swarm.dht.ids import Key
from swarm.dht.quotas import (
    NEVER_SEEN,
    Quotas,
    StandingFn,
    SubkeyFacts,
    fair_share_victim,
    record_bytes,
    subkey_admission,
)
from swarm.dht.records import Record, record_owner
from swarm.p2p.peer_id import PeerID

Subkey = Key | None
Source = PeerID | None  # the peer that sent a record; None: this node itself


@dataclass(slots=True)
class _Held:
    source: Source
    stored_at: float
    size: int


class RecordStorage:
    def __init__(
        self,
        max_records: int,
        max_subkeys_per_key: int,
        quotas: Quotas | None = None,
        standing: StandingFn | None = None,
    ) -> None:
        self.max_records = max_records
        self.max_subkeys_per_key = max_subkeys_per_key
        self.quotas = quotas
        self.standing: StandingFn = standing or (lambda _peer: NEVER_SEEN)
        self._entries: dict[Key, dict[Subkey, Record]] = {}
        self._held: dict[tuple[Key, Subkey], _Held] = {}
        self._by_source: dict[Source, dict[tuple[Key, Subkey], None]] = {}
        self._bytes_by_source: dict[Source, int] = {}
        self.total_bytes = 0
        self._count = 0
        self._expiry_heap: list[tuple[float, int, Key, Subkey]] = []  # lazy: stale items skipped
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return self._count

    def keys(self) -> list[Key]:
        return list(self._entries)

    def get(self, key: Key, now: float) -> list[Record]:
        """The live records under key: [plain] or the subkey records; [] when none."""
        self.purge(now)
        entry = self._entries.get(key)
        if not entry:
            return []
        return [record for record in entry.values() if record.expiration > now]

    def put(self, record: Record, now: float, source: Source = None) -> None:
        """Store a validated record sent by `source`, or raise Outdated / StorageFull. Nothing
        changes when it is refused, except that a full store may have evicted records of the
        source holding the most bytes on the way."""
        self.purge(now)
        size = record_bytes(record)
        entry = self._entries.get(record.key)
        current = entry.get(record.subkey) if entry is not None else None
        drop_key, evict = False, None
        if entry is not None:
            if current is not None:
                if record.expiration <= current.expiration:
                    raise Outdated("this node holds a record that expires no earlier")
            elif (None in entry) != (record.subkey is None):  # plain value vs dictionary
                latest = max(r.expiration for r in entry.values())
                if record.expiration <= latest:
                    raise Outdated("this key holds a value of the other kind that expires no earlier")
                drop_key = True
        if self.quotas is not None:
            self._check_source_quota(record, size, source)
        if entry is not None and current is None and not drop_key:
            evict = self._subkey_victim(entry, record, source, now)
        if drop_key:
            self._drop_key(record.key)
        elif evict is not None:
            self._drop(record.key, evict)
        elif current is not None:
            self._drop(record.key, record.subkey)
        while self._count >= self.max_records or (
            self.quotas is not None and self.total_bytes + size > self.quotas.max_bytes
        ):
            self._evict_one(record.expiration, source)
        self._entries.setdefault(record.key, {})[record.subkey] = record
        slot = (record.key, record.subkey)
        self._held[slot] = _Held(source, now, size)
        self._by_source.setdefault(source, {})[slot] = None
        self._bytes_by_source[source] = self._bytes_by_source.get(source, 0) + size
        self.total_bytes += size
        self._count += 1
        self._push(record)

    def held_by(self, source: Source) -> tuple[int, int]:
        """(records, bytes) this store holds from one source."""
        return len(self._by_source.get(source, ())), self._bytes_by_source.get(source, 0)

    def _check_source_quota(self, record: Record, size: int, source: Source) -> None:
        assert self.quotas is not None
        if source is None:
            return  # this node's own records
        records, used = self.held_by(source)
        held = self._held.get((record.key, record.subkey))
        if held is not None and held.source == source:  # a replacement frees its old place
            records, used = records - 1, used - held.size
        if records + 1 > self.quotas.max_records_per_source or used + size > self.quotas.max_bytes_per_source:
            raise StorageFull(
                f"the sender holds {records} records ({used} bytes) here: its quota is "
                f"{self.quotas.max_records_per_source} records, {self.quotas.max_bytes_per_source} bytes"
            )

    def _subkey_victim(self, entry: dict[Subkey, Record], record: Record, source: Source, now: float) -> Subkey:
        """The subkey a newcomer displaces (None: none), or StorageFull."""
        if self.quotas is None:
            if len(entry) < self.max_subkeys_per_key:
                return None
            oldest = min(entry.values(), key=lambda r: r.expiration)
            if oldest.expiration >= record.expiration:
                raise StorageFull(f"key already holds {self.max_subkeys_per_key} subkeys that expire later")
            return oldest.subkey
        quotas = self.quotas
        if len(entry) < min(quotas.max_per_source, quotas.max_unproven, self.max_subkeys_per_key):
            return None  # no limit can bind yet: skip the scan
        facts = [self._facts(r, self._held[(r.key, r.subkey)].source, self._held[(r.key, r.subkey)].stored_at, now)
                 for r in entry.values()]  # fmt: skip
        plan = subkey_admission(
            facts,
            self._facts(record, source, now, now),
            max_subkeys=self.max_subkeys_per_key,
            max_per_source=quotas.max_per_source,
            max_unproven=quotas.max_unproven,
        )
        if not plan.admit:
            raise StorageFull(plan.reason)
        return plan.evict

    def _facts(self, record: Record, source: Source, stored_at: float, now: float) -> SubkeyFacts:
        assert self.quotas is not None
        if source is None:  # this node's own store: ranks with the best
            return SubkeyFacts(record.subkey, source, True, True, stored_at)
        owner = record_owner(record.key, record.subkey) or source  # validated: well-formed owner
        standing = self.standing(owner)
        alive = standing.last_seen >= now - self.quotas.liveness_window
        return SubkeyFacts(record.subkey, source, standing.proven, alive, stored_at)

    def purge(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expiration, _, key, subkey = heapq.heappop(heap)
            record = self._entries.get(key, {}).get(subkey)
            if record is not None and record.expiration == expiration:
                self._drop(key, subkey)

    def _push(self, record: Record) -> None:
        heapq.heappush(self._expiry_heap, (record.expiration, next(self._sequence), record.key, record.subkey))
        if len(self._expiry_heap) > 2 * self._count + 1024:  # overwrites left stale items: rebuild
            self._expiry_heap = [
                (r.expiration, next(self._sequence), r.key, r.subkey)
                for entry in self._entries.values()
                for r in entry.values()
            ]
            heapq.heapify(self._expiry_heap)

    def _evict_one(self, expiration: float, source: Source) -> None:
        """Make room for one record: the fair-share rule with quotas, else the earliest expiry."""
        if self.quotas is None:
            self._evict_one_older_than(expiration)
            return
        try:
            victim = fair_share_victim(self._bytes_by_source, source)
        except LookupError:
            raise StorageFull(f"node holds {self.total_bytes} bytes and the sender has the largest share") from None
        slot = min(self._by_source[victim], key=lambda s: self._entries[s[0]][s[1]].expiration)
        self._drop(*slot)

    def _evict_one_older_than(self, expiration: float) -> None:
        heap = self._expiry_heap
        while heap:
            first, _, key, subkey = heap[0]
            record = self._entries.get(key, {}).get(subkey)
            if record is None or record.expiration != first:
                heapq.heappop(heap)
                continue
            if first >= expiration:
                break
            heapq.heappop(heap)
            self._drop(key, subkey)
            return
        raise StorageFull(f"node holds {self.max_records} records that all expire later")

    def _drop(self, key: Key, subkey: Subkey) -> None:
        entry = self._entries[key]
        del entry[subkey]
        self._count -= 1
        if not entry:
            del self._entries[key]
        held = self._held.pop((key, subkey))
        by_source = self._by_source[held.source]
        del by_source[(key, subkey)]
        self._bytes_by_source[held.source] -= held.size
        self.total_bytes -= held.size
        if not by_source:
            del self._by_source[held.source], self._bytes_by_source[held.source]

    def _drop_key(self, key: Key) -> None:
        for subkey in list(self._entries[key]):
            self._drop(key, subkey)
