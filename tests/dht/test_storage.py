"""RecordStorage on its own: expiry, newer-expiration-wins, subkeys, plain vs dictionary entries,
bounds with eviction of the earliest-expiring record, and a brute-force model it must match."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from swarm.dht.errors import Outdated, StorageFull
from swarm.dht.records import Record
from swarm.dht.storage import RecordStorage


def rec(key, subkey, expiration: float, value: bytes = b"\x01") -> Record:
    return Record(key, subkey, value, float(expiration))


def contents(storage: RecordStorage, key, now: float) -> dict:
    return {r.subkey: (r.value, r.expiration) for r in storage.get(key, now)}


# --- expiry -----------------------------------------------------------------------------------


def test_expired_records_are_never_returned_and_are_purged() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("a", None, 10), now=0)
    storage.put(rec("b", "x", 20), now=0)
    assert contents(storage, "a", now=9.5) == {None: (b"\x01", 10.0)}
    assert storage.get("a", now=10) == []  # expires at 10: gone at 10
    assert storage.get("a", now=11) == []
    assert len(storage) == 1 and storage.keys() == ["b"]
    storage.purge(now=25)
    assert len(storage) == 0 and storage.keys() == []
    assert storage.get("b", now=0) == []  # purged for good, even when asked about the past


def test_put_purges_first_so_expired_records_do_not_count() -> None:
    storage = RecordStorage(max_records=2, max_subkeys_per_key=10)
    storage.put(rec("a", None, 10), now=0)
    storage.put(rec("b", None, 30), now=0)
    storage.put(rec("c", None, 20), now=15)  # "a" expired: room without evicting "b"
    assert len(storage) == 2
    assert sorted(storage.keys()) == ["b", "c"]


def test_storing_an_already_expired_record_leaves_nothing_behind() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("a", None, 5), now=10)  # storage does not validate; it must still stay consistent
    assert storage.get("a", now=10) == []
    storage.purge(now=10)
    assert len(storage) == 0


# --- newer expiration wins --------------------------------------------------------------------


def test_newer_expiration_wins_older_and_equal_are_outdated() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("k", None, 10, b"old"), now=0)
    storage.put(rec("k", None, 20, b"new"), now=0)
    assert contents(storage, "k", now=0) == {None: (b"new", 20.0)}
    with pytest.raises(Outdated):
        storage.put(rec("k", None, 15, b"older"), now=0)
    with pytest.raises(Outdated):
        storage.put(rec("k", None, 20, b"same time"), now=0)
    assert contents(storage, "k", now=0) == {None: (b"new", 20.0)}
    assert len(storage) == 1
    storage.purge(now=15)  # the heap item of the overwritten record (10) must not drop the new one
    assert contents(storage, "k", now=15) == {None: (b"new", 20.0)}
    assert len(storage) == 1


def test_str_and_bytes_keys_are_distinct() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("a", None, 10, b"s"), now=0)
    storage.put(rec(b"a", None, 5, b"b"), now=0)
    assert contents(storage, "a", now=0) == {None: (b"s", 10.0)}
    assert contents(storage, b"a", now=0) == {None: (b"b", 5.0)}


# --- subkeys ----------------------------------------------------------------------------------


def test_subkeys_have_their_own_expiration_and_are_merged_on_get() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("k", "x", 10, b"x"), now=0)
    storage.put(rec("k", "y", 20, b"y"), now=0)
    storage.put(rec("k", b"x", 30, b"bx"), now=0)
    assert contents(storage, "k", now=5) == {"x": (b"x", 10.0), "y": (b"y", 20.0), b"x": (b"bx", 30.0)}
    with pytest.raises(Outdated):
        storage.put(rec("k", "y", 19), now=5)
    storage.put(rec("k", "x", 12, b"x2"), now=5)  # newer for this subkey only
    assert contents(storage, "k", now=11) == {"x": (b"x2", 12.0), "y": (b"y", 20.0), b"x": (b"bx", 30.0)}
    assert contents(storage, "k", now=15) == {"y": (b"y", 20.0), b"x": (b"bx", 30.0)}
    assert len(storage) == 2
    assert contents(storage, "k", now=25) == {b"x": (b"bx", 30.0)}
    assert len(storage) == 1


# --- plain value vs dictionary ----------------------------------------------------------------


def test_plain_value_replaces_a_dictionary_only_if_it_expires_after_all_of_it() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("k", "x", 10), now=0)
    storage.put(rec("k", "y", 20), now=0)
    for expiration in (5, 15, 20):
        with pytest.raises(Outdated):
            storage.put(rec("k", None, expiration), now=0)
    assert set(contents(storage, "k", now=0)) == {"x", "y"} and len(storage) == 2
    storage.put(rec("k", None, 21, b"plain"), now=0)
    assert contents(storage, "k", now=0) == {None: (b"plain", 21.0)}
    assert len(storage) == 1
    storage.purge(now=20.5)  # the dropped subkeys' heap items must not touch the plain value
    assert contents(storage, "k", now=20.5) == {None: (b"plain", 21.0)}


def test_dictionary_replaces_a_plain_value_only_if_it_expires_later() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("k", None, 20, b"plain"), now=0)
    for expiration in (10, 20):
        with pytest.raises(Outdated):
            storage.put(rec("k", "x", expiration), now=0)
    assert contents(storage, "k", now=0) == {None: (b"plain", 20.0)}
    storage.put(rec("k", "x", 21, b"sub"), now=0)
    assert contents(storage, "k", now=0) == {"x": (b"sub", 21.0)}
    assert len(storage) == 1


def test_expired_entry_of_the_other_kind_does_not_block() -> None:
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    storage.put(rec("k", None, 20), now=0)
    with pytest.raises(Outdated):  # expires before the live plain value does (20)...
        storage.put(rec("k", "x", 15), now=12)
    assert set(contents(storage, "k", now=12)) == {None}
    storage.put(rec("k", "x", 25), now=20)  # ...but once that has expired, nothing blocks
    assert set(contents(storage, "k", now=20)) == {"x"} and len(storage) == 1


# --- bounds -----------------------------------------------------------------------------------


def test_full_storage_evicts_the_earliest_expiring_record_for_a_later_one() -> None:
    storage = RecordStorage(max_records=3, max_subkeys_per_key=10)
    storage.put(rec("a", None, 20), now=0)
    storage.put(rec("b", None, 10), now=0)
    storage.put(rec("c", "x", 30), now=0)
    for expiration in (5, 10):  # not later than the earliest held (10): refused
        with pytest.raises(StorageFull):
            storage.put(rec("d", None, expiration), now=0)
    assert sorted(storage.keys()) == ["a", "b", "c"] and len(storage) == 3
    storage.put(rec("d", None, 11), now=0)
    assert sorted(storage.keys()) == ["a", "c", "d"] and len(storage) == 3
    storage.put(rec("c", "y", 40), now=0)  # a new subkey counts too: evicts "d" (11)
    assert sorted(storage.keys()) == ["a", "c"] and len(storage) == 3
    assert set(contents(storage, "c", now=0)) == {"x", "y"}
    storage.put(rec("a", None, 50), now=0)  # an overwrite adds nothing: no eviction
    assert len(storage) == 3 and set(contents(storage, "c", now=0)) == {"x", "y"}


def test_full_subkeys_evict_the_earliest_expiring_subkey_for_a_later_one() -> None:
    storage = RecordStorage(max_records=100, max_subkeys_per_key=2)
    storage.put(rec("k", "x", 20), now=0)
    storage.put(rec("k", "y", 10), now=0)
    for expiration in (5, 10):
        with pytest.raises(StorageFull):
            storage.put(rec("k", "z", expiration), now=0)
    assert set(contents(storage, "k", now=0)) == {"x", "y"}
    storage.put(rec("k", "z", 15), now=0)
    assert set(contents(storage, "k", now=0)) == {"x", "z"} and len(storage) == 2
    storage.put(rec("other", "y", 1), now=0)  # the limit is per key
    assert len(storage) == 3


def test_eviction_of_the_last_subkey_of_the_same_key_keeps_the_newcomer() -> None:
    """The record evicted to make room may be the only other subkey of the newcomer's own key."""
    storage = RecordStorage(max_records=2, max_subkeys_per_key=10)
    storage.put(rec("plain", None, 100), now=0)
    storage.put(rec("k", "a", 10, b"a"), now=0)
    storage.put(rec("k", "b", 20, b"b"), now=0)  # full: evicts ("k", "a"), the earliest
    assert contents(storage, "k", now=0) == {"b": (b"b", 20.0)}
    assert len(storage) == 2
    assert sorted(storage.keys()) == ["k", "plain"]


