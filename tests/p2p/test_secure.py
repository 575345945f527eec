"""The key schedule, records and handshake state of encrypted sessions, without sockets
(secure.py, handshake.py; the wire in wire.py)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarm.p2p import HandshakeError, Identity, ProtocolError
from swarm.p2p import handshake as hs
from swarm.p2p.secure import LAST_COUNTER, CipherState
from swarm.p2p.wire import CIPHER_NONE, Kind

KEY = bytes(range(32))


def test_record_nonce_is_four_zero_bytes_and_the_big_endian_counter() -> None:
    sender = CipherState(KEY)
    for counter in range(3):
        nonce = bytes(4) + counter.to_bytes(8, "big")
        assert sender.seal(b"frame head", b"prefix00") == AESGCM(KEY).encrypt(nonce, b"frame head", b"prefix00")


def test_records_open_only_once_in_order_with_their_associated_data() -> None:
    sender, receiver = CipherState(KEY), CipherState(KEY)
    records = [sender.seal(bytes([i]) * 10, b"ad") for i in range(3)]
    assert receiver.open(records[0], b"ad") == bytes(10)
    for bad, ad in ((records[0], b"ad"), (records[2], b"ad"), (records[1], b"other ad")):  # replay, skip, changed
        with pytest.raises(ProtocolError, match="failed authentication"):
            CipherState(KEY, counter=1).open(bad, ad)
    assert CipherState(KEY, counter=1).open(records[1], b"ad") == bytes([1]) * 10


def test_keys_roll_over_in_lockstep() -> None:
    rng = random.Random(7)
    sender, receiver = CipherState(KEY, rekey_bytes=1000), CipherState(KEY, rekey_bytes=1000)
    stale = CipherState(KEY, rekey_bytes=2**40)  # never rolls over: falls behind at the first rekey
    opened_by_stale = 0
    for _ in range(100):
        data = os.urandom(rng.randrange(0, 300))
        record = sender.seal(data, b"")
        assert receiver.open(record, b"") == data
        try:
            stale.open(record, b"")
            opened_by_stale += 1
        except ProtocolError:
            break
    assert 3 <= opened_by_stale < 99  # the key did change, after about 1000 bytes


def test_the_counter_never_reaches_its_last_value() -> None:
    sender = CipherState(KEY, counter=LAST_COUNTER)
    record = sender.seal(b"last", b"")
    assert CipherState(KEY, counter=LAST_COUNTER).open(record, b"") == b"last"
    with pytest.raises(ProtocolError, match="exhausted"):
        sender.seal(b"one more", b"")


def hello(**changes: object) -> hs.Hello:
    base = hs.Hello(
        b"k" * 32, Identity.generate().peer_id, b"n" * 32, b"e" * 32, "aes256gcm", 1 << 20, 1 << 20, 1 << 24
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "change",
    [
        {"nonce": b"m" * 32},
        {"ephemeral": b"f" * 32},
        {"cipher": CIPHER_NONE},
        {"window": (1 << 20) + 1},
        {"max_head": 4096},
        {"max_body": 65536},
        {"probe": True},
        {"peer_id": Identity.generate().peer_id},
    ],
)
def test_every_hello_field_is_bound_into_the_transcript(change: dict[str, object]) -> None:
    dialer, listener = hello(), hello()
    th = hs.transcript_hash(dialer, listener)
    assert hs.transcript_hash(dataclasses.replace(dialer, **change), listener) != th
    assert hs.transcript_hash(dialer, dataclasses.replace(listener, **change)) != th
    assert hs.transcript_hash(listener, dialer) != th  # the roles are bound too


def hello_fields(**changes: object) -> dict[str, object]:
    fields, _ = hs.make_hello(Identity.generate(), encrypt=True, window=1 << 20, max_head=1 << 20, max_body=1 << 24)
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"e": None}, "'e' is missing"),
        ({"e": bytes(31)}, "must have 32 bytes"),
        ({"e": "not bytes"}, "'e' is missing or mistyped"),
        ({"c": None}, "'c' is missing"),
        ({"c": "rot13"}, "unknown cipher"),
        ({"p": "swarm/1"}, "we speak 'swarm/2'"),
    ],
)
def test_malformed_hellos_are_refused(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(HandshakeError, match=reason):
        hs.parse_hello(hello_fields(**changes))


def pair(encrypt: bool = True) -> tuple[hs.Handshake, hs.Handshake]:
    sizes = {"window": 1 << 20, "max_head": 1 << 20, "max_body": 1 << 24, "probe": False}
    dialer = hs.Handshake(Identity.generate(), hs.DIALER, encrypt=encrypt, **sizes)  # type: ignore[arg-type]
    listener = hs.Handshake(Identity.generate(), hs.LISTENER, encrypt=encrypt, **sizes)  # type: ignore[arg-type]
    return dialer, listener


def test_handshake_in_memory_gives_matching_ciphers_per_direction() -> None:
    dialer, listener = pair()
    d_auth, d_send = dialer.on_hello(hs.parse_hello(listener.hello_fields))
    l_auth, l_send = listener.on_hello(hs.parse_hello(dialer.hello_fields))
    d_recv, l_recv = dialer.on_auth(l_auth), listener.on_auth(d_auth)
    assert d_send and l_send and d_recv and l_recv
    assert l_recv.open(d_send.seal(b"to the listener", b"p"), b"p") == b"to the listener"
    assert d_recv.open(l_send.seal(b"to the dialer", b"p"), b"p") == b"to the dialer"
    with pytest.raises(ProtocolError):  # the two directions have different keys (same counter, 1)
        d_recv.open(d_send.seal(b"x", b""), b"")
    dialer2, _ = pair()
    with pytest.raises(HandshakeError, match="failed to prove"):  # an AUTH from another connection
        dialer2.on_hello(hs.parse_hello(listener.hello_fields))
        dialer2.on_auth(l_auth)


def test_encryption_off_needs_both_ends_and_gives_no_ciphers() -> None:
    dialer, listener = pair(encrypt=False)
    auth, send = dialer.on_hello(hs.parse_hello(listener.hello_fields))
    assert auth["k"] == Kind.AUTH and send is None
    encrypting, _ = pair(encrypt=True)
    with pytest.raises(HandshakeError, match="encryption must be on at both ends"):
        encrypting.on_hello(hs.parse_hello(listener.hello_fields))


def test_a_low_order_ephemeral_key_is_refused() -> None:
    dialer, listener = pair()
    fields = dict(listener.hello_fields, e=bytes(32))  # the all-zero point: the DH result is zero
    with pytest.raises(HandshakeError, match="not a usable X25519 key"):
        dialer.on_hello(hs.parse_hello(fields))
