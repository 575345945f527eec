"""CircuitTransport: an asyncio transport whose bytes travel on one stream call through a relay.

A relayed connection is an ordinary Connection (handshake, encryption, calls, streams) on a
FrameProtocol, like one on a TCP socket; only its transport differs. This one writes what the
protocol sends as DATA chunks of a relay stream (relay_wire.py, hop or accept) and feeds the
chunks it reads to the protocol, so the relay sees the sealed frames of the end-to-end session
and nothing else.

It offers what FrameProtocol uses of a socket transport: write/writelines, flow control both ways
(pause_writing above the high-water mark; pause_reading holds the chunks back), close (flush, END,
then wait briefly for the far end's END, as a FIN does) and abort. It calls the protocol's
connection_lost once, with CircuitClosed when the relay ended the circuit (its limits) and
ConnectionLost when the connection to the relay went away. Pacing and bytes_acked see no socket
here: a relayed connection is not paced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

from swarm.p2p.errors import CircuitClosed, ConnectionLost, P2PError, RemoteError, RPCTimeout
from swarm.p2p.maddr import TcpAddress
from swarm.p2p.stream import Stream
from swarm.p2p.wire import ErrorCode

logger = logging.getLogger(__name__)

CIRCUIT_HOST = "p2p-circuit"  # the "host" of a relayed connection's peername: (f"{relay}/p2p-circuit", 0)
CLOSE_GRACE_S = 2.0  # how long a closing end waits for the far end's END before it cancels
READ_SLACK_S = 30.0  # past the circuit's time limit, a silent relay is taken for dead

Buffer = bytes | bytearray | memoryview


class CircuitTransport(asyncio.Transport):
    """The transport of one relayed connection (see the module docstring). `start()` hands it to
    the protocol (connection_made) and starts its two pumps; it owns them and ends them itself."""

    def __init__(
        self,
        stream: Stream,
        protocol: asyncio.BufferedProtocol,
        *,
        peername: tuple[str, int],
        time_limit_s: float,
        observed: TcpAddress | None = None,
        peer_observed: TcpAddress | None = None,
    ) -> None:
        super().__init__()
        # what the relay saw of each end: where hole punching (punch.py) dials, and whom it trusts
        self._extra = {"peername": peername, "circuit": True, "observed": observed, "peer_observed": peer_observed}
        self._stream = stream
        self._protocol = protocol
        self._peername = peername
        self._read_timeout = time_limit_s + READ_SLACK_S
        self._queue: deque[Buffer] = deque()
        self._queued = 0
        self._high, self._low = 64 * 1024, 16 * 1024
        self._writing_paused = False
        self._have_data = asyncio.Event()
        self._reading = asyncio.Event()
        self._reading.set()
        self._closing = False
        self._sent_end = self._got_end = False
        self._lost = False
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> CircuitTransport:
        self._protocol.connection_made(self)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop()), loop.create_task(self._write_loop())]
        for task in self._tasks:
            task.add_done_callback(self._pump_done)
        return self

    async def wait_closed(self) -> None:
        """Until connection_lost was delivered (bounded by the pumps' own timeouts)."""
        await asyncio.shield(self._closed)

    # --- what the protocol calls ------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = 64 * 1024 if high is None else high
        self._low = self._high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        return self._queued

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def write(self, data: Buffer) -> None:
        if self._closing or self._lost or not data:
            return
        self._queue.append(data)  # kept, not copied: the protocol does not reuse a buffer we hold
        self._queued += len(data)
        self._have_data.set()
        if not self._writing_paused and self._queued > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def is_reading(self) -> bool:
        return self._reading.is_set()

    def close(self) -> None:
        """Send what is queued, then END; the far end's END (or CLOSE_GRACE_S) completes it."""
        self._closing = True
        self._have_data.set()

    def abort(self) -> None:
        self._closing = True
        self._queue.clear()
        self._queued = 0
        self._lose(None)

    # --- the pumps ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while (chunk := await self._stream.read(timeout=self._read_timeout)) is not None:
                await self._feed(memoryview(chunk).cast("B"))
        except RemoteError as e:
            self._lose(_remote_closed(e))
            return
        except RPCTimeout:
            self._lose(CircuitClosed(f"the relay passed no bytes for {self._read_timeout:.0f}s"))
            return
        except asyncio.TimeoutError:  # _feed: our protocol held reading paused that long
            self._lose(ConnectionLost(f"reading stayed paused for {self._read_timeout:.0f}s"))
            return
        except P2PError as e:
            self._lose(ConnectionLost(f"the connection to the relay was lost: {e}"))
            return
        self._got_end = True
        if self._sent_end:
            self._lose(None)  # both sides ended: a clean close
        elif not self._lost and not self._closing:
            self._protocol.eof_received()  # FrameProtocol answers False: we close our side too
            self.close()

    async def _feed(self, view: memoryview) -> None:
        protocol = self._protocol
        while view and not self._lost:
            if not self._reading.is_set():  # a body is being opened in a thread: hold the rest back
                await asyncio.wait_for(self._reading.wait(), self._read_timeout)
                continue
            buffer = protocol.get_buffer(len(view))
            n = min(len(buffer), len(view))
            if n == 0:
                raise P2PError("the protocol offered no buffer while reading")
            buffer[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]

    async def _write_loop(self) -> None:
        stream = self._stream
        try:
            while True:
                while self._queue:
                    data = self._queue[0]
                    await stream.write(data)
                    self._queue.popleft()
                    self._queued -= len(data)
                    if self._writing_paused and self._queued <= self._low:
                        self._writing_paused = False
                        self._protocol.resume_writing()
                if self._closing:
                    break
                self._have_data.clear()
                await self._have_data.wait()  # woken by write() or close(); abort cancels us
            await stream.end()
        except RemoteError as e:
            self._lose(_remote_closed(e))
            return
        except P2PError as e:
            self._lose(ConnectionLost(f"the connection to the relay was lost: {e}"))
            return
        self._sent_end = True
        if self._got_end:
            self._lose(None)
            return
        # our END is out: the far end answers with its own, which ends the read loop
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._closed), CLOSE_GRACE_S)
        self._lose(None)

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.error("relayed connection to %s failed", self._peername[0], exc_info=error)
            self._lose(ConnectionLost(f"relayed connection failed: {error!r}"))

    def _lose(self, reason: Exception | None) -> None:
        """Deliver connection_lost once, stop both pumps, and tell the relay we are gone."""
        if self._lost:
            return
        self._lost = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        with contextlib.suppress(ConnectionLost):  # the relay's connection is closing: nobody to tell
            self._stream.abandon()  # at most a CANCEL to the relay, and the stream's budget back
        asyncio.get_running_loop().call_soon(self._deliver_lost, reason)

    def _deliver_lost(self, reason: Exception | None) -> None:
        try:
            self._protocol.connection_lost(reason)
        finally:
            if not self._closed.done():
                self._closed.set_result(None)


def circuit_peername(relay: object) -> tuple[str, int]:
    """The peername of a connection relayed by `relay`: every circuit through one relay counts as
    one source in the host's per-source caps (admission.py), and autonat's same-IP check fails
    for it, so a relayed peer cannot ask to be dialed back."""
    return (f"{relay}/{CIRCUIT_HOST}", 0)


def is_relayed(remote_address: tuple[str, int]) -> bool:
    return remote_address[0].endswith("/" + CIRCUIT_HOST)


def _remote_closed(error: RemoteError) -> ConnectionLost:
    if error.code == ErrorCode.CIRCUIT_LIMIT:
        return CircuitClosed(f"the relay closed the circuit: {error.message}")
    return CircuitClosed(f"the relay ended the circuit ({error.code}): {error.message}")
