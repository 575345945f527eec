"""The circuit relay protocol: four methods on ordinary authenticated connections. This module is
the spec; relay.py (the relay's side) and relay_client.py (both ends' side) follow it.

It follows libp2p circuit relay v2's model (reservations with an expiry, a hop role asked by the
dialer and a stop role asked of the target, per-circuit byte and time limits), carried as our own
RPC methods rather than libp2p's protobufs: it is not wire-compatible with go-libp2p.

A NATed peer T keeps a connection to a reachable relay R and a reservation on it; a dialer D
reaches T as ``<R's multiaddr>/p2p/R/p2p-circuit/p2p/T``::

    T -> R  p2p.relay.ping     unary.  args {v}. reply {v}: what a peer times to choose the
                               relay nearest to it (the round trip of one call).
    T -> R  p2p.relay.reserve  unary.  args {v}. reply {v, ttl, limit_bytes, limit_s, observed}:
                               R keeps a reservation for T until ttl seconds from now, bound
                               to the connection the call came on; T renews it before then.
                               Refused with ERROR busy at R's caps (per source IP, in all).
    D -> R  p2p.relay.hop      stream. args {v, peer}: a circuit to `peer` (PeerID bytes). R
                               refuses with ERROR no_reservation if it holds none for the peer,
                               or busy at its circuit caps. Otherwise R asks T (stop, below)
                               and, once T accepted, sends one DATA chunk, msgpack {v,
                               limit_bytes, limit_s, observed, peer_observed}; every later chunk
                               in either direction is the circuit's bytes, passed on unchanged.
    R -> T  p2p.relay.stop     unary.  args {v, circuit, peer, limit_bytes, limit_s, observed}:
                               D (`peer`, as R claims) asks for a circuit. T answers {v} after
                               it opened:
    T -> R  p2p.relay.accept   stream. args {v, circuit}: T's end of the circuit `circuit` (16
                               random bytes R made for this circuit); its chunks are the
                               circuit's bytes.

`observed` is the caller's own address as R sees it (the multiaddr of its connection to R: its
NAT's public address and mapped port); in stop it is D's, and `peer_observed` in hop's first
chunk is T's (from its reservation). Hole punching (punch.py) dials these, and refuses addresses
outside them. Each may be absent (nil) where R does not know it.

R splices the hop stream and the accept stream. At either limit (bytes in both directions
together, or seconds since the circuit opened) R ends both calls with ERROR circuit_limit, so
both ends see why. A stream that ends (END) is ended on the other side too.

D and T then run the normal handshake (handshake.py) through the circuit, D as dialer checking
that the far end proves T's PeerID: R passes on sealed frames it can neither read nor change
unseen, and a relay that routes D elsewhere fails D's PeerID check. T checks the same of D
against what R claimed in stop.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from swarm.p2p.errors import BadRequest, IdentityError, MultiaddrError, ProtocolError
from swarm.p2p.maddr import TcpAddress, parse_maddr
from swarm.p2p.peer_id import PeerID

VERSION = 1
PING = "p2p.relay.ping"
RESERVE = "p2p.relay.reserve"
HOP = "p2p.relay.hop"
STOP = "p2p.relay.stop"
ACCEPT = "p2p.relay.accept"
CIRCUIT_ID_BYTES = 16
MAX_PEER_ID_BYTES = 128  # an Ed25519 PeerID is 38 bytes; anything far larger is garbage
MAX_LIMIT_BYTES = 1 << 50
MAX_LIMIT_S = 7 * 24 * 3600.0
MAX_TTL_S = 24 * 3600.0
MAX_OBSERVED_CHARS = 128  # /ip6/<39 characters>/tcp/65535 fits many times


@dataclass(frozen=True, slots=True)
class Limits:
    """What one circuit may carry before the relay closes it."""

    bytes: int  # both directions together
    seconds: float  # since the circuit opened

    def __post_init__(self) -> None:
        if not 0 < self.bytes <= MAX_LIMIT_BYTES or not 0 < self.seconds <= MAX_LIMIT_S:
            raise ValueError(f"circuit limits out of range: {self.bytes} bytes, {self.seconds} s")

    def fields(self) -> dict[str, Any]:
        return {"limit_bytes": self.bytes, "limit_s": self.seconds}


@dataclass(frozen=True, slots=True)
class Reservation:
    """The relay's answer to reserve: how long it holds the reservation, and each circuit's limits."""

    ttl: float
    limits: Limits
    observed: TcpAddress | None = None  # the reserving peer's address as the relay sees it

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, "ttl": self.ttl, **self.limits.fields(), "observed": _text(self.observed)}


@dataclass(frozen=True, slots=True)
class Opening:
    """The relay's first chunk on HOP: the circuit is open."""

    limits: Limits
    observed: TcpAddress | None = None  # the dialer's address as the relay sees it
    peer_observed: TcpAddress | None = None  # the target's, from its reservation

    def encode(self) -> dict[str, Any]:
        fields = {"observed": _text(self.observed), "peer_observed": _text(self.peer_observed)}
        return {"v": VERSION, **self.limits.fields(), **fields}


