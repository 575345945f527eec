from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.p2p import Identity, IdentityError
from swarm.p2p.errors import IdentityInUse
from swarm.p2p.identity import _create_if_absent, release, verify_signature
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
    path.chmod(0o600)
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
    path.chmod(0o600)
    with pytest.raises(IdentityError, match=f"{path} (is not a libp2p Ed25519 key|is too large)"):
        Identity.load(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_others_may_read_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "shared.key"
    Identity.generate().save(path)
    path.chmod(mode)
    with pytest.raises(IdentityError, match=rf"{path} can be read by others \(mode {mode:04o}\).*chmod 600 {path}"):
        Identity.load(path)
    with pytest.raises(IdentityError, match="can be read by others"):
        Identity.claim(path)
    path.chmod(0o600)
    assert Identity.claim(path).peer_id == Identity.load(path).peer_id
    release(path)


def test_claim_creates_a_private_key_once_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "node.key"
    first = Identity.claim(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(IdentityInUse, match="in use by this process"):
            Identity.claim(path)
    finally:
        release(path)
    assert Identity.claim(path).peer_id == first.peer_id
    release(path)
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temporary file left


HOLDER = """
import sys
from swarm.p2p.identity import Identity
print(Identity.claim(sys.argv[1]).peer_id, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_a_key_another_process_holds_is_refused_until_it_exits(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None
        held_id = holder.stdout.readline().strip()
        with pytest.raises(IdentityInUse, match=f"{path} is in use by another process"):
            Identity.claim(path)
        assert str(Identity.load(path).peer_id) == held_id  # reading it is not claiming it
    finally:
        holder.communicate("", timeout=30)
    assert str(Identity.claim(path).peer_id) == held_id  # its exit released the lock
    release(path)


def test_two_processes_making_one_key_keep_the_first(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first, second = Identity.generate(), Identity.generate()
    _create_if_absent(path, first)
    _create_if_absent(path, second)
    assert Identity.load(path).peer_id == first.peer_id


def test_sign_and_verify() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert verify_signature(identity.public_key, signature, b"hello")
    assert not verify_signature(identity.public_key, signature, b"hellO")
    assert not verify_signature(Identity.generate().public_key, signature, b"hello")
    assert not verify_signature(identity.public_key, b"short", b"hello")
