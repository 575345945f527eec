"""Stream: one streaming call, seen from either end. Both ends write chunks and read chunks.

Flow control is per stream and credit based (wire.py, CREDIT): a writer may have at most the
credit the reader granted in flight, so other calls on the same connection are never stuck
behind a slow reader. A stream starts with the small initial window of HELLO and is granted
more, up to config.stream_window_bytes, only as its reader reads, out of its connection's
InboundBudget (budget.py): a handler that does not read pins one initial window, not a full one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

from swarm.p2p.budget import MIN_SPLIT_BYTES, InboundBudget, credit_to_grant
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import ConnectionLost, P2PError, ProtocolError, RPCTimeout
from swarm.p2p.peer_id import PeerID
from swarm.p2p.wire import Kind

Chunk = bytes | bytearray | memoryview


class StreamConnection(Protocol):
    """What a Stream reads and calls of the Connection it runs on (connection.py): typed here, so
    that a stream does not import the connection that owns it."""

    @property
    def peer_id(self) -> PeerID: ...  # the authenticated peer at the other end

    @property
    def config(self) -> P2PConfig: ...

    @property
    def remote_window(self) -> int: ...  # the credit the peer's HELLO gives every new stream

    @property
    def chunk_bytes(self) -> int: ...  # the largest DATA body the peer takes

    @property
    def budget(self) -> InboundBudget: ...  # what the peer may fill of our memory, all streams together

    def send_frame(self, fields: dict[str, Any], body: Chunk | None = None) -> None: ...

    async def drain(self) -> None: ...

    def send_cancel(self, call_id: int) -> None: ...

    def forget_stream(self, stream: Stream) -> None: ...


class Stream:
    """A bidirectional chunk stream of one call. Caller side: from P2PHost.open_stream;
    callee side: passed to a stream handler. Use ``async with`` (caller) so it always ends."""

    def __init__(self, conn: StreamConnection, call_id: int, method: str, *, is_caller: bool, timeout: float) -> None:
        self._conn = conn
        self.call_id = call_id
        self.method = method
        self.is_caller = is_caller
        self.timeout = timeout
        self._chunks: deque[Chunk] = deque()
        self._read_waiter: asyncio.Future[None] | None = None
        self._received_end = False
        self._sent_end = False
        self._error: P2PError | None = None
        self._send_credit = conn.remote_window
        self._credit_waiter: asyncio.Future[None] | None = None
        # receiving: what the peer may still send, what arrived and is unread (both in the budget)
        self._floor = conn.config.stream_initial_window_bytes  # what HELLO told the peer
        self._window = conn.config.stream_window_bytes
        self._recv_allowance = self._floor
        self._buffered = 0
        self._budget = conn.budget
        self._budget.take(self._floor)
        self._accounted = True  # until the connection forgets the stream
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def peer_id(self) -> PeerID:
        return self._conn.peer_id

    @property
    def finished(self) -> bool:
        return self._error is not None or (self._received_end and self._sent_end)

    # --- writing --------------------------------------------------------------------------

    async def write(self, data: Chunk, *, timeout: float | None = None) -> None:
        """Send data (split into chunks of config.chunk_bytes). Zero-copy: the buffer is handed
        to the transport, so it must not be modified after this call."""
        if self._sent_end:
            raise P2PError(f"write after end() on stream {self.method}")
        self._raise_if_failed()
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        step, offset = self._conn.chunk_bytes, 0
        while offset < len(view):
            want = min(step, len(view) - offset)
            await self._wait_for_credit(min(want, MIN_SPLIT_BYTES), timeout)
            piece = view[offset : offset + min(want, self._send_credit)]  # what the reader granted
            offset += len(piece)
            self._send_credit -= len(piece)
            self._conn.send_frame({"k": Kind.DATA, "i": self.call_id}, piece)
            self.bytes_sent += len(piece)
            await self._conn.drain()

    async def end(self) -> None:
        """Half-close: no more writes from this side. Idempotent."""
        if self._sent_end or self._error is not None:
            return
        self._sent_end = True
        self._conn.send_frame({"k": Kind.END, "i": self.call_id})
        self._forget_if_finished()

    async def _wait_for_credit(self, needed: int, timeout: float | None) -> None:
        while self._send_credit < needed:
            self._raise_if_failed()
            self._credit_waiter = asyncio.get_running_loop().create_future()
            await self._wait(self._credit_waiter, timeout, "credit to write")
        self._raise_if_failed()

    # --- reading --------------------------------------------------------------------------

    async def read(self, *, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None once the other side has ended its writes."""
        while not self._chunks:
            self._raise_if_failed()
            if self._received_end:
                return None
            self._top_up()  # a reader is here: the window may grow
            self._read_waiter = asyncio.get_running_loop().create_future()
            await self._wait(self._read_waiter, timeout, "the next chunk")
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._accounted:
            self._budget.give_back(len(chunk))
            self._top_up()  # this stream first, then the others waiting for budget
            self._budget.offer()
        return chunk

    async def read_all(self, *, max_bytes: int, timeout: float | None = None) -> bytearray:
        """Read until the end into one buffer; P2PError if the peer sends more than max_bytes."""
        out = bytearray()
        while (chunk := await self.read(timeout=timeout)) is not None:
            if len(out) + len(chunk) > max_bytes:
                await self.cancel()
                raise P2PError(f"stream {self.method} sent more than {max_bytes} bytes")
            out += chunk
        return out

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await self.read()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    def _top_up(self) -> None:
        """Grant the peer more credit, as far as the window and the connection's budget allow."""
        if self._received_end or self._error is not None or not self._accounted:
            return
        outstanding = self._recv_allowance + self._buffered
        grant = credit_to_grant(
            outstanding=outstanding, window=self._window, floor=self._floor, budget_free=self._budget.free
        )
        if grant:
            self._recv_allowance += grant
            self._budget.take(grant)
            try:
                self._conn.send_frame({"k": Kind.CREDIT, "i": self.call_id, "n": grant})
            except ConnectionLost:
                pass  # the next read reports it
        if self._window - outstanding - grant >= self._window // 4:
            self._budget.wants_more(self.call_id, self._offered)
        else:
            self._budget.satisfied(self.call_id)

    def _offered(self) -> None:
        """The budget has room again: take it if our reader is waiting for data (a reader busy
        elsewhere asks again when it next reads)."""
        if self._read_waiter is not None and not self._read_waiter.done():
            self._top_up()
        else:
            self._budget.satisfied(self.call_id)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not read yet."""
        return self._buffered

    def release_budget(self) -> None:
        """The connection forgot the stream: no more DATA will be taken for it, and what it
        committed goes back to the budget (called once, by Connection.forget_stream)."""
        if self._accounted:
            self._accounted = False
            self._budget.give_back(self._recv_allowance + self._buffered)
            self._budget.satisfied(self.call_id)
            self._budget.offer()

    # --- ending ---------------------------------------------------------------------------

    async def cancel(self) -> None:
        """Abandon the call: the other side is told (CANCEL from a caller, ERROR from a callee)."""
        self.abandon()

    def abandon(self) -> None:
        """cancel(), from code that cannot await (a transport's callbacks)."""
        if self.finished:
            return
        if self.is_caller and not self._received_end:  # after END the callee is done already
            self._conn.send_cancel(self.call_id)
        self._fail(P2PError(f"stream {self.method} was cancelled locally"))

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.cancel()

    # --- called by the connection when frames arrive -----------------------------------------

    def on_data(self, body: Chunk) -> None:
        if self._received_end or self._error is not None:
            return  # late data after we failed the stream; the window no longer matters
        self._recv_allowance -= len(body)
        if self._recv_allowance < 0:
            raise ProtocolError(f"peer sent beyond the stream window on {self.method}")
        self._chunks.append(body)
        self._buffered += len(body)
        self.bytes_received += len(body)
        _wake(self._read_waiter)

    def on_end(self) -> None:
        self._received_end = True
        if self._accounted:  # no more DATA will come: the unused credit is free again
            self._budget.give_back(self._recv_allowance)
            self._budget.satisfied(self.call_id)
            self._budget.offer()
        self._recv_allowance = 0
        _wake(self._read_waiter)
        self._forget_if_finished()

    def on_credit(self, nbytes: int) -> None:
        self._send_credit += nbytes
        _wake(self._credit_waiter)

    def on_error(self, error: P2PError) -> None:
        self._fail(error)

    def _fail(self, error: P2PError) -> None:
        if self._error is None:
            self._error = error
        _wake(self._read_waiter)
        _wake(self._credit_waiter)
        self._conn.forget_stream(self)  # gives back what it committed
        self._chunks.clear()
        self._buffered = 0

    def _forget_if_finished(self) -> None:
        if self._received_end and self._sent_end:
            self._conn.forget_stream(self)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def _wait(self, waiter: asyncio.Future[None], timeout: float | None, what: str) -> None:
        timeout = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        handle = loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            raise RPCTimeout(f"stream {self.method}: no {what} within {timeout:.1f}s") from None
        finally:
            handle.cancel()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
