"""Connection: one authenticated, encrypted, multiplexed link to a peer (see wire.py).

It runs the handshake (handshake.py), installs the session's ciphers in the FrameProtocol, then
routes every frame by call id: replies to the caller's future, stream frames to their Stream,
new calls to InboundCalls (serving.py), which bounds them (config.max_concurrent_calls) and
gives every handler a deadline. A protocol violation closes the connection with one log line; a
bad request gets an ERROR reply and the connection stays up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from swarm.p2p import handshake as hs
from swarm.p2p.budget import HostStreams, InboundBudget
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import (
    CircuitClosed,
    ConnectionLost,
    HandshakeError,
    MessageTooLarge,
    PeerIDMismatch,
    ProtocolError,
    RemoteError,
    RPCTimeout,
)
from swarm.p2p.framing import FrameProtocol
from swarm.p2p.handlers import CallContext, Handler
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID
from swarm.p2p.serving import InboundCalls
from swarm.p2p.stream import Stream
from swarm.p2p.wire import MAX_CALL_ID, MAX_ERROR_MESSAGE_CHARS, Kind, field

logger = logging.getLogger(__name__)

__all__ = ["CallContext", "Connection"]  # CallContext lives in handlers.py; imported from here too


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
        role_for: Callable[[PeerID], str | None] | None = None,
    ) -> None:
        self.protocol = protocol
        self.role = role
        # an accepted connection may be one end of a hole punch (punch.py), where both ends
        # dialed: its role is then the one the punch agreed for this peer, not "listener"
        self._role_for = role_for
        self.identity = identity
        self.config = config
        self._host_streams = host_streams or HostStreams(config.max_host_streams)  # shared by a host's connections
        self.peer_id: PeerID = identity.peer_id  # replaced by the remote id after the handshake
        self.remote_address: tuple[str, int] = ("?", 0)
        self.remote_window = 0
        self.remote_max_head = hs.PRE_AUTH_MAX_HEAD
        self.chunk_bytes = config.chunk_bytes
        self.authenticated = False
        self.on_closed: Callable[[Connection], None] | None = None
        self.lost_reason: ConnectionLost | None = None  # why it closed, once it has (what its calls raised)
        self._loop = asyncio.get_running_loop()
        self._closed_future: asyncio.Future[None] = self._loop.create_future()
        self._handshake_done: asyncio.Future[None] | None = None
        self._handshake: hs.Handshake | None = None
        self._expected_peer: PeerID | None = None
        self._next_call_id = 1 if role == hs.DIALER else 2
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}  # our unary calls, with their method
        self._streams: dict[int, Stream] = {}  # streams of both sides
        self._inbound = InboundCalls(self, handlers, self._host_streams, self._streams)  # the peer's calls
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
            # an accepted connection expects a peer only when a relay named who is dialing
            what = "dialed" if self.role == hs.DIALER else "the relay announced"
            where = f"{what} {self._expected_peer} at {self._where()}"
            # a node that restarted without its key file, or another node on that address: only a new
            # address line helps, and the error says so
            raise PeerIDMismatch(f"{where} but the peer there is {remote.peer_id}: the node at that address has "
                                 "another identity now (restarted without its key file, or replaced): ask for its "
                                 "current address line (a node keeps its key across restarts unless --identity "
                                 "ephemeral)")  # fmt: skip
        assert self._handshake is not None
        if self._role_for is not None and (role := self._role_for(remote.peer_id)) not in (None, self.role):
            self.role = self._handshake.role = role  # nothing was numbered or signed yet
            self._next_call_id = 1 if role == hs.DIALER else 2
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
            self._last_activity = self._loop.time()
            self._inbound.on_call(call_id, head)
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
            if not ours and (task := self._inbound.tasks.get(call_id)) is not None:
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
        return bool(self._pending or self._streams or self._inbound.tasks)

    @property
    def ours_in_flight(self) -> bool:
        """Calls or streams we started on this connection are not finished."""
        return bool(self._pending) or any(s.is_caller for s in self._streams.values())

    @property
    def theirs_in_flight(self) -> bool:
        """The peer's calls on this connection are being served."""
        return bool(self._inbound.tasks)

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
        # shielded: a waiter that gives up (a timeout) must not cancel the future, which would
        # make the connection look closed to everyone else
        await asyncio.shield(self._closed_future)
        tasks = list(self._inbound.tasks.values())
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
        if isinstance(reason, CircuitClosed):  # a relay ended it: callers see that it was the relay
            error = CircuitClosed(f"relayed connection to {who} lost: {reason}")
        if not_a_node:
            error = ConnectionLost(f"{who} answered, but not as a swarm node (another kind of server? check the "
                                   f"address and port): {reason}")  # fmt: skip
        self.lost_reason = error
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for stream in list(self._streams.values()):
            stream.on_error(error)
        for task in self._inbound.tasks.values():
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
