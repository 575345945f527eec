"""swarm.p2p: identities, multiaddrs, and authenticated, encrypted, multiplexed msgpack RPC over TCP."""

from swarm.p2p.config import P2PConfig
from swarm.p2p.dialer import PeerRef
from swarm.p2p.errors import (
    BadRequest,
    Busy,
    ConnectionLost,
    HandshakeError,
    IdentityError,
    MessageTooLarge,
    MultiaddrError,
    P2PError,
    PeerIDMismatch,
    ProtocolError,
    RemoteError,
    RPCError,
    RPCTimeout,
)
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import TcpAddress, parse_maddr, parse_maddrs
from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream
from swarm.p2p.wire import ErrorCode

__all__ = [
    "BadRequest",
    "Busy",
    "CallContext",
    "ConnectionLost",
    "ErrorCode",
    "HandshakeError",
    "Identity",
    "IdentityError",
    "MessageTooLarge",
    "MultiaddrError",
    "P2PConfig",
    "P2PError",
    "P2PHost",
    "PeerID",
    "PeerIDMismatch",
    "PeerRef",
    "ProtocolError",
    "RPCError",
    "RPCTimeout",
    "RemoteError",
    "Stream",
    "TcpAddress",
    "parse_maddr",
    "parse_maddrs",
]
