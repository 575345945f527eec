"""Connection: one authenticated, encrypted, multiplexed link to a peer (see wire.py).

It runs the handshake (handshake.py), installs the session's ciphers in the FrameProtocol, then
routes every frame by call id: replies to the caller's future,
stream frames to their Stream, new calls to a handler task. Inbound calls are bounded
(config.max_concurrent_calls) and every handler has a deadline; a protocol violation closes
the connection with one log line; a bad request gets an ERROR reply and the connection stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from swarm.p2p import handshake as hs
from swarm.p2p.budget import HostStreams, InboundBudget
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import (
    ConnectionLost,
    HandshakeError,
    MessageTooLarge,
    PeerIDMismatch,
    ProtocolError,
    RemoteError,
    RPCError,
    RPCTimeout,
)
from swarm.p2p.framing import FrameProtocol
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream
from swarm.p2p.wire import MAX_CALL_ID, MAX_ERROR_MESSAGE_CHARS, MAX_METHOD_CHARS, ErrorCode, Kind, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call it serves."""

    peer_id: PeerID  # the authenticated caller
    method: str
    remote_address: tuple[str, int]  # the caller's IP and port as seen by us


UnaryHandler = Callable[[CallContext, Any], Awaitable[Any]]
StreamHandler = Callable[[CallContext, Any, Stream], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Handler:
    fn: UnaryHandler | StreamHandler
    is_stream: bool


class Connection:
    """An authenticated connection. Create with Connection(...), then await handshake()."""

    def __init__(
        self,
        protocol: FrameProtocol,
        *,
        role: str,
        identity: Identity,
        config: P2PConfig,
        handlers: Mapping[str, Handler],
        host_streams: HostStreams | None = None,
    ) -> None:
        self.protocol = protocol
        self.role = role
        self.identity = identity
        self.config = config
        self._handlers = handlers
        self._host_streams = host_streams or HostStreams(config.max_host_streams)  # shared by a host's connections
        self.peer_id: PeerID = identity.peer_id  # replaced by the remote id after the handshake
        self.remote_address: tuple[str, int] = ("?", 0)
        self.remote_window = 0
        self.remote_max_head = hs.PRE_AUTH_MAX_HEAD
        self.chunk_bytes = config.chunk_bytes
        self.authenticated = False
        self.on_closed: Callable[[Connection], None] | None = None
        self._loop = asyncio.get_running_loop()
        self._closed_future: asyncio.Future[None] = self._loop.create_future()
        self._handshake_done: asyncio.Future[None] | None = None
        self._handshake: hs.Handshake | None = None
        self._expected_peer: PeerID | None = None
        self._next_call_id = 1 if role == hs.DIALER else 2
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}  # our unary calls, with their method
        self._streams: dict[int, Stream] = {}  # streams of both sides
        self._inbound: dict[int, asyncio.Task[None]] = {}  # handler tasks of the peer's calls
        self._deadlines: dict[int, asyncio.TimerHandle] = {}  # unary handlers whose deadline has not passed
        self._last_activity = self._loop.time()
        self.budget = InboundBudget(config.connection_buffer_bytes)  # shared by all streams (budget.py)
        self._idle_handle: asyncio.TimerHandle | None = None
        protocol.max_head, protocol.max_body = hs.PRE_AUTH_MAX_HEAD, 0
        protocol.on_lost = self._on_lost
        peername = protocol.transport.get_extra_info("peername") if protocol.transport else None
        if peername:
            self.remote_address = (str(peername[0]), int(peername[1]))

    # --- handshake ------------------------------------------------------------------------
    # The handshake runs inside the frame callback, synchronously, so that the frames a peer
    # sends right after its AUTH (often in the same TCP segment) are parsed with the limits and
    # the router of an authenticated connection.

    async def handshake(self, expected_peer: PeerID | None = None, *, probe: bool = False) -> None:
        """Prove our key, check theirs; raises HandshakeError (and closes) on any failure.
        probe: tell the listener this connection only tests reachability."""
        self._expected_peer = expected_peer
        self._handshake_done = self._loop.create_future()
        cfg = self.config
        self._handshake = hs.Handshake(
            self.identity,
            self.role,
            encrypt=cfg.encryption,
            window=cfg.stream_initial_window_bytes,  # more as each stream's reader reads (budget.py)
            max_head=cfg.max_head_bytes,
            max_body=cfg.max_body_bytes,
            probe=probe,
        )
        handle = self._loop.call_later(
            cfg.handshake_timeout, self._handshake_failed, HandshakeError(f"handshake with {self._where()} timed out")
        )
        try:
            self.protocol.send(self._handshake.hello_fields)
            self.protocol.set_frame_handler(self._on_handshake_frame)
            await self._handshake_done
        except ConnectionLost as e:
            error = HandshakeError(f"handshake with {self._where()}: {e}")
            self._abort(error)
            raise error from None
        finally:
            handle.cancel()

    def _on_handshake_frame(self, head: dict[str, Any], body: bytes | memoryview) -> None:
        assert self._handshake is not None
        try:
            if self._handshake.remote is None:
                self._on_hello(hs.parse_hello(head))
            else:
                self._on_auth(head)
        except (HandshakeError, ProtocolError, ConnectionLost) as e:
            error = e if isinstance(e, HandshakeError) else HandshakeError(f"handshake with {self._where()}: {e}")
            self._handshake_failed(error)

    @property
    def remote_hello_probe(self) -> bool:
        """The peer dialed only to test that it can reach us (see wire.py, HELLO)."""
        return self._handshake is not None and self._handshake.remote is not None and self._handshake.remote.probe

    def _on_hello(self, remote: hs.Hello) -> None:
        if remote.peer_id == self.identity.peer_id:
            raise HandshakeError("connected to ourselves")
        if self._expected_peer is not None and remote.peer_id != self._expected_peer:
            raise PeerIDMismatch(
                f"dialed {self._expected_peer} at {self._where()} but the peer there is {remote.peer_id}"
            )
        assert self._handshake is not None
        auth, sealer = self._handshake.on_hello(remote)
        self.protocol.send(auth)
        if sealer is not None:
            self.protocol.seal_sent_frames(sealer)

    def _on_auth(self, head: dict[str, Any]) -> None:
        assert self._handshake is not None and self._handshake.remote is not None
        remote = self._handshake.remote
        opener = self._handshake.on_auth(head)
        if opener is not None:
            self.protocol.open_received_frames(opener)
        self.peer_id = remote.peer_id
        self.remote_window = remote.window
        self.remote_max_head = remote.max_head
        self.chunk_bytes = min(self.config.chunk_bytes, remote.max_body)  # credit may split it further
        self.authenticated = True
        self.protocol.max_head = self.config.max_head_bytes
        self.protocol.max_body = self.config.max_body_bytes
        self.protocol.set_frame_handler(self._on_frame)
        self._arm_idle_timer(self.config.idle_timeout)
        if not self._handshake_done.done():
            self._handshake_done.set_result(None)

    def _handshake_failed(self, error: HandshakeError) -> None:
        self._abort(error)
        if self._handshake_done is not None and not self._handshake_done.done():
            self._handshake_done.set_exception(error)

    # --- outbound calls ---------------------------------------------------------------------

    def _new_call_id(self) -> int:
        call_id = self._next_call_id
        self._next_call_id = call_id + 2 if call_id + 2 <= MAX_CALL_ID else (1 if self.role == hs.DIALER else 2)
        return call_id

    async def call(self, method: str, args: Any, timeout: float) -> Any:
        call_id = self._new_call_id()
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = (future, method)
        try:
            self._send_call(call_id, method, args, stream=False)
            handle = self._loop.call_later(timeout, _expire, future)
            try:
                return await future
            finally:
                handle.cancel()
        except TimeoutError:
            self.send_cancel(call_id)
            raise RPCTimeout(f"{method} to {self.peer_id} timed out after {timeout:.3g}s") from None
        except asyncio.CancelledError:
            self.send_cancel(call_id)
            raise
        finally:
            self._pending.pop(call_id, None)

    def open_stream(self, method: str, args: Any, timeout: float) -> Stream:
        call_id = self._new_call_id()
        stream = Stream(self, call_id, method, is_caller=True, timeout=timeout)
        self._streams[call_id] = stream
        try:
            self._send_call(call_id, method, args, stream=True)
        except BaseException:
            self.forget_stream(stream)
            raise
        return stream

    def _send_call(self, call_id: int, method: str, args: Any, *, stream: bool) -> None:
        self._last_activity = self._loop.time()
        frame = {"k": Kind.CALL, "i": call_id, "m": method, "a": args, "s": stream}
        self.send_frame(frame)

    def send_cancel(self, call_id: int) -> None:
        if not self.protocol.closed:
            self.send_frame({"k": Kind.CANCEL, "i": call_id})

    # --- frames in --------------------------------------------------------------------------

    def _is_ours(self, call_id: int) -> bool:
        return (call_id % 2 == 1) == (self.role == hs.DIALER)

    def _on_frame(self, head: dict[str, Any], body: bytes | memoryview) -> None:
        kind, call_id = head["k"], head.get("i", 0)
        ours = self._is_ours(call_id)
        if kind == Kind.CALL:
            if ours:
                raise ProtocolError("peer started a call with an id from our range")
            self._on_call(call_id, head)
        elif kind == Kind.REPLY or kind == Kind.ERROR:
            self._on_reply(call_id, head, ours)
        elif kind == Kind.DATA:
            if (stream := self._streams.get(call_id)) is not None:
                stream.on_data(body)
        elif kind == Kind.END:
            if (stream := self._streams.get(call_id)) is not None:
                stream.on_end()
        elif kind == Kind.CREDIT:
            credit = field(head, "n", int)
            if credit <= 0 or credit > 2**32:
                raise ProtocolError(f"bad CREDIT amount {credit}")
            if (stream := self._streams.get(call_id)) is not None:
                stream.on_credit(credit)
        elif kind == Kind.CANCEL:
            if not ours and (task := self._inbound.get(call_id)) is not None:
                task.cancel()
        else:
            raise ProtocolError(f"unexpected {Kind(kind).name} frame after the handshake")

    def _on_reply(self, call_id: int, head: dict[str, Any], ours: bool) -> None:
        if not ours:
            raise ProtocolError(f"peer sent {Kind(head['k']).name} for a call it did not receive")
        pending = self._pending.get(call_id)
        if head["k"] == Kind.REPLY:
            if pending is not None and not pending[0].done():
                pending[0].set_result(head.get("r"))
            return
        code = str(field(head, "c", str))[:64]
        message = str(field(head, "e", str))[:MAX_ERROR_MESSAGE_CHARS]
        stream = self._streams.get(call_id)
        method = stream.method if stream is not None else pending[1] if pending is not None else ""
        error = RemoteError(code, message, method=method, peer=str(self.peer_id))
        if pending is not None and not pending[0].done():
            pending[0].set_exception(error)
        elif stream is not None:
            stream.on_error(error)

    def _on_call(self, call_id: int, head: dict[str, Any]) -> None:
        self._last_activity = self._loop.time()
        method = field(head, "m", str)
        is_stream = head.get("s") is True
        n_streams = sum(not s.is_caller for s in self._streams.values()) if is_stream else 0
        busy = n_streams >= self.config.max_concurrent_streams or (is_stream and not self._host_streams.admit(self))
        if len(self._inbound) >= self.config.max_concurrent_calls or busy:
            logger.warning(
                "%s: refusing %s from %s: %d calls (%d streams) in flight",
                self.identity.peer_id,
                method[:64],
                self.peer_id,
                len(self._inbound),
                n_streams,
            )
            self._send_error(call_id, ErrorCode.BUSY, "too many concurrent calls on this connection")
            return  # DATA the peer sends for it meanwhile finds no stream and is dropped
        if call_id in self._inbound or call_id in self._streams:
            raise ProtocolError(f"peer reused call id {call_id} while it was in flight")
        handler = self._handlers.get(method) if len(method) <= MAX_METHOD_CHARS else None
        if handler is None:
            logger.info("%s: unknown method %r called by %s", self.identity.peer_id, method[:64], self.peer_id)
            self._send_error(call_id, ErrorCode.UNKNOWN_METHOD, f"no method named {method[:MAX_METHOD_CHARS]!r}")
            return
        if handler.is_stream != is_stream:
            kind = "a stream" if handler.is_stream else "a unary"
            self._send_error(call_id, ErrorCode.BAD_REQUEST, f"{method} is {kind} method")
            return
        context = CallContext(self.peer_id, method, self.remote_address)
        if is_stream:
            stream = Stream(self, call_id, method, is_caller=False, timeout=self.config.stream_timeout)
            self._streams[call_id] = stream
            self._host_streams.opened(self)
            coro = self._serve_stream(handler.fn, context, head.get("a"), stream)  # type: ignore[arg-type]
        else:
            coro = self._serve_unary(handler.fn, context, head.get("a"), call_id)  # type: ignore[arg-type]
        task = self._loop.create_task(coro)
        self._inbound[call_id] = task
        if not is_stream:
            self._deadlines[call_id] = self._loop.call_later(self.config.handler_timeout, self._deadline, call_id, task)

    def _deadline(self, call_id: int, task: asyncio.Task[None]) -> None:
        del self._deadlines[call_id]  # its absence tells _serve_unary why it was cancelled
        task.cancel()

    async def _serve_unary(self, fn: UnaryHandler, context: CallContext, args: Any, call_id: int) -> None:
        try:
            result = await fn(context, args)
            self._send_reply(call_id, context.method, result)
        except asyncio.CancelledError:
            if call_id not in self._deadlines:
                self._send_error(call_id, ErrorCode.TIMEOUT, f"handler ran over {self.config.handler_timeout}s")
            # otherwise the caller cancelled or we are closing: nothing more to say
        except Exception as e:
            self._send_handler_error(call_id, context, e)
        finally:
            self._inbound.pop(call_id, None)
            if (deadline := self._deadlines.pop(call_id, None)) is not None:
                deadline.cancel()

    async def _serve_stream(self, fn: StreamHandler, context: CallContext, args: Any, stream: Stream) -> None:
        call_id = stream.call_id
        try:
            await fn(context, args, stream)
            await stream.end()
        except asyncio.CancelledError:
            pass  # the caller cancelled, or we are closing
        except ConnectionLost:
            pass  # the connection closed under the handler: nobody left to answer
        except Exception as e:
            self._send_handler_error(call_id, context, e)
        finally:
            self._inbound.pop(call_id, None)
            self.forget_stream(stream)

    def _send_reply(self, call_id: int, method: str, result: Any) -> None:
        try:
            self.send_frame({"k": Kind.REPLY, "i": call_id, "r": result})
        except MessageTooLarge as e:
            self._send_error(call_id, ErrorCode.TOO_LARGE, str(e))
        except (TypeError, ValueError, OverflowError) as e:  # not msgpack-able: our handler's bug
            logger.error("%s: reply of %s cannot be encoded: %s", self.identity.peer_id, method, e)
            self._send_error(call_id, ErrorCode.INTERNAL, "the reply could not be encoded")

    def _send_handler_error(self, call_id: int, context: CallContext, error: Exception) -> None:
        if isinstance(error, RPCError):
            logger.info("%s: %s from %s refused: %s", self.identity.peer_id, context.method, context.peer_id, error)
            self._send_error(call_id, error.code, error.message)
        elif isinstance(error, ConnectionLost):
            pass
        else:
            logger.exception(
                "%s: handler %s failed on a call from %s",
                self.identity.peer_id,
                context.method,
                context.peer_id,
                exc_info=error,
            )
            self._send_error(call_id, ErrorCode.INTERNAL, f"{type(error).__name__} in the handler")

    def _send_error(self, call_id: int, code: str, message: str) -> None:
        if not self.protocol.closed:
            with contextlib.suppress(ConnectionLost):  # closing under us: nobody left to tell
                self.send_frame({"k": Kind.ERROR, "i": call_id, "c": code, "e": message[:MAX_ERROR_MESSAGE_CHARS]})

    # --- used by Stream ---------------------------------------------------------------------

    def send_frame(self, fields: dict[str, Any], body: bytes | bytearray | memoryview | None = None) -> None:
        self.protocol.send(fields, body, max_head=self.remote_max_head)

    async def drain(self) -> None:
        await self.protocol.drain()

    def forget_stream(self, stream: Stream) -> None:
        """Stop routing frames to the stream and give back the budget it committed."""
        if self._streams.get(stream.call_id) is stream:
            del self._streams[stream.call_id]
            if not stream.is_caller:
                self._host_streams.closed(self)
        stream.release_budget()

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed_future.done()

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._streams or self._inbound)

    @property
    def ours_in_flight(self) -> bool:
        """Calls or streams we started on this connection are not finished."""
        return bool(self._pending) or any(s.is_caller for s in self._streams.values())

    @property
    def theirs_in_flight(self) -> bool:
        """The peer's calls on this connection are being served."""
        return bool(self._inbound)

    @property
    def idle_seconds(self) -> float:
        return self._loop.time() - self._last_activity

    @property
    def buffered_bytes(self) -> int:
        """Stream data received on this connection and not read yet."""
        return sum(s.buffered_bytes for s in self._streams.values())

    def _arm_idle_timer(self, delay: float) -> None:
        self._idle_handle = self._loop.call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        idle_for = self._loop.time() - self._last_activity
        if self.busy or idle_for < self.config.idle_timeout:
            self._arm_idle_timer(max(self.config.idle_timeout - idle_for, 1.0))
        else:
            logger.debug("%s: closing idle connection to %s", self.identity.peer_id, self.peer_id)
            self.close()

    def close(self) -> None:
        self.protocol.close()

    def _abort(self, reason: Exception) -> None:
        self.protocol.abort(reason)

    async def wait_closed(self) -> None:
        await self._closed_future
        tasks = list(self._inbound.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_lost(self, reason: Exception | None) -> None:
        garbled = isinstance(reason, (ProtocolError, MessageTooLarge))
        # what we dialed answered in another protocol (an HTTP server, a wrong port): the caller's
        # error says so in one line, no warning beside it
        not_a_node = garbled and not self.authenticated and self.role == hs.DIALER
        if garbled:
            peer = self.peer_id if self.authenticated else "an unauthenticated peer"
            logger.log(logging.INFO if not_a_node else logging.WARNING, "%s: closed connection to %s (%s): %s",
                       self.identity.peer_id, peer, self._where(), reason)  # fmt: skip
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        who = self.peer_id if self.authenticated else self._where()
        error = ConnectionLost(f"connection to {who} lost: {reason or 'closed'}")
        if not_a_node:
            error = ConnectionLost(f"{who} answered, but not as a swarm node (another kind of server? check the "
                                   f"address and port): {reason}")  # fmt: skip
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for stream in list(self._streams.values()):
            stream.on_error(error)
        for task in self._inbound.values():
            task.cancel()
        if self._handshake_done is not None and not self._handshake_done.done():
            self._handshake_done.set_exception(error)
        if not self._closed_future.done():
            self._closed_future.set_result(None)
        if self.on_closed is not None:
            self.on_closed(self)

    def _where(self) -> str:
        return f"{self.remote_address[0]}:{self.remote_address[1]}"


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
