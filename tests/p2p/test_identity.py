from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swarm.p2p import Identity, IdentityError
from swarm.p2p.identity import verify_signature
from tests.p2p.test_peer_id import SPEC_PRIVATE


def test_save_load_round_trip_with_mode_0600(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "keys" / "node.key"
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == identity.to_protobuf()
    loaded = Identity.load(path)
    assert loaded.peer_id == identity.peer_id and loaded.seed() == identity.seed()


def test_file_format_is_libp2p_protobuf(tmp_path: Path) -> None:
    path = tmp_path / "spec.key"
    path.write_bytes(SPEC_PRIVATE)  # what go-libp2p's crypto.MarshalPrivateKey writes
    assert str(Identity.load(path).peer_id) == "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"
    Identity.load(path).save(tmp_path / "again.key")
    assert (tmp_path / "again.key").read_bytes() == SPEC_PRIVATE


def test_load_or_create(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    first = Identity.load_or_create(path)
    assert path.exists() and Identity.load_or_create(path).peer_id == first.peer_id


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "nope.key")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of their mode")
def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "locked.key"
    Identity.generate().save(path)
    path.chmod(0)
    with pytest.raises(IdentityError, match="cannot be read"):
        Identity.load(path)


def test_directory_instead_of_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="cannot be read"):
        Identity.load(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a key at all",
        SPEC_PRIVATE[:-1],  # truncated
        SPEC_PRIVATE + b"\x00",  # trailing garbage
        bytes([0x08, 0x00]) + SPEC_PRIVATE[2:],  # RSA key type
        SPEC_PRIVATE[:4] + SPEC_PRIVATE[4:36] + bytes(32),  # public half does not match the seed
        b"\x00" * 10_000,  # far too large
    ],
)
def test_malformed_key_files_are_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match=str(path)):
        Identity.load(path)


def test_sign_and_verify() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert verify_signature(identity.public_key, signature, b"hello")
    assert not verify_signature(identity.public_key, signature, b"hellO")
    assert not verify_signature(Identity.generate().public_key, signature, b"hello")
    assert not verify_signature(identity.public_key, b"short", b"hello")
