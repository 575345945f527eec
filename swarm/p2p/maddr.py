"""Multiaddrs we dial and listen on: ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT[/p2p/PEERID]``.

Parsing is done by the maintained py-multiaddr package; this module only narrows it to what a
TCP transport can use and turns every failure into one MultiaddrError line naming the problem.
"""

from __future__ import annotations

import functools
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
