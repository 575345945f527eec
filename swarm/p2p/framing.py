"""FrameProtocol: turns a TCP byte stream into frames (see wire.py) and back, sealing and
opening them (secure.py) once the handshake has installed the session's ciphers.

It is an asyncio BufferedProtocol, so the event loop reads straight into our buffers: small
frames land in one reusable scratch buffer (many per recv call), and a large frame gets a
buffer of its own that the kernel fills directly, which is then handed on without another copy.
Encrypted, a large frame's body is opened from that buffer into a second pooled one, which is
handed on: the decryption is the only pass over the bytes. Bodies of OFFLOAD_BYTES or more are
opened in a worker thread, and nothing overtakes them: reading pauses until the body is open.
Sending encrypted goes through an Outbox (outbox.py), which keeps the same order for bodies
sealed in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import msgpack

from swarm.p2p.errors import ConnectionClosed, ConnectionLost, MessageTooLarge, ProtocolError
from swarm.p2p.outbox import COALESCE_BELOW, Outbox
from swarm.p2p.secure import OFFLOAD_BYTES, CipherState, crypto_pool, open_into
from swarm.p2p.wire import FRAME_PREFIX, PREFIX_BYTES, TAG_BYTES, decode_head

logger = logging.getLogger(__name__)

SCRATCH_START_BYTES = 8 * 1024  # most connections (DHT) only ever see small frames: start small
SCRATCH_BYTES = 256 * 1024  # and grow up to this when frames or bursts need it
OWN_BUFFER_ABOVE = 64 * 1024  # frames larger than this are read into a buffer of their own
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
        self._own_body_len = 0
        self._outbox: Outbox | None = None  # seals what we send, from our AUTH on
        self._opener: CipherState | None = None  # opens what we receive, from the peer's AUTH on
        self._opening = False  # a body is being opened in a worker thread: deliveries wait
        self._close_when_flushed = False
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
        self._guarded(self._received, nbytes)

    def _received(self, nbytes: int) -> None:
        if self._own is not None:
            self._own_filled += nbytes
            if self._own_filled == len(self._own_view):  # type: ignore[arg-type]
                self._finish_own_frame()
        else:
            self._end += nbytes
            self._parse_scratch()

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
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
        if self._outbox is not None:
            self._outbox.drop()
        self._release_buffers()
        if self.on_lost is not None:
            self.on_lost(reason)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writers()

    # --- encryption -------------------------------------------------------------------------

    def seal_sent_frames(self, cipher: CipherState) -> None:
        """Encrypt every frame sent from now on (the handshake calls it right after our AUTH)."""
        assert self.transport is not None
        self._outbox = Outbox(
            self.transport,
            cipher,
            take_buffer=self._take_buffer,
            on_flushed=self._backlog_flushed,
            on_failed=self.abort,
        )

    def open_received_frames(self, cipher: CipherState) -> None:
        """Decrypt every frame received from now on (called when the peer's AUTH verified, in
        the frame callback, so the next frame of the same read is opened already)."""
        self._opener = cipher

    def _wire_bytes(self, head_len: int, body_len: int) -> int:
        """Bytes of a frame after its prefix, as the peer sends it to us."""
        if self._opener is None:
            return head_len + body_len
        return head_len + body_len + (2 * TAG_BYTES if body_len else TAG_BYTES)

    # --- reading --------------------------------------------------------------------------

    def _parse_scratch(self) -> None:
        view = self._view
        while not self.closed and not self._opening:
            available = self._end - self._start
            if available < PREFIX_BYTES:
                break
            head_len, body_len = FRAME_PREFIX.unpack_from(self._scratch, self._start)
            self._check_sizes(head_len, body_len)
            total = PREFIX_BYTES + self._wire_bytes(head_len, body_len)
            if available >= total:
                head_at = self._start + PREFIX_BYTES
                if self._opener is not None:  # bodies here are < SCRATCH_BYTES <= OFFLOAD_BYTES: inline
                    head, body = self._open_small(view[self._start : self._start + total], head_len, body_len)
                else:
                    head = decode_head(view[head_at : head_at + head_len])
                    body = bytes(view[head_at + head_len : self._start + total]) if body_len else b""
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

    def _open_small(self, frame: memoryview, head_len: int, body_len: int) -> tuple[dict[str, Any], bytes]:
        opener, prefix = self._opener, bytes(frame[:PREFIX_BYTES])
        assert opener is not None
        body_at = PREFIX_BYTES + head_len + TAG_BYTES
        head = decode_head(opener.open(frame[PREFIX_BYTES:body_at], prefix))
        return head, opener.open(frame[body_at:], prefix) if body_len else b""

    def _check_sizes(self, head_len: int, body_len: int) -> None:
        if head_len == 0:
            raise ProtocolError("frame with an empty head")
        if head_len > self.max_head:
            raise MessageTooLarge(f"frame head of {head_len} bytes exceeds the limit of {self.max_head}")
        if body_len > self.max_body:
            raise MessageTooLarge(f"frame body of {body_len} bytes exceeds the limit of {self.max_body}")

    def _start_own_frame(self, head_len: int, body_len: int, available: int) -> None:
        wire_bytes = self._wire_bytes(head_len, body_len)
        own = self._take_buffer(wire_bytes)
        have = available - PREFIX_BYTES
        own[:have] = self._view[self._start + PREFIX_BYTES : self._end]
        self._own, self._own_view = own, memoryview(own)[:wire_bytes]
        self._own_filled, self._own_head_len, self._own_body_len = have, head_len, body_len
        self._start = self._end = 0

    def _finish_own_frame(self) -> None:
        view, head_len, body_len = self._own_view, self._own_head_len, self._own_body_len
        assert view is not None
        self._own = self._own_view = None
        if self._opener is None:
            self._deliver(decode_head(view[:head_len]), view[head_len:])
            return
        prefix = FRAME_PREFIX.pack(head_len, body_len)
        head = decode_head(self._opener.open(view[: head_len + TAG_BYTES], prefix))
        if not body_len:
            self._deliver(head, b"")
            return
        body = memoryview(self._take_buffer(body_len))[:body_len]  # the buffer handed on
        aead, nonce = self._opener.reserve(body_len)
        record = view[head_len + TAG_BYTES :]
        if body_len < OFFLOAD_BYTES:
            open_into(aead, nonce, record, prefix, body)
            self._deliver(head, body)
            return
        self._opening = True  # nothing is read or delivered until this body is open
        assert self.transport is not None
        self.transport.pause_reading()
        opened = asyncio.get_running_loop().run_in_executor(crypto_pool(), open_into, aead, nonce, record, prefix, body)
        opened.add_done_callback(lambda done: self._guarded(self._body_opened, done, head, body))

    def _body_opened(self, done: asyncio.Future[None], head: dict[str, Any], body: memoryview) -> None:
        self._opening = False
        if self.closed:
            return
        done.result()  # ProtocolError if the record failed authentication: nothing is delivered
        self._deliver(head, body)
        self._parse_scratch()  # anything read meanwhile (normally nothing: reading was paused)
        if not self.closed and not self._opening and self.transport is not None:
            self.transport.resume_reading()

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
        if self.closed or self._close_when_flushed or self.transport is None or self.transport.is_closing():
            raise ConnectionClosed("connection is closed")
        head = self._packer.pack(fields)
        if max_head and len(head) > max_head:
            raise MessageTooLarge(f"message of {len(head)} bytes exceeds the peer's limit of {max_head}")
        body_len = 0 if body is None else len(body)
        prefix = FRAME_PREFIX.pack(len(head), body_len)
        if self._outbox is not None:
            try:
                sent = self._outbox.send(prefix, head, body)
            except ProtocolError as e:  # the record counter ran out: close rather than reuse a nonce
                self.abort(e)
                raise ConnectionClosed(str(e)) from None
            self.traffic.sent += sent
            return sent
        if body_len == 0:
            self.transport.write(prefix + head)
        elif body_len < COALESCE_BELOW:
            self.transport.write(b"".join((prefix, head, body)))  # type: ignore[arg-type]
        else:
            self.transport.writelines((prefix + head, body))  # type: ignore[arg-type]
        self.traffic.sent += PREFIX_BYTES + len(head) + body_len
        return PREFIX_BYTES + len(head) + body_len

    def _backlog_flushed(self) -> None:
        self._wake_writers()
        if self._close_when_flushed and self._outbox is not None and self._outbox.empty:
            self.close()

    def _wake_writers(self) -> None:
        if self._write_paused or (self._outbox is not None and self._outbox.backlog_bytes > self._write_high):
            return
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def drain(self) -> None:
        """Wait while the transport's write buffer, or our backlog of frames behind a body being
        sealed, is above the high-water mark."""
        if self.closed:
            raise ConnectionLost("connection is closed")
        if not self._write_paused and (self._outbox is None or self._outbox.backlog_bytes <= self._write_high):
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
        """Close once every queued frame is written (the Outbox's backlog too)."""
        if self._outbox is not None and not self._outbox.empty and not self.closed:
            self._close_when_flushed = True
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.close()
