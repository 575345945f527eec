"""Typed errors of the DHT. A peer's bad record is refused with one of the codes below, which
travel back as the per-record result of a store (see protocol.py)."""

from __future__ import annotations


class DHTError(Exception):
    """Base class of every error raised by swarm.dht."""


class RecordError(DHTError, ValueError):
    """A record was refused. `code` says why, in one word that also travels on the wire."""

    code = "bad_record"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class BadRecord(RecordError):
    """Malformed: wrong types, a key or subkey too long, a malformed owner marker."""

    code = "bad_record"


class ValueTooLarge(RecordError):
    """The serialized value exceeds DHTConfig.max_value_bytes."""

    code = "too_large"


class ExpirationOutOfRange(RecordError):
    """Already expired, or expiring further ahead than max_ttl plus the clock skew allowance."""

    code = "bad_expiration"


class BadSignature(RecordError):
    """An owned record (subkey or key marked [owner:<PeerID>]) without a valid signature by that owner."""

    code = "bad_signature"


class StorageFull(RecordError):
    """The node holds its maximum of records (or of subkeys under this key) and all expire later."""

    code = "full"


class Outdated(RecordError):
    """The node holds a record for this (key, subkey) that expires later: newer expiration wins."""

    code = "outdated"


RECORD_ERRORS: dict[str, type[RecordError]] = {
    cls.code: cls for cls in (BadRecord, ValueTooLarge, ExpirationOutOfRange, BadSignature, StorageFull, Outdated)
}


class BootstrapError(DHTError):
    """None of the initial peers could be reached."""
