"""FrameRelay: a man in the middle for tests. A TCP relay on 127.0.0.1 that cuts each direction
into frames (their 8-byte prefixes are in the clear, wire.py) and lets a test record, change,
drop, repeat or reorder them on the way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from swarm.p2p import P2PHost
from swarm.p2p.wire import FRAME_PREFIX, PREFIX_BYTES, TAG_BYTES

UP, DOWN = "up", "down"  # dialer -> listener, listener -> dialer
HANDSHAKE_FRAMES = 2  # HELLO and AUTH, in the clear; every later frame is sealed (when encrypted)

# tamper(direction, index of the frame in that direction, the frame) -> the bytes to forward
Tamper = Callable[[str, int, bytes], list[bytes]]


def frame_bytes(prefix: bytes, index: int, encrypted: bool) -> int:
    """Length of a whole frame on the wire, prefix included, from its prefix."""
    head_len, body_len = FRAME_PREFIX.unpack(prefix)
    if not encrypted or index < HANDSHAKE_FRAMES:
        return PREFIX_BYTES + head_len + body_len
    return PREFIX_BYTES + head_len + TAG_BYTES + (body_len + TAG_BYTES if body_len else 0)


class FrameRelay:
    """Forwards one connection at a time to `target`; `captured` holds every byte it forwarded."""

    def __init__(self, target: P2PHost, tamper: Tamper | None = None, *, encrypted: bool = True) -> None:
        addr = target.visible_maddrs[0].split("/")
        self._target = (addr[2], int(addr[4]))
        self._target_id = target.peer_id
        self._tamper = tamper or (lambda direction, index, frame: [frame])
        self._encrypted = encrypted
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.captured = {UP: bytearray(), DOWN: bytearray()}

    async def __aenter__(self) -> FrameRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def maddr(self) -> str:
        """Dial this to reach the target through the relay (the PeerID is the target's)."""
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"/ip4/127.0.0.1/tcp/{port}/p2p/{self._target_id}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]
        for direction, src, dst in ((UP, reader, up_writer), (DOWN, up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(direction, src, dst))
            self._tasks.add(task)

    async def _pump(self, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        index = 0
        try:
            while True:
                prefix = await src.readexactly(PREFIX_BYTES)
                rest = await src.readexactly(frame_bytes(prefix, index, self._encrypted) - PREFIX_BYTES)
                for out in self._tamper(direction, index, prefix + rest):
                    self.captured[direction] += out
                    dst.write(out)
                await dst.drain()
                index += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, RuntimeError):
                dst.close()
