"""InboundCalls: the peer's calls on one connection, from the CALL frame to the last reply.

A CALL is admitted against the connection's caps (config.max_concurrent_calls and
max_concurrent_streams) and the host's inbound streams (budget.HostStreams); its method is
looked up and its handler runs in a task of its own. A unary handler has config.handler_timeout
to answer; a stream handler's stream is ended when it returns. What a handler raises becomes an
ERROR reply: an RPCError keeps its code, anything else is INTERNAL and logged with its traceback.
A refused, unknown or mistyped call gets its ERROR and the connection stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from swarm.p2p.budget import HostStreams
from swarm.p2p.errors import ConnectionLost, MessageTooLarge, ProtocolError, RPCError
from swarm.p2p.framing import FrameProtocol
from swarm.p2p.handlers import CallContext, Handler, StreamHandler, UnaryHandler
from swarm.p2p.identity import Identity
from swarm.p2p.stream import Stream, StreamConnection
from swarm.p2p.wire import MAX_ERROR_MESSAGE_CHARS, MAX_METHOD_CHARS, ErrorCode, Kind, field

logger = logging.getLogger(__name__)


class ServedConnection(StreamConnection, Protocol):
    """What InboundCalls reads of the Connection that owns it, besides what the streams of the
    calls it accepts read (StreamConnection): typed here, so that serving does not import the
    connection."""

    @property
    def identity(self) -> Identity: ...  # ours: the name our log lines give

    @property
    def remote_address(self) -> tuple[str, int]: ...  # the caller's IP and port as seen by us

    @property
    def protocol(self) -> FrameProtocol: ...  # closed: nobody left to tell of an error


class InboundCalls:
    """The calls the peer made on one connection (see the module docstring).

    Owns the handler task of every inbound call in flight (`tasks`, by call id) and the deadline
    of every unary one. It shares the connection's stream table (`streams`), where it adds the
    stream of each stream call it accepts. The connection hands it every CALL frame (`on_call`),
    cancels a task on CANCEL, and cancels them all when it is lost."""

    def __init__(
        self,
        conn: ServedConnection,
        handlers: Mapping[str, Handler],
        host_streams: HostStreams,
        streams: dict[int, Stream],
    ) -> None:
        self._conn = conn
        self._handlers = handlers
        self._host_streams = host_streams  # shared by a host's connections
        self._streams = streams  # the connection's: streams of both sides
        self._loop = asyncio.get_running_loop()
        self.tasks: dict[int, asyncio.Task[None]] = {}  # handler tasks of the peer's calls
        self._deadlines: dict[int, asyncio.TimerHandle] = {}  # unary handlers whose deadline has not passed

    def on_call(self, call_id: int, head: dict[str, Any]) -> None:
        conn, config = self._conn, self._conn.config
        method = field(head, "m", str)
        is_stream = head.get("s") is True
        n_streams = sum(not s.is_caller for s in self._streams.values()) if is_stream else 0
        busy = n_streams >= config.max_concurrent_streams or (is_stream and not self._host_streams.admit(conn))
        if len(self.tasks) >= config.max_concurrent_calls or busy:
            logger.warning(
                "%s: refusing %s from %s: %d calls (%d streams) in flight",
                conn.identity.peer_id,
                method[:64],
                conn.peer_id,
                len(self.tasks),
                n_streams,
            )
            self._send_error(call_id, ErrorCode.BUSY, "too many concurrent calls on this connection")
            return  # DATA the peer sends for it meanwhile finds no stream and is dropped
        if call_id in self.tasks or call_id in self._streams:
            raise ProtocolError(f"peer reused call id {call_id} while it was in flight")
        handler = self._handlers.get(method) if len(method) <= MAX_METHOD_CHARS else None
        if handler is None:
            logger.info("%s: unknown method %r called by %s", conn.identity.peer_id, method[:64], conn.peer_id)
            self._send_error(call_id, ErrorCode.UNKNOWN_METHOD, f"no method named {method[:MAX_METHOD_CHARS]!r}")
            return
        if handler.is_stream != is_stream:
            kind = "a stream" if handler.is_stream else "a unary"
            self._send_error(call_id, ErrorCode.BAD_REQUEST, f"{method} is {kind} method")
            return
        context = CallContext(conn.peer_id, method, conn.remote_address)
        if is_stream:
            stream = Stream(conn, call_id, method, is_caller=False, timeout=config.stream_timeout)
            self._streams[call_id] = stream
            self._host_streams.opened(conn)
            coro = self._serve_stream(handler.fn, context, head.get("a"), stream)  # type: ignore[arg-type]
        else:
            coro = self._serve_unary(handler.fn, context, head.get("a"), call_id)  # type: ignore[arg-type]
        task = self._loop.create_task(coro)
        self.tasks[call_id] = task
        if not is_stream:
            self._deadlines[call_id] = self._loop.call_later(config.handler_timeout, self._deadline, call_id, task)

    def _deadline(self, call_id: int, task: asyncio.Task[None]) -> None:
        del self._deadlines[call_id]  # its absence tells _serve_unary why it was cancelled
        task.cancel()

    async def _serve_unary(self, fn: UnaryHandler, context: CallContext, args: Any, call_id: int) -> None:
        try:
            result = await fn(context, args)
            self._send_reply(call_id, context.method, result)
        except asyncio.CancelledError:
            if call_id not in self._deadlines:
                self._send_error(call_id, ErrorCode.TIMEOUT, f"handler ran over {self._conn.config.handler_timeout}s")
            # otherwise the caller cancelled or we are closing: nothing more to say
        except Exception as e:
            self._send_handler_error(call_id, context, e)
        finally:
            self.tasks.pop(call_id, None)
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
            self.tasks.pop(call_id, None)
            self._conn.forget_stream(stream)

    def _send_reply(self, call_id: int, method: str, result: Any) -> None:
        try:
            self._conn.send_frame({"k": Kind.REPLY, "i": call_id, "r": result})
        except MessageTooLarge as e:
            self._send_error(call_id, ErrorCode.TOO_LARGE, str(e))
        except (TypeError, ValueError, OverflowError) as e:  # not msgpack-able: our handler's bug
            logger.error("%s: reply of %s cannot be encoded: %s", self._conn.identity.peer_id, method, e)
            self._send_error(call_id, ErrorCode.INTERNAL, "the reply could not be encoded")

    def _send_handler_error(self, call_id: int, context: CallContext, error: Exception) -> None:
        our_id = self._conn.identity.peer_id
        if isinstance(error, RPCError):
            logger.info("%s: %s from %s refused: %s", our_id, context.method, context.peer_id, error)
            self._send_error(call_id, error.code, error.message)
        elif isinstance(error, ConnectionLost):
            pass
        else:
            logger.exception(
                "%s: handler %s failed on a call from %s",
                our_id,
                context.method,
                context.peer_id,
                exc_info=error,
            )
            self._send_error(call_id, ErrorCode.INTERNAL, f"{type(error).__name__} in the handler")

    def _send_error(self, call_id: int, code: str, message: str) -> None:
        conn = self._conn
        if not conn.protocol.closed:
            with contextlib.suppress(ConnectionLost):  # closing under us: nobody left to tell
                conn.send_frame({"k": Kind.ERROR, "i": call_id, "c": code, "e": message[:MAX_ERROR_MESSAGE_CHARS]})
