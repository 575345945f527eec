"""FreshestRecords: the freshest record per subkey of one key, gathered from several holders.

A get merges what this node stores and caches with what each holder of a lookup returns, and a
find reply merges the store and the cache. They follow RecordStorage's rules (storage.py): per
subkey the later expiration wins and an equal one keeps the first; a key holds one plain value
(subkey None) or a dictionary of subkeys, and a record of the other kind replaces the whole
entry only if it expires after all of it. None of a store's bounds, quotas or purging apply:
the records come validated from a store or from a reply whose size decode_found bounds, and
they live as long as one get.

`newer(subkey, expiration)` says whether a record could still change the set: a reply's copy
of a record already here (k holders of a key return the same ones) is then skipped before it
is validated, which was most of a get's CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.dht.ids import Key
from swarm.dht.records import Record

Subkey = Key | None


class FreshestRecords:
    def __init__(self, records: Iterable[Record] = ()) -> None:
        self._records: dict[Subkey, Record] = {}
        for record in records:
            self.add(record)

    def newer(self, subkey: Subkey, expiration: float) -> bool:
        """Could a record of `subkey` expiring at `expiration` replace what is here? False only
        for a subkey held with an expiration no earlier (a copy, or an older version)."""
        current = self._records.get(subkey)
        return current is None or expiration > current.expiration

    def add(self, record: Record) -> bool:
        """Keep `record` if it is fresher than what is here by the rules above; True if kept."""
        current = self._records.get(record.subkey)
        if current is not None:
            if record.expiration <= current.expiration:
                return False
        elif self._records and (None in self._records) != (record.subkey is None):  # the other kind
            if record.expiration <= max(r.expiration for r in self._records.values()):
                return False
            self._records.clear()
        self._records[record.subkey] = record
        return True

    def records(self, now: float) -> list[Record]:
        """The records not expired at `now`: [plain] or the subkey records; [] when none."""
        return [r for r in self._records.values() if r.expiration > now]
