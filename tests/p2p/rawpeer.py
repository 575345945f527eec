"""A hand-driven peer on a plain asyncio socket, for sending a host bytes no real peer would.

After the handshake it encrypts and decrypts frames itself, straight from the spec in wire.py
(HKDF, AES-256-GCM, the nonce and record layout) with `cryptography`'s primitives and none of
swarm.p2p.secure, so it is a second, independent reading of the wire format. It never rekeys
(tests move far less than REKEY_BYTES).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.p2p import Identity
from swarm.p2p import handshake as hs
from swarm.p2p.wire import CIPHER_AES256GCM, FRAME_PREFIX, KEYS_INFO, PREFIX_BYTES, Kind, decode_head, encode_head


def frame(fields: dict[str, Any] | bytes, body: bytes = b"") -> bytes:
    """A frame in the clear (as before and during the handshake); `fields` may be raw head bytes."""
    head = fields if isinstance(fields, bytes) else encode_head(fields)
    return FRAME_PREFIX.pack(len(head), len(body)) + head + body


class RecordCipher:
    """One direction of a session, as wire.py describes it."""

    def __init__(self, key: bytes) -> None:
        self.aead = AESGCM(key)
        self.counter = 0

    def _nonce(self) -> bytes:
        nonce = bytes(4) + self.counter.to_bytes(8, "big")
        self.counter += 1
        return nonce

    def seal(self, data: bytes, prefix: bytes) -> bytes:
        return self.aead.encrypt(self._nonce(), data, prefix)

    def open(self, record: bytes, prefix: bytes) -> bytes:
        return self.aead.decrypt(self._nonce(), record, prefix)


class RawPeer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, identity: Identity) -> None:
        self.reader, self.writer, self.identity = reader, writer, identity
        self.sender: RecordCipher | None = None  # set once our AUTH is out
        self.receiver: RecordCipher | None = None  # set once their AUTH is in

    @classmethod
    async def connect(cls, maddr: str, *, source: str | None = None) -> RawPeer:
        """Connect (from the local address `source`, to play another machine) with a fresh identity."""
        host, port = maddr.split("/")[2], int(maddr.split("/")[4])
        local = None if source is None else (source, 0)
        reader, writer = await asyncio.open_connection(host, port, local_addr=local)
        return cls(reader, writer, Identity.generate())

    async def read_frame(self, timeout: float = 5) -> tuple[dict[str, Any], bytes]:
        prefix = await asyncio.wait_for(self.reader.readexactly(PREFIX_BYTES), timeout)
        head_len, body_len = FRAME_PREFIX.unpack(prefix)
        if self.receiver is None:
            raw = await asyncio.wait_for(self.reader.readexactly(head_len + body_len), timeout)
            return decode_head(raw[:head_len]), raw[head_len:]
        head = self.receiver.open(await asyncio.wait_for(self.reader.readexactly(head_len + 16), timeout), prefix)
        body = b""
        if body_len:
            body = self.receiver.open(await asyncio.wait_for(self.reader.readexactly(body_len + 16), timeout), prefix)
        return decode_head(head), body

    def seal(self, fields: dict[str, Any] | bytes, body: bytes = b"") -> bytes:
        """One frame as the wire carries it after our AUTH; `fields` may be raw head bytes."""
        assert self.sender is not None, "seal() needs the handshake first"
        head = fields if isinstance(fields, bytes) else encode_head(fields)
        prefix = FRAME_PREFIX.pack(len(head), len(body))
        return prefix + self.sender.seal(head, prefix) + (self.sender.seal(body, prefix) if body else b"")

    def send_frame(self, fields: dict[str, Any] | bytes, body: bytes = b"") -> None:
        self.send(self.seal(fields, body))

    async def handshake(
        self,
        *,
        sign_with: Identity | None = None,
        window: int = 1 << 20,
        encrypt: bool = True,
        then: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """Authenticate as the dialer (optionally signing with the wrong key), sending the frames
        `then` (sealed) in the same write as our AUTH; returns their AUTH frame."""
        fields, ephemeral = hs.make_hello(
            self.identity, encrypt=encrypt, window=window, max_head=1 << 20, max_body=1 << 24
        )
        self.send(frame(fields))
        remote = hs.parse_hello((await self.read_frame())[0])
        transcript = hs.transcript_hash(hs.parse_hello(fields), remote)
        auth = frame({"k": Kind.AUTH, "s": (sign_with or self.identity).sign(hs.auth_message(hs.DIALER, transcript))})
        receiver = None
        if remote.cipher == CIPHER_AES256GCM:
            shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(remote.ephemeral))
            keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=transcript, info=KEYS_INFO).derive(shared)
            self.sender, receiver = RecordCipher(keys[:32]), RecordCipher(keys[32:])
        self.send(auth + b"".join(self.seal(f) if self.sender else frame(f) for f in then))
        their_auth = (await self.read_frame())[0]
        self.receiver = receiver
        return their_auth

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def closed_by_peer(self, timeout: float = 5) -> bool:
        """True when the other side closes the connection (EOF or reset) within timeout."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), timeout):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass
