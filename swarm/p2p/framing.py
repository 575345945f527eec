"""FrameProtocol: turns a TCP byte stream into frames (see wire.py) and back.

It is an asyncio BufferedProtocol, so the event loop reads straight into our buffers: small
frames land in one reusable scratch buffer (many per recv call), and a large frame gets a
buffer of its own that the kernel fills directly, which is then handed on without another copy.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import msgpack

from swarm.p2p.errors import ConnectionClosed, ConnectionLost, MessageTooLarge, ProtocolError
from swarm.p2p.wire import FRAME_PREFIX, PREFIX_BYTES, decode_head

logger = logging.getLogger(__name__)

SCRATCH_START_BYTES = 8 * 1024  # most connections (DHT) only ever see small frames: start small
SCRATCH_BYTES = 256 * 1024  # and grow up to this when frames or bursts need it
OWN_BUFFER_ABOVE = 64 * 1024  # frames larger than this are read into a buffer of their own
COALESCE_BELOW = 64 * 1024  # bodies smaller than this are joined with their head in one write
POOL_BUFFERS = 8 if hasattr(sys, "getrefcount") else 0  # large-frame buffers kept for reuse

FrameHandler = Callable[[dict[str, Any], "bytes | memoryview"], None]


class Traffic:
    """Bytes a host's connections wrote and read on their sockets, frame headers included."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads and writes frames; everything above framing is the owner's (see Connection)."""

    def __init__(self, *, max_head: int, max_body: int, write_buffer_high: int, traffic: Traffic | None = None) -> None:
        self.traffic = traffic or Traffic()
        self.max_head = max_head
        self.max_body = max_body
        self._write_high = write_buffer_high
        self.on_frame: FrameHandler | None = None
        self._early: list[tuple[dict[str, Any], bytes | memoryview]] = []
        self.on_open: Callable[[FrameProtocol], None] | None = None
        self.on_lost: Callable[[Exception | None], None] | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.close_reason: Exception | None = None
        self._scratch = bytearray(SCRATCH_START_BYTES)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._pool: list[bytearray] = []  # large-frame buffers, reused once their chunks are released
        self._own: bytearray | None = None  # buffer of the large frame being read, if any
        self._own_view: memoryview | None = None
        self._own_filled = 0
        self._own_head_len = 0
        self._packer = msgpack.Packer(use_bin_type=True)  # one per connection: reused, loop-thread only
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    # --- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        transport.set_write_buffer_limits(high=self._write_high, low=self._write_high // 4)
        if self.on_open is not None:
            self.on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._own_view is not None:
            return self._own_view[self._own_filled :]
        if self._end == len(self._scratch):
            self._compact()
            if self._end == len(self._scratch):  # a burst of frames filled it: grow
                self._grow(2 * len(self._scratch))
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.traffic.received += nbytes
        try:
            if self._own is not None:
                self._own_filled += nbytes
                if self._own_filled == len(self._own_view):  # type: ignore[arg-type]
                    self._finish_own_frame()
            else:
                self._end += nbytes
                self._parse_scratch()
        except (ProtocolError, MessageTooLarge) as e:
            self.abort(e)
        except Exception as e:  # a bug above us must not leave the connection half-alive
            logger.exception("frame handler failed; closing the connection")
            self.abort(e)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reason = self.close_reason or exc
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionLost(f"connection lost: {reason or 'closed'}"))
        self._drain_waiters.clear()
        self._release_buffers()
        if self.on_lost is not None:
            self.on_lost(reason)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # --- reading --------------------------------------------------------------------------

    def _parse_scratch(self) -> None:
        view = self._view
        while not self.closed:
            available = self._end - self._start
            if available < PREFIX_BYTES:
                break
            head_len, body_len = FRAME_PREFIX.unpack_from(self._scratch, self._start)
            self._check_sizes(head_len, body_len)
            total = PREFIX_BYTES + head_len + body_len
            if available >= total:
                head_at = self._start + PREFIX_BYTES
                body_at = head_at + head_len
                head = decode_head(view[head_at:body_at])
                body = bytes(view[body_at : self._start + total]) if body_len else b""
                self._start += total
                self._deliver(head, body)
            elif total > OWN_BUFFER_ABOVE:
                self._start_own_frame(head_len, body_len, available)
                return
            else:
                if total > len(self._scratch):
                    self._grow(total)
                elif self._start + total > len(self._scratch):
                    self._compact()
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _check_sizes(self, head_len: int, body_len: int) -> None:
        if head_len == 0:
            raise ProtocolError("frame with an empty head")
        if head_len > self.max_head:
            raise MessageTooLarge(f"frame head of {head_len} bytes exceeds the limit of {self.max_head}")
        if body_len > self.max_body:
            raise MessageTooLarge(f"frame body of {body_len} bytes exceeds the limit of {self.max_body}")

    def _start_own_frame(self, head_len: int, body_len: int, available: int) -> None:
        own = self._take_buffer(head_len + body_len)
        have = available - PREFIX_BYTES
        own[:have] = self._view[self._start + PREFIX_BYTES : self._end]
        self._own, self._own_view = own, memoryview(own)[: head_len + body_len]
        self._own_filled, self._own_head_len = have, head_len
        self._start = self._end = 0

    def _finish_own_frame(self) -> None:
        view, head_len = self._own_view, self._own_head_len
        assert view is not None
        self._own = self._own_view = None
        head = decode_head(view[:head_len])
        self._deliver(head, view[head_len:])

    def _take_buffer(self, size: int) -> bytearray:
        """A buffer for one large frame: a pooled one nobody references any more, or a new one.
        Reusing buffers spares the allocator's zero-fill and page faults on every 4 MiB chunk."""
        for buffer in self._pool:
            # 3 = the pool's list + this loop variable + getrefcount's argument: no view is alive.
            # A larger free buffer serves too (frames vary in size), used through a slice.
            if size <= len(buffer) <= 2 * size and sys.getrefcount(buffer) == 3:
                return buffer
        buffer = bytearray(size)
        if len(self._pool) < POOL_BUFFERS:
            self._pool.append(buffer)
        return buffer

    def _grow(self, at_least: int) -> None:
        """A larger scratch buffer (a power of two, at most SCRATCH_BYTES) holding the unparsed bytes."""
        size = min(SCRATCH_BYTES, max(1 << (at_least - 1).bit_length(), len(self._scratch)))
        if size <= len(self._scratch):
            self._compact()
            return
        n = self._end - self._start
        grown = bytearray(size)
        grown[:n] = self._view[self._start : self._end]
        self._scratch, self._view = grown, memoryview(grown)
        self._start, self._end = 0, n

    def _compact(self) -> None:
        n = self._end - self._start
        self._scratch[0:n] = self._scratch[self._start : self._end]
        self._start, self._end = 0, n

    def _deliver(self, head: dict[str, Any], body: bytes | memoryview) -> None:
        if self.on_frame is not None:
            self.on_frame(head, body)
        elif len(self._early) < 4:  # only before the owner attached: HELLO/AUTH at most
            self._early.append((head, body))
        else:
            raise ProtocolError("too many frames before the connection was set up")

    def set_frame_handler(self, on_frame: FrameHandler) -> None:
        """Route frames to on_frame, first delivering any that arrived before it was set."""
        self.on_frame = on_frame
        early, self._early = self._early, []
        for head, body in early:
            on_frame(head, body)

    def _release_buffers(self) -> None:
        self._own = self._own_view = None
        self._pool.clear()

    # --- writing --------------------------------------------------------------------------

    def send(
        self, fields: dict[str, Any], body: bytes | bytearray | memoryview | None = None, *, max_head: int = 0
    ) -> int:
        """Queue one frame; returns the bytes queued. The body buffer must not change afterwards.
        max_head: the peer's limit on heads (0: no check)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionClosed("connection is closed")
        head = self._packer.pack(fields)
        if max_head and len(head) > max_head:
            raise MessageTooLarge(f"message of {len(head)} bytes exceeds the peer's limit of {max_head}")
        body_len = 0 if body is None else len(body)
        prefix = FRAME_PREFIX.pack(len(head), body_len)
        if body_len == 0:
            self.transport.write(prefix + head)
        elif body_len < COALESCE_BELOW:
            self.transport.write(b"".join((prefix, head, body)))  # type: ignore[arg-type]
        else:
            self.transport.writelines((prefix + head, body))  # type: ignore[arg-type]
        self.traffic.sent += PREFIX_BYTES + len(head) + body_len
        return PREFIX_BYTES + len(head) + body_len

    async def drain(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        if self.closed:
            raise ConnectionLost("connection is closed")
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def abort(self, reason: Exception) -> None:
        """Close at once, remembering why (protocol violations, handshake failures)."""
        if self.close_reason is None:
            self.close_reason = reason
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True  # stop parsing now; connection_lost follows from the loop

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
