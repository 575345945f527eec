"""Multiaddrs we dial and listen on: ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT[/p2p/PEERID]``, and
the relayed form of libp2p's circuit relay, ``<relay's TCP multiaddr>/p2p/RELAY/p2p-circuit/p2p/PEER``
(parse_address; the relay must be named by its PeerID, so that whoever answers there is checked).

Parsing is done by the maintained py-multiaddr package; this module only narrows it to what a
TCP transport can use and turns every failure into one MultiaddrError line naming the problem.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

import multiaddr
from multiaddr.exceptions import Error as _MultiaddrLibError

from swarm.p2p.errors import IdentityError, MultiaddrError
from swarm.p2p.peer_id import PeerID

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
_MAX_MADDR_TEXT = 512


@dataclass(frozen=True, slots=True)
class TcpAddress:
    """A parsed TCP multiaddr: where to connect, and optionally who must answer."""

    host_protocol: str  # one of ip4, ip6, dns, dns4, dns6
    host: str
    port: int
    peer_id: PeerID | None = None

    def to_maddr(self, *, with_peer_id: bool = True) -> str:
        text = f"/{self.host_protocol}/{self.host}/tcp/{self.port}"
        if with_peer_id and self.peer_id is not None:
            text += f"/p2p/{self.peer_id}"
        return text

    def with_peer_id(self, peer_id: PeerID) -> TcpAddress:
        return TcpAddress(self.host_protocol, self.host, self.port, peer_id)

    def __str__(self) -> str:
        return self.to_maddr()


def parse_maddr(text: str) -> TcpAddress:
    """Parse a user- or peer-given multiaddr; MultiaddrError with a precise reason otherwise."""
    if not isinstance(text, str):
        raise MultiaddrError(f"a multiaddr is a string, got {type(text).__name__}")
    return _parse_cached(text)


@functools.lru_cache(maxsize=4096)  # py-multiaddr takes ~100 µs a parse; peers reuse addresses
def _parse_cached(text: str) -> TcpAddress:
    text = text.strip()
    if not text:
        raise MultiaddrError("empty multiaddr")
    if len(text) > _MAX_MADDR_TEXT:
        raise MultiaddrError(f"multiaddr longer than {_MAX_MADDR_TEXT} characters")
    if not text.startswith("/"):
        raise MultiaddrError(f"multiaddr {text!r} must start with '/', e.g. /ip4/1.2.3.4/tcp/31337")
    try:
        parsed = multiaddr.Multiaddr(text)
    except (_MultiaddrLibError, ValueError, TypeError) as e:
        raise MultiaddrError(f"malformed multiaddr {text!r}: {_reason(e)}") from None
    names = [p.name for p in parsed.protocols()]
    if not names or names[0] not in _HOST_PROTOCOLS:
        raise MultiaddrError(f"multiaddr {text!r} must begin with one of /{', /'.join(_HOST_PROTOCOLS)}")
    if len(names) < 2 or names[1] != "tcp":
        raise MultiaddrError(f"multiaddr {text!r} has no /tcp/PORT after the host")
    if "p2p-circuit" in names:
        raise MultiaddrError(f"multiaddr {text!r} is a relayed address: it names a peer to reach through a relay, "
                             "not a TCP address to dial or listen on")  # fmt: skip
    if names[2:] not in ([], ["p2p"]):
        extra = "/".join(names[2:])
        raise MultiaddrError(f"multiaddr {text!r}: unsupported part /{extra} (only /p2p/PEERID may follow /tcp)")
    host = parsed.value_for_protocol(names[0])
    port = int(parsed.value_for_protocol("tcp"))
    peer_id = None
    if "p2p" in names:
        try:
            peer_id = PeerID.from_base58(parsed.value_for_protocol("p2p"))
        except IdentityError as e:
            raise MultiaddrError(f"multiaddr {text!r}: bad /p2p/ peer id: {e}") from None
    return TcpAddress(names[0], host, port, peer_id)


def parse_maddrs(texts: str | list[str] | tuple[str, ...]) -> list[TcpAddress]:
    """Parse several multiaddrs, given as a list or one string separated by spaces or commas."""
    if isinstance(texts, str):
        texts = texts.replace(",", " ").split()
    return [parse_maddr(t) for item in texts for t in item.replace(",", " ").split()]


def _reason(error: Exception) -> str:
    message = str(error)
    # py-multiaddr repeats the whole input after the reason: keep only the reason.
    message = message.split(" (string: ")[0]
    if message.startswith("Invalid MultiAddr"):
        message = message.split(": ", 1)[-1]
    return message


CIRCUIT = "/p2p-circuit"


@dataclass(frozen=True, slots=True)
class CircuitAddress:
    """A peer reached through a relay: dial `relay` (whose PeerID is checked), ask it for a circuit
    to `peer_id`, and authenticate `peer_id` end to end through that circuit."""

    relay: TcpAddress  # always with the relay's peer_id
    peer_id: PeerID  # the peer at the far end of the circuit

    def __post_init__(self) -> None:
        if self.relay.peer_id is None:
            raise MultiaddrError(f"relay address {self.relay} must end in /p2p/<relay's PeerID>")
        if self.relay.peer_id == self.peer_id:
            raise MultiaddrError(f"a circuit through {self.relay.peer_id} to itself is no circuit")

    def to_maddr(self, *, with_peer_id: bool = True) -> str:
        # the target's /p2p/ is what makes it a circuit: always written
        return f"{self.relay.to_maddr()}{CIRCUIT}/p2p/{self.peer_id}"

    def with_peer_id(self, peer_id: PeerID) -> CircuitAddress:
        return CircuitAddress(self.relay, peer_id)

    def __str__(self) -> str:
        return self.to_maddr()


PeerAddress = TcpAddress | CircuitAddress


def parse_address(text: str) -> PeerAddress:
    """A TCP multiaddr (as parse_maddr) or a relayed one, ``.../p2p/RELAY/p2p-circuit/p2p/PEER``."""
    if not isinstance(text, str):
        raise MultiaddrError(f"a multiaddr is a string, got {type(text).__name__}")
    if CIRCUIT not in text:
        return parse_maddr(text)
    return _parse_circuit(text)


@functools.lru_cache(maxsize=1024)
def _parse_circuit(text: str) -> CircuitAddress:
    text = text.strip()
    if len(text) > _MAX_MADDR_TEXT:
        raise MultiaddrError(f"multiaddr longer than {_MAX_MADDR_TEXT} characters")
    relay_text, _, rest = text.partition(CIRCUIT)
    if CIRCUIT in rest:
        raise MultiaddrError(f"multiaddr {text!r}: one /p2p-circuit at most (a circuit of circuits is not dialed)")
    relay = parse_maddr(relay_text) if relay_text else None
    if relay is None or relay.peer_id is None:
        raise MultiaddrError(f"multiaddr {text!r}: before /p2p-circuit comes the relay, /ip4/HOST/tcp/PORT/p2p/ID")
    parts = rest.split("/")
    if len(parts) != 3 or parts[0] != "" or parts[1] != "p2p" or not parts[2]:
        raise MultiaddrError(f"multiaddr {text!r}: /p2p-circuit must be followed by /p2p/<PeerID> and nothing else")
    try:
        peer_id = PeerID.from_base58(parts[2])
    except IdentityError as e:
        raise MultiaddrError(f"multiaddr {text!r}: bad /p2p/ peer id after /p2p-circuit: {e}") from None
    return CircuitAddress(relay, peer_id)


def local_addresses(*, ipv6: bool) -> list[str]:
    """Addresses of this machine for a wildcard listener: loopback first, then the host's own."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    found = ["::1" if ipv6 else "127.0.0.1"]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        host = str(info[4][0])
        if host not in found and not host.startswith("127."):
            found.append(host)
    return found