# --- a brute-force model ----------------------------------------------------------------------

KEYS = ["a", "b", b"a"]
SUBKEYS = [None, "x", "y", "z"]


class Model:
    """The storage rules of the module docstring, written the slow, obvious way."""

    def __init__(self, max_records: int, max_subkeys: int) -> None:
        self.max_records = max_records
        self.max_subkeys = max_subkeys
        self.data: dict = {}  # (key, subkey) -> (value, expiration)

    def purge(self, now: float) -> None:
        self.data = {slot: v for slot, v in self.data.items() if v[1] > now}

    def entry(self, key) -> dict:
        return {sub: v for (k, sub), v in self.data.items() if k == key}

    def put(self, key, subkey, value: bytes, expiration: float, now: float) -> str:
        self.purge(now)
        entry = self.entry(key)
        if subkey in entry:
            if expiration <= entry[subkey][1]:
                return "outdated"
        elif entry and ((None in entry) != (subkey is None)):
            if expiration <= max(v[1] for v in entry.values()):
                return "outdated"
            for sub in entry:
                del self.data[(key, sub)]
        else:
            if entry and len(entry) >= self.max_subkeys:
                oldest = min(entry, key=lambda s: entry[s][1])
                if entry[oldest][1] >= expiration:
                    return "full"
                del self.data[(key, oldest)]
            if len(self.data) >= self.max_records:
                oldest = min(self.data, key=lambda s: self.data[s][1])
                if self.data[oldest][1] >= expiration:
                    return "full"
                del self.data[oldest]
        self.data[(key, subkey)] = (value, expiration)
        return "ok"


class StorageMachine(RuleBasedStateMachine):
    @initialize(max_records=st.integers(1, 6), max_subkeys=st.integers(1, 3))
    def setup(self, max_records: int, max_subkeys: int) -> None:
        self.storage = RecordStorage(max_records, max_subkeys)
        self.model = Model(max_records, max_subkeys)
        self.now = 0.0
        self.unique = itertools.count(1)

    @rule(
        key=st.sampled_from(KEYS),
        subkey=st.sampled_from(SUBKEYS),
        ahead=st.integers(0, 12),
        value=st.binary(max_size=2),
    )
    def put(self, key, subkey, ahead: int, value: bytes) -> None:
        # distinct expirations keep "the earliest-expiring record" well defined; ties are
        # covered by the hand-written tests above
        expiration = self.now + ahead + next(self.unique) * 1e-6
        expected = self.model.put(key, subkey, value, expiration, self.now)
        try:
            self.storage.put(Record(key, subkey, value, expiration), self.now)
            got = "ok"
        except Outdated:
            got = "outdated"
        except StorageFull:
            got = "full"
        assert got == expected, (key, subkey, expiration)

    @rule(step=st.integers(1, 5))
    def advance(self, step: int) -> None:
        self.now += step

    @rule()
    def purge(self) -> None:
        self.storage.purge(self.now)
        self.model.purge(self.now)
        assert len(self.storage) == len(self.model.data)

    @invariant()
    def matches_the_model(self) -> None:
        self.model.purge(self.now)
        got = {}
        for key in KEYS:
            for record in self.storage.get(key, self.now):
                assert record.key == key
                got[(key, record.subkey)] = (record.value, record.expiration)
        assert got == self.model.data
        assert len(self.storage) == len(self.model.data)
        assert sorted(map(repr, self.storage.keys())) == sorted({repr(k) for k, _ in self.model.data})


TestStorageAgainstModel = StorageMachine.TestCase
TestStorageAgainstModel.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
