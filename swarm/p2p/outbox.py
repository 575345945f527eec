"""Outbox: the encrypted send path of a FrameProtocol (wire.py, "Encryption").

It seals each frame as one or two records (secure.py) and writes them to the transport in the
order the frames were sent, although bodies of OFFLOAD_BYTES or more are sealed in worker
threads: such a body gets its nonce on the event loop when it is sent, and every frame sent
after it waits in a backlog until it is sealed and written. Small records are sealed inline
(about a microsecond each), where a thread hop would cost more than it saves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from swarm.p2p.errors import ProtocolError
from swarm.p2p.secure import OFFLOAD_BYTES, CipherState, crypto_pool, seal_into
from swarm.p2p.wire import TAG_BYTES

logger = logging.getLogger(__name__)

COALESCE_BELOW = 64 * 1024  # bodies smaller than this are joined with their head in one write

Buffer = bytes | bytearray | memoryview
Pending = tuple[bytes, Buffer | None, "asyncio.Future[None] | None"]  # prefix+head, body, its sealing


class Outbox:
    """Seals and writes one connection's frames, in order. `take_buffer` lends a (pooled)
    buffer for a sealed body; `on_flushed` runs whenever the backlog shrank; `on_failed` closes
    the connection if a worker thread fails."""

    def __init__(
        self,
        transport: Any,
        sealer: CipherState,
        *,
        take_buffer: Callable[[int], bytearray],
        on_flushed: Callable[[], None],
        on_failed: Callable[[Exception], None],
    ) -> None:
        self._transport = transport  # asyncio's or uvloop's (which is no asyncio.Transport subclass)
        self._sealer = sealer
        self._take_buffer = take_buffer
        self._on_flushed = on_flushed
        self._on_failed = on_failed
        self._backlog: deque[Pending] = deque()
        self.backlog_bytes = 0  # bytes queued behind a body being sealed (writers wait on it)
        self._dropped = False

    @property
    def empty(self) -> bool:
        return not self._backlog

    def send(self, prefix: bytes, head: bytes, body: Buffer | None) -> int:
        """Seal and queue one frame; returns its bytes on the wire. ProtocolError when the
        record counter is exhausted (the caller closes the connection)."""
        sealer = self._sealer
        first = prefix + sealer.seal(head, prefix)
        if not body:
            self._write(first, None)
            return len(first)
        if len(body) < COALESCE_BELOW:
            self._write(first + sealer.seal(body, prefix), None)
        elif len(body) < OFFLOAD_BYTES:
            self._write(first, sealer.seal(body, prefix))
        else:
            aead, nonce = sealer.reserve(len(body))  # on the loop: the nonce follows the send order
            size = len(body) + TAG_BYTES
            out = memoryview(self._take_buffer(size))[:size]
            sealing = asyncio.get_running_loop().run_in_executor(
                crypto_pool(), seal_into, aead, nonce, body, prefix, out
            )
            self._queue(first, out, sealing)
            sealing.add_done_callback(self._flush)
        return len(first) + len(body) + TAG_BYTES

    def drop(self) -> None:
        """The connection is gone: forget the backlog."""
        self._dropped = True
        self._backlog.clear()
        self.backlog_bytes = 0

    def _write(self, first: bytes, second: Buffer | None) -> None:
        if self._backlog:  # a body ahead of this frame is still being sealed
            self._queue(first, second, None)
        elif second is None:
            self._transport.write(first)
        else:
            self._transport.writelines((first, second))

    def _queue(self, first: bytes, second: Buffer | None, sealing: asyncio.Future[None] | None) -> None:
        self._backlog.append((first, second, sealing))
        self.backlog_bytes += len(first) + (len(second) if second is not None else 0)

    def _flush(self, _sealed: object = None) -> None:
        """Write the backlog's frames up to the first body still being sealed."""
        if self._dropped or self._transport.is_closing():  # aborted: uvloop refuses writes now
            return
        while self._backlog:
            first, second, sealing = self._backlog[0]
            if sealing is not None:
                if not sealing.done():
                    break
                if sealing.cancelled() or sealing.exception() is not None:
                    logger.error("sealing a frame failed: %r; closing the connection", sealing)
                    self._on_failed(ProtocolError("a frame could not be sealed"))
                    return
            self._backlog.popleft()
            self.backlog_bytes -= len(first) + (len(second) if second is not None else 0)
            if second is None:
                self._transport.write(first)
            else:
                self._transport.writelines((first, second))
        self._on_flushed()
