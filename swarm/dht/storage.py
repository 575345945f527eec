"""RecordStorage: a node's bounded store of expiring records, with subkeys.

Rules (hivemind's, written down):
- per (key, subkey) the record with the later expiration wins; an equal one keeps the old;
- a key holds either one plain value (subkey None) or a dictionary of subkeys; a write of the
  other kind replaces the entry only if it expires after everything the entry holds;
- when full (max_records, or max_subkeys under one key), the record that expires first is
  evicted if the newcomer expires later; otherwise the newcomer is refused (StorageFull);
- expired records are never returned and are purged as time passes.
"""

from __future__ import annotations

import heapq
import itertools

from swarm.dht.errors import Outdated, StorageFull
from swarm.dht.ids import Key
from swarm.dht.records import Record

Subkey = Key | None


class RecordStorage:
    def __init__(self, max_records: int, max_subkeys_per_key: int) -> None:
        self.max_records = max_records
        self.max_subkeys_per_key = max_subkeys_per_key
        self._entries: dict[Key, dict[Subkey, Record]] = {}
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

    def put(self, record: Record, now: float) -> None:
        """Store a validated record, or raise Outdated / StorageFull (nothing changes then)."""
        self.purge(now)
        entry = self._entries.get(record.key)
        if entry is not None:
            current = entry.get(record.subkey)
            if current is not None:
                if record.expiration <= current.expiration:
                    raise Outdated("this node holds a record that expires no earlier")
                self._replace(entry, record)
                return
            if (None in entry) != (record.subkey is None):  # plain value vs dictionary
                latest = max(r.expiration for r in entry.values())
                if record.expiration <= latest:
                    raise Outdated("this key holds a value of the other kind that expires no earlier")
                self._drop_key(record.key)
                entry = None
            elif len(entry) >= self.max_subkeys_per_key:
                oldest = min(entry.values(), key=lambda r: r.expiration)
                if oldest.expiration >= record.expiration:
                    raise StorageFull(f"key already holds {self.max_subkeys_per_key} subkeys that expire later")
                self._drop(oldest.key, oldest.subkey)
        if self._count >= self.max_records:
            self._evict_one_older_than(record.expiration)
        entry = self._entries.setdefault(record.key, {})  # an eviction above may have dropped the key
        entry[record.subkey] = record
        self._count += 1
        self._push(record)

    def purge(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expiration, _, key, subkey = heapq.heappop(heap)
            record = self._entries.get(key, {}).get(subkey)
            if record is not None and record.expiration == expiration:
                self._drop(key, subkey)

    def _replace(self, entry: dict[Subkey, Record], record: Record) -> None:
        entry[record.subkey] = record
        self._push(record)

    def _push(self, record: Record) -> None:
        heapq.heappush(self._expiry_heap, (record.expiration, next(self._sequence), record.key, record.subkey))
        if len(self._expiry_heap) > 2 * self._count + 1024:  # overwrites left stale items: rebuild
            self._expiry_heap = [
                (r.expiration, next(self._sequence), r.key, r.subkey)
                for entry in self._entries.values()
                for r in entry.values()
            ]
            heapq.heapify(self._expiry_heap)

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

    def _drop_key(self, key: Key) -> None:
        self._count -= len(self._entries.pop(key))
