"""Identity: a node's Ed25519 key pair, stored in the file format of go-libp2p and its daemon.

The file holds the protobuf-serialized libp2p ``PrivateKey`` (Type = Ed25519, Data = 32-byte
seed followed by the 32-byte public key), the bytes ``crypto.MarshalPrivateKey`` writes, so one
identity file serves swarm, p2pd (``-id``) and hivemind (``identity_path``) alike.

A key file is private: it is written with mode 0600, and one that others may read (group or
world bits set) is refused, as ssh refuses such a private key: a copied key is a stolen PeerID.
A node that keeps its identity `claim`s the file: an exclusive lock (flock) held for the
process's life, so that two processes of one machine never run under one PeerID.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.p2p.errors import IdentityError, IdentityInUse
from swarm.p2p.peer_id import (
    ED25519_KEY_BYTES,
    KEY_TYPE_ED25519,
    PeerID,
    decode_key_protobuf,
    encode_key_protobuf,
)
from swarm.utils.atomic import write_atomic

_MAX_KEY_FILE_BYTES = 4096
_RAW = serialization.Encoding.Raw


class Identity:
    """An Ed25519 key pair and the PeerID it proves."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests, reproducible benchmarks)."""
        if len(seed) != ED25519_KEY_BYTES:
            raise IdentityError(f"an Ed25519 seed has 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        return self._private.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    # --- libp2p protobuf form -------------------------------------------------------------

    def to_protobuf(self) -> bytes:
        return encode_key_protobuf(KEY_TYPE_ED25519, self.seed() + self.public_key)

    @classmethod
    def from_protobuf(cls, blob: bytes) -> Identity:
        key_type, data = decode_key_protobuf(blob)
        if key_type != KEY_TYPE_ED25519:
            raise IdentityError(f"only Ed25519 keys are supported, this key has type {key_type}")
        if len(data) != 2 * ED25519_KEY_BYTES:
            raise IdentityError(f"an Ed25519 private key holds 64 bytes (seed + public), got {len(data)}")
        identity = cls.from_seed(data[:ED25519_KEY_BYTES])
        if identity.public_key != data[ED25519_KEY_BYTES:]:
            raise IdentityError("the key's public half does not match its seed")
        return identity

    # --- files ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key atomically with mode 0600 (temp file, fsync, rename)."""
        write_atomic(Path(path), self.to_protobuf(), mode=0o600)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                return cls._read(path, f.fileno())
        except FileNotFoundError:
            raise IdentityError(f"identity file {path} does not exist") from None
        except OSError as e:
            raise IdentityError(f"identity file {path} cannot be read: {e.strerror}") from None

    @classmethod
    def _read(cls, path: Path, fd: int) -> Identity:
        """The key in the open file fd (of path, named in errors): bounded, well formed, private (a
        file that is no key says so first: that is what its owner must fix)."""
        os.lseek(fd, 0, os.SEEK_SET)
        blob = b""
        while len(blob) <= _MAX_KEY_FILE_BYTES and (chunk := os.read(fd, _MAX_KEY_FILE_BYTES + 1 - len(blob))):
            blob += chunk
        if len(blob) > _MAX_KEY_FILE_BYTES:
            raise IdentityError(f"identity file {path} is too large to be a key")
        try:
            identity = cls.from_protobuf(blob)
        except IdentityError as e:
            raise IdentityError(f"identity file {path} is not a libp2p Ed25519 key: {e}") from None
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            raise IdentityError(f"identity file {path} can be read by others (mode {mode:04o}): a private key must "
                                f"be the owner's alone; run chmod 600 {path}, or make a new identity if it was "
                                "shared")  # fmt: skip
        return identity

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at path, or create and save a new one if the file does not exist."""
        if not Path(path).exists():
            identity = cls.generate()
            identity.save(path)
            return identity
        return cls.load(path)

    @classmethod
    def claim(cls, path: str | os.PathLike[str]) -> Identity:
        """The key at path, created if missing, locked for the rest of this process's life (until
        `release`). Raises IdentityInUse when another process holds it, IdentityError for a file
        that is not a private key, OSError when the folder cannot be made or written."""
        path = Path(path).absolute()
        if path in _CLAIMED:
            raise IdentityInUse(f"identity file {path} is in use by this process already")
        if not path.exists():
            _create_if_absent(path, cls.generate())
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise IdentityError(f"identity file {path} cannot be read: {e.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise IdentityInUse(f"identity file {path} is in use by another process on this machine") from None
            identity = cls._read(path, fd)  # read under the lock: what the process that made it wrote
        except BaseException:
            os.close(fd)
            raise
        _CLAIMED[path] = fd
        return identity

    # --- signatures -----------------------------------------------------------------------

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


_CLAIMED: dict[Path, int] = {}  # key files this process holds locked, and their descriptors


def release(path: str | os.PathLike[str]) -> None:
    """Unlock a key file `Identity.claim` took (a process's exit releases it too)."""
    fd = _CLAIMED.pop(Path(path).absolute(), None)
    if fd is not None:
        os.close(fd)


def _create_if_absent(path: Path, identity: Identity) -> None:
    """Save identity at path unless a file is there already (another process may be making the
    same key file at this moment: the first one's key stays, the second one's is dropped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{os.getpid()}.new")
    identity.save(fresh)
    try:
        os.link(fresh, path)  # fails if path exists: never replaces a key
    except FileExistsError:
        pass
    finally:
        fresh.unlink(missing_ok=True)


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when signature is a valid Ed25519 signature of message by public_key."""
    if len(public_key) != ED25519_KEY_BYTES or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