@dataclass(frozen=True, slots=True)
class StopRequest:
    circuit: bytes
    peer: PeerID  # the dialer, as the relay claims it
    limits: Limits
    observed: TcpAddress | None = None  # the dialer's address as the relay sees it

    def encode(self) -> dict[str, Any]:
        fields = {"circuit": self.circuit, "peer": self.peer.to_bytes(), "observed": _text(self.observed)}
        return {"v": VERSION, **fields, **self.limits.fields()}


def observed_address(remote_address: tuple[str, int]) -> TcpAddress | None:
    """The multiaddr of a connection's far end, from its (ip, port); None where it is no IP."""
    try:
        ip = ipaddress.ip_address(remote_address[0])
    except ValueError:
        return None
    return TcpAddress("ip4" if ip.version == 4 else "ip6", str(ip), int(remote_address[1]))


def _text(addr: TcpAddress | None) -> str | None:
    return None if addr is None else addr.to_maddr()


def _observed(args: dict[str, Any], key: str) -> TcpAddress | None:
    """An observed address field: nil, or an /ip4|/ip6 TCP multiaddr without /p2p/."""
    text = args.get(key)
    if text is None:
        return None
    if not isinstance(text, str) or len(text) > MAX_OBSERVED_CHARS:
        raise ProtocolError(f"relay message: {key!r} must be a short multiaddr")
    try:
        addr = parse_maddr(text)
    except MultiaddrError as e:
        raise ProtocolError(f"relay message: {key!r}: {e}") from None
    if addr.host_protocol not in ("ip4", "ip6") or addr.peer_id is not None:
        raise ProtocolError(f"relay message: {key!r} must be /ip4 or /ip6 HOST/tcp/PORT")
    return addr


def _number(args: dict[str, Any], key: str, kind: type) -> Any:
    value = args.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"relay message: {key!r} must be {kind.__name__}")
    return value


def _checked(args: Any) -> dict[str, Any]:
    if not isinstance(args, dict) or args.get("v") != VERSION:
        raise ProtocolError(f"relay message must be a map with v={VERSION}")
    return args


def peer_field(args: Any) -> PeerID:
    """The PeerID in a message's `peer` (BadRequest if it is not one)."""
    raw = args.get("peer") if isinstance(args, dict) else None
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_PEER_ID_BYTES:
        raise BadRequest("relay: 'peer' must be a PeerID's bytes")
    try:
        return PeerID(raw)
    except IdentityError as e:
        raise BadRequest(f"relay: 'peer' is no PeerID: {e}") from None


def circuit_field(args: Any) -> bytes:
    raw = args.get("circuit") if isinstance(args, dict) else None
    if not isinstance(raw, bytes) or len(raw) != CIRCUIT_ID_BYTES:
        raise BadRequest(f"relay: 'circuit' must be {CIRCUIT_ID_BYTES} bytes")
    return raw


def check_version(args: Any) -> None:
    if not isinstance(args, dict) or args.get("v") != VERSION:
        raise BadRequest(f"relay: arguments must be a map with v={VERSION}")


def decode_limits(args: Any) -> Limits:
    """The limits in a relay's message; ProtocolError if they are missing or out of range."""
    args = _checked(args)
    try:
        return Limits(_number(args, "limit_bytes", int), _number(args, "limit_s", float))
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def decode_reservation(reply: Any) -> Reservation:
    limits = decode_limits(reply)
    ttl = _number(reply, "ttl", float)
    if not 0 < ttl <= MAX_TTL_S:
        raise ProtocolError(f"relay reservation ttl {ttl} out of range")
    return Reservation(ttl, limits, _observed(reply, "observed"))


def decode_opening(fields: Any) -> Opening:
    limits = decode_limits(fields)
    return Opening(limits, _observed(fields, "observed"), _observed(fields, "peer_observed"))


def decode_stop(args: Any) -> StopRequest:
    """A stop request as the target reads it (BadRequest when malformed)."""
    check_version(args)
    try:
        limits, observed = decode_limits(args), _observed(args, "observed")
    except ProtocolError as e:
        raise BadRequest(str(e)) from None
    return StopRequest(circuit_field(args), peer_field(args), limits, observed)
