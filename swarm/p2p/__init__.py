"""swarm.p2p: identities, multiaddrs, and authenticated, encrypted, multiplexed msgpack RPC over TCP,
direct or through circuit relays, with hole punching between NATed peers."""

from swarm.p2p.config import P2PConfig
from swarm.p2p.dialer import PeerRef
from swarm.p2p.errors import (
    BadRequest,
    Busy,
    CircuitClosed,
    ConnectionLost,
    HandshakeError,
    IdentityError,
    MessageTooLarge,
    MultiaddrError,
    NoReservation,
    P2PError,
    PeerIDMismatch,
    ProtocolError,
    RelayRefused,
    RemoteError,
    RPCError,
    RPCTimeout,
)
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import CircuitAddress, TcpAddress, parse_address, parse_maddr, parse_maddrs
from swarm.p2p.peer_id import PeerID
from swarm.p2p.punch import PunchConfig, Puncher
from swarm.p2p.relay import RelayConfig, RelayService
from swarm.p2p.relay_client import RelayKeeper
from swarm.p2p.stream import Stream
from swarm.p2p.wire import ErrorCode

__all__ = [
    "BadRequest",
    "Busy",
    "CallContext",
    "CircuitAddress",
    "CircuitClosed",
    "ConnectionLost",
    "ErrorCode",
    "HandshakeError",
    "Identity",
    "IdentityError",
    "MessageTooLarge",
    "MultiaddrError",
    "NoReservation",
    "P2PConfig",
    "P2PError",
    "P2PHost",
    "PeerID",
    "PeerIDMismatch",
    "PeerRef",
    "ProtocolError",
    "PunchConfig",
    "Puncher",
    "RPCError",
    "RPCTimeout",
    "RelayConfig",
    "RelayKeeper",
    "RelayRefused",
    "RelayService",
    "RemoteError",
    "Stream",
    "TcpAddress",
    "parse_address",
    "parse_maddr",
    "parse_maddrs",
]
