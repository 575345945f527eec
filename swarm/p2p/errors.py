"""Typed errors of the p2p layer.

Every failure a caller can meet is one of these, so code above (DHT, averaging, state) can tell a
slow peer from a dead one from a peer that refused the request, without parsing messages.
"""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error raised by swarm.p2p."""


class IdentityError(P2PError):
    """A key file is missing, unreadable or malformed, or a key has the wrong type."""


class IdentityInUse(IdentityError):
    """Another process holds the key file (Identity.claim): two processes would share one PeerID."""


class MultiaddrError(P2PError, ValueError):
    """A multiaddr is malformed or names something we cannot dial or listen on."""


class HandshakeError(P2PError):
    """The authentication handshake failed: bad signature, wrong peer, garbage, or timeout."""


class PeerIDMismatch(HandshakeError):
    """The peer at a multiaddr proved a different PeerID than the multiaddr's /p2p/ component."""


class ProtocolError(P2PError):
    """A peer sent bytes that break the wire protocol (malformed frame, unknown kind, ...)."""


class MessageTooLarge(P2PError):
    """A frame or message exceeds a size limit (ours, or the one the peer announced)."""


class ConnectionLost(P2PError, ConnectionError):
    """The connection closed before the call finished."""


class ConnectionClosed(ConnectionLost):
    """The connection was already closed when a message was to be sent: nothing went out, so
    the call may be retried on another connection."""


class CircuitClosed(ConnectionLost):
    """A relayed connection ended because its relay closed the circuit: the circuit reached the
    relay's byte or time limit, or the relay or the far end went away (the message says which)."""


class NoReservation(P2PError):
    """The relay holds no reservation for the peer asked for, so it cannot reach that peer."""


class RelayRefused(P2PError):
    """A relay refused a reservation or a circuit: it is at its caps, or it serves no relay."""


class RPCTimeout(P2PError, TimeoutError):
    """A call, a stream read or a stream write did not complete within its timeout."""


class RemoteError(P2PError):
    """The peer answered a call with a typed error (see wire.ErrorCode)."""

    def __init__(self, code: str, message: str, *, method: str = "", peer: str = "") -> None:
        self.code = code
        self.message = message
        self.method = method
        self.peer = peer
        where = f" from {peer}" if peer else ""
        call = f" in {method}" if method else ""
        super().__init__(f"[{code}]{call}{where}: {message}")


class RPCError(P2PError):
    """Raised by a handler to send a typed error reply; `code` is one of wire.ErrorCode."""

    code = "internal"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class BadRequest(RPCError):
    """The request's arguments have the wrong types, sizes or values."""

    code = "bad_request"


class Busy(RPCError):
    """The peer is at a concurrency limit; retry later or elsewhere."""

    code = "busy"


class NotFound(RPCError):
    """The peer does not hold what was asked for (any more); ask another."""

    code = "not_found"
