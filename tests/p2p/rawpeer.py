"""A hand-driven peer on a plain asyncio socket, for sending a host bytes no real peer would."""

from __future__ import annotations

import asyncio
from typing import Any

from swarm.p2p import Identity
from swarm.p2p import handshake as hs
from swarm.p2p.wire import FRAME_PREFIX, PREFIX_BYTES, Kind, decode_head, encode_head


def frame(fields: dict[str, Any], body: bytes = b"") -> bytes:
    head = encode_head(fields)
    return FRAME_PREFIX.pack(len(head), len(body)) + head + body


class RawPeer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, identity: Identity) -> None:
        self.reader, self.writer, self.identity = reader, writer, identity

    @classmethod
    async def connect(cls, maddr: str) -> RawPeer:
        host, port = maddr.split("/")[2], int(maddr.split("/")[4])
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, Identity.generate())

    async def read_frame(self, timeout: float = 5) -> tuple[dict[str, Any], bytes]:
        prefix = await asyncio.wait_for(self.reader.readexactly(PREFIX_BYTES), timeout)
        head_len, body_len = FRAME_PREFIX.unpack(prefix)
        raw = await asyncio.wait_for(self.reader.readexactly(head_len + body_len), timeout)
        return decode_head(raw[:head_len]), raw[head_len:]

    async def handshake(
        self, *, sign_with: Identity | None = None, window: int = 1 << 20, then: bytes = b""
    ) -> dict[str, Any]:
        """Authenticate as the dialer (optionally signing with the wrong key), sending `then` in
        the same write as our AUTH; returns their AUTH frame."""
        hello, nonce = hs.make_hello(self.identity, window=window, max_head=1 << 20, max_body=1 << 24)
        self.send(frame(hello))
        remote = hs.parse_hello((await self.read_frame())[0])
        message = hs.auth_message(hs.DIALER, nonce, remote.nonce, self.identity.peer_id, remote.peer_id)
        self.send(frame({"k": Kind.AUTH, "s": (sign_with or self.identity).sign(message)}) + then)
        return (await self.read_frame())[0]

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
