"""Records: owner-signed subkeys, every way validate() refuses a record, and the wire parser."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import msgpack
import pytest

from swarm.dht.config import DHTConfig
from swarm.dht.errors import (
    RECORD_ERRORS,
    BadRecord,
    BadSignature,
    ExpirationOutOfRange,
    Outdated,
    RecordError,
    ValueTooLarge,
)
from swarm.dht.records import (
    OWNER_PREFIX,
    SIGNING_DOMAIN,
    Record,
    owner_of,
    owner_subkey,
    pack_value,
    signing_message,
    unpack_value,
)
from swarm.dht.storage import RecordStorage
from swarm.p2p import Identity, PeerID

NOW = 1_700_000_000.0
CONFIG = DHTConfig()


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def mallory() -> Identity:
    return Identity.generate()


def owned(identity: Identity, expiration: float = NOW + 60, value: object = "ready") -> Record:
    return Record.create("run/ready", owner_subkey(identity.peer_id, "#1"), value, expiration, identity)


def refused(record: Record, error: type[RecordError], config: DHTConfig = CONFIG, now: float = NOW) -> str:
    with pytest.raises(error) as info:
        record.validate(config, now)
    assert type(info.value) is error, f"expected exactly {error.__name__}, got {type(info.value).__name__}"
    return info.value.message


# --- signing ----------------------------------------------------------------------------------


def test_create_signs_owned_subkeys_and_validate_accepts_them(alice: Identity) -> None:
    record = owned(alice, value={"step": 7})
    assert record.signature is not None and len(record.signature) == 64
    assert record.value == pack_value({"step": 7}) and unpack_value(record.value) == {"step": 7}
    assert owner_of(record.subkey) == alice.peer_id
    record.validate(CONFIG, NOW)


def test_create_signs_an_owned_plain_key(alice: Identity) -> None:
    record = Record.create(owner_subkey(alice.peer_id, "/profile"), None, [1, 2], NOW + 60, alice)
    assert record.signature is not None
    record.validate(CONFIG, NOW)
    with pytest.raises(BadSignature):
        dataclasses.replace(record, value=pack_value([1, 3])).validate(CONFIG, NOW)


def test_bytes_owner_marker_is_owned_too(alice: Identity, mallory: Identity) -> None:
    subkey = owner_subkey(alice.peer_id, "x").encode()
    record = Record.create("k", subkey, 1, NOW + 60, alice)
    assert record.signature is not None
    record.validate(CONFIG, NOW)
    refused(dataclasses.replace(record, signature=None), BadSignature)
    with pytest.raises(BadSignature):
        Record.create("k", subkey, 1, NOW + 60, mallory)


def test_unowned_records_are_not_signed(alice: Identity) -> None:
    record = Record.create("k", "plain-subkey", 1, NOW + 60, alice)
    assert record.signature is None
    record.validate(CONFIG, NOW)
    assert Record.create("k", None, 1, NOW + 60).signature is None


def test_create_refuses_to_write_someone_elses_record(alice: Identity, mallory: Identity) -> None:
    with pytest.raises(BadSignature):
        Record.create("k", owner_subkey(alice.peer_id), 1, NOW + 60, mallory)
    with pytest.raises(BadSignature):
        Record.create("k", owner_subkey(alice.peer_id), 1, NOW + 60, None)


def test_forged_signature_by_another_key_is_refused(alice: Identity, mallory: Identity) -> None:
    genuine = owned(alice)
    message = signing_message(genuine.key, genuine.subkey, genuine.value, genuine.expiration)
    forged = dataclasses.replace(genuine, signature=mallory.sign(message))
    refused(forged, BadSignature)


def test_record_claiming_another_owner_is_refused(alice: Identity, mallory: Identity) -> None:
    """Mallory signs (correctly, with her own key) a record under a subkey that names Alice."""
    subkey = owner_subkey(alice.peer_id, "#1")
    value = pack_value("evil")
    signature = mallory.sign(signing_message("run/ready", subkey, value, NOW + 60))
    refused(Record("run/ready", subkey, value, NOW + 60, signature), BadSignature)


@pytest.mark.parametrize(
    "change",
    [
        {"value": pack_value("not ready")},
        {"expiration": NOW + 61},
        {"expiration": NOW + 59.5},
        {"key": "run/other"},
        {"subkey": None},  # signature of a subkey record cannot pass for a plain one
    ],
    ids=["value", "later", "earlier", "key", "subkey-dropped"],
)
def test_tampered_record_is_refused(alice: Identity, change: dict) -> None:
    record = dataclasses.replace(owned(alice), **change)
    if change.get("subkey", "") is None:  # now an unowned plain record that carries a signature
        refused(record, BadRecord)
    else:
        refused(record, BadSignature)


def test_moving_a_signature_to_another_subkey_of_the_same_owner_is_refused(alice: Identity) -> None:
    record = owned(alice)
    refused(dataclasses.replace(record, subkey=owner_subkey(alice.peer_id, "#2")), BadSignature)


def test_signature_without_the_domain_prefix_is_refused(alice: Identity) -> None:
    record = owned(alice)
    bare = msgpack.packb([record.key, record.subkey, record.value, record.expiration], use_bin_type=True)
    assert signing_message(record.key, record.subkey, record.value, record.expiration) == SIGNING_DOMAIN + bare
    refused(dataclasses.replace(record, signature=alice.sign(bare)), BadSignature)


@pytest.mark.parametrize("signature", [None, b"", b"\x00" * 64, b"\x01" * 63, b"\x02" * 65])
def test_unsigned_or_garbage_signature_on_an_owned_record_is_refused(alice: Identity, signature) -> None:
    refused(dataclasses.replace(owned(alice), signature=signature), BadSignature)


def test_signature_on_an_unowned_record_is_refused(alice: Identity) -> None:
    record = Record("k", "plain", pack_value(1), NOW + 60, alice.sign(b"anything"))
    refused(record, BadRecord)
    refused(dataclasses.replace(record, subkey=None), BadRecord)


@pytest.mark.parametrize(
    "subkey",
    [
        OWNER_PREFIX + "12D3KooWnoclosingbracket",
        OWNER_PREFIX + "]",
        OWNER_PREFIX + "not-a-peer-id]x",
        OWNER_PREFIX + "0OIl]x",  # not base58 at all
        OWNER_PREFIX + "é]x",
        (OWNER_PREFIX + "\xff]").encode("latin-1"),  # bytes marker that is not ASCII
        OWNER_PREFIX.encode() + b"\x80\x81]",
    ],
)
def test_malformed_owner_marker_is_refused(subkey) -> None:
    with pytest.raises(BadRecord):
        owner_of(subkey)
    refused(Record("k", subkey, pack_value(1), NOW + 60, b"\x00" * 64), BadRecord)
    refused(Record(subkey, None, pack_value(1), NOW + 60, None), BadRecord)  # as an owned plain key


def test_owner_with_a_hashed_peer_id_cannot_sign(alice: Identity) -> None:
    hashed = PeerID(bytes([0x12, 32]) + hashlib.sha256(b"some rsa key").digest())
    subkey = owner_subkey(hashed, "x")
    assert owner_of(subkey) == hashed
    value = pack_value(1)
    signature = alice.sign(signing_message("k", subkey, value, NOW + 60))
    refused(Record("k", subkey, value, NOW + 60, signature), BadSignature)


def test_owner_marker_must_be_a_prefix(alice: Identity) -> None:
    subkey = "x" + owner_subkey(alice.peer_id)
    assert owner_of(subkey) is None
    Record("k", subkey, pack_value(1), NOW + 60).validate(CONFIG, NOW)


# --- sizes ------------------------------------------------------------------------------------


def test_value_size_limit() -> None:
    config = DHTConfig(max_value_bytes=100)
    at_limit = b"x" * (100 - 2)  # msgpack bin8: 2 bytes of header
    assert len(pack_value(at_limit)) == 100
    Record.create("k", None, at_limit, NOW + 60).validate(config, NOW)
    message = refused(Record.create("k", None, at_limit + b"x", NOW + 60), ValueTooLarge, config)
    assert "101" in message
    refused(Record.create("k", None, "y" * 70_000, NOW + 60), ValueTooLarge)  # the default 64 KiB


def test_value_size_limit_applies_to_signed_records_before_the_signature(alice: Identity) -> None:
    record = Record.create("k", owner_subkey(alice.peer_id), b"z" * 200, NOW + 60, alice)
    refused(record, ValueTooLarge, DHTConfig(max_value_bytes=100))


@pytest.mark.parametrize("kind", [str, bytes])
def test_key_and_subkey_size_limits(kind) -> None:
    config = DHTConfig(max_key_bytes=40, max_subkey_bytes=30)

    def of_packed_size(n: int):
        header = 1 if kind is str and n - 1 < 32 else 2
        raw = "k" * (n - header)
        item = raw if kind is str else raw.encode()
        assert len(msgpack.packb(item, use_bin_type=True)) == n
        return item

    Record(of_packed_size(40), of_packed_size(30), pack_value(1), NOW + 60).validate(config, NOW)
    refused(Record(of_packed_size(41), None, pack_value(1), NOW + 60), BadRecord, config)
    refused(Record("k", of_packed_size(31), pack_value(1), NOW + 60), BadRecord, config)


def test_key_limit_counts_bytes_not_characters() -> None:
    config = DHTConfig(max_key_bytes=40)
    refused(Record("é" * 30, None, pack_value(1), NOW + 60), BadRecord, config)  # 30 chars, 62 bytes


# --- expiration -------------------------------------------------------------------------------


@pytest.mark.parametrize("expiration", [NOW, NOW - 1, 0.0, -math.inf, math.nan, math.inf])
def test_expired_or_non_finite_expiration_is_refused(expiration: float) -> None:
    refused(Record("k", None, pack_value(1), expiration), ExpirationOutOfRange)


def test_expiration_too_far_ahead_respects_the_clock_skew_tolerance() -> None:
    config = DHTConfig(max_ttl=3600.0, max_clock_skew=30.0)

    def record(ahead: float) -> Record:
        return Record("k", None, pack_value(1), NOW + ahead)

    record(3600.0).validate(config, NOW)
    record(3600.0 + 15.0).validate(config, NOW)  # a peer whose clock runs 15 s ahead of ours
    record(3600.0 + 30.0).validate(config, NOW)  # exactly at the tolerance
    refused(record(3600.0 + 31.0), ExpirationOutOfRange, config)
    refused(record(10 * 365 * 86400.0), ExpirationOutOfRange, config)
    strict = DHTConfig(max_ttl=3600.0, max_clock_skew=0.0)
    record(3600.0).validate(strict, NOW)
    refused(record(3600.0 + 1.0), ExpirationOutOfRange, strict)


def test_expiration_is_checked_before_the_signature(alice: Identity) -> None:
    record = owned(alice, expiration=NOW + 60)
    refused(record, ExpirationOutOfRange, now=NOW + 60)  # honest, but expired by now


# --- replays ----------------------------------------------------------------------------------


def test_replayed_older_signed_record_does_not_replace_a_newer_one(alice: Identity) -> None:
    old = owned(alice, expiration=NOW + 100, value="old")
    new = owned(alice, expiration=NOW + 200, value="new")
    storage = RecordStorage(max_records=10, max_subkeys_per_key=10)
    for record in (old, new):
        record.validate(CONFIG, NOW)
        storage.put(record, NOW)
    old.validate(CONFIG, NOW + 1)  # the replay is a genuine signature: only the expiration stops it
    with pytest.raises(Outdated):
        storage.put(old, NOW + 1)
    with pytest.raises(Outdated):
        storage.put(new, NOW + 1)  # the same record again changes nothing either
    assert storage.get("run/ready", NOW + 1) == [new]


# --- wire form --------------------------------------------------------------------------------


def test_wire_round_trip(alice: Identity) -> None:
    for record in (owned(alice), Record.create(b"bin-key", None, {"a": [1, b"2"]}, NOW + 5)):
        wire = msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True), raw=False)
        parsed = Record.from_wire(wire)
        assert parsed == record
        parsed.validate(CONFIG, NOW)
    assert Record.from_wire(("k", None, b"\x01", NOW + 1, None)).key == "k"  # a tuple is fine too


def test_integer_expiration_becomes_a_float() -> None:
    record = Record.from_wire(["k", None, b"\x01", int(NOW) + 5, None])
    assert type(record.expiration) is float and record.expiration == int(NOW) + 5


GOOD = ["k", "s", b"\x01", NOW + 60, None]


@pytest.mark.parametrize(
    "item",
    [
        None,
        "k",
        b"k",
        42,
        {"key": "k"},
        GOOD[:4],
        [*GOOD, None],
        [],
        [1, *GOOD[1:]],
        [None, *GOOD[1:]],
        [["k"], *GOOD[1:]],
        ["k", 5, *GOOD[2:]],
        ["k", ["s"], *GOOD[2:]],
        ["k", True, *GOOD[2:]],
        [*GOOD[:2], "a str value", *GOOD[3:]],
        [*GOOD[:2], None, *GOOD[3:]],
        [*GOOD[:2], 1, *GOOD[3:]],
        [*GOOD[:3], "soon", None],
        [*GOOD[:3], None, None],
        [*GOOD[:3], True, None],
        [*GOOD[:3], [NOW], None],
        [*GOOD[:4], "sig"],
        [*GOOD[:4], 64],
        [*GOOD[:4], [b"sig"]],
    ],
)
def test_from_wire_checks_types(item) -> None:
    with pytest.raises(BadRecord):
        Record.from_wire(item)


def test_error_codes_are_distinct_and_travel_on_the_wire() -> None:
    assert set(RECORD_ERRORS) == {"bad_record", "too_large", "bad_expiration", "bad_signature", "full", "outdated"}
    for code, cls in RECORD_ERRORS.items():
        assert cls.code == code and issubclass(cls, RecordError)


def test_a_record_seen_again_is_verified_once_and_a_forgery_never_passes(
    alice: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    from swarm.dht import records

    checks: list[bytes] = []
    real = records.verify_signature

    def counting(public_key: object, signature: bytes, message: bytes) -> bool:
        checks.append(signature)
        return real(public_key, signature, message)  # type: ignore[arg-type]

    monkeypatch.setattr(records, "verify_signature", counting)
    record = owned(alice, value={"seen": "twice"})
    record.validate(CONFIG, NOW)
    record.validate(CONFIG, NOW)  # every holder of a key returns the same record
    assert len(checks) == 1
    refused(dataclasses.replace(record, value=pack_value({"seen": "forged"})), BadSignature)
    refused(dataclasses.replace(record, value=pack_value({"seen": "forged"})), BadSignature)
    assert len(checks) == 3  # a record that failed is checked every time
