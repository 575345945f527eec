"""Who gets a connection slot: pure decisions over a snapshot of the facts, no I/O.

An attacker with a few addresses must not be able to fill every slot the host has, so the
limits are per *source* (one IPv4 address, or one IPv6 /64: what one machine controls) and,
when a global limit is reached, the host takes a slot back from whoever holds the most rather
than turning the newcomer away:

- admit_handshake(): inbound connections still handshaking. A source may hold at most
  max_pending_handshakes_per_ip; at the global cap the oldest pending handshake of the source
  holding the most is dropped to make room, unless the newcomer's source holds as many.
- plan_admission(): authenticated inbound connections. A source may hold at most
  max_connections_per_ip; at either cap choose_victim() names a connection to close, or none,
  and then the newcomer is refused.
- choose_victim(): never a peer we called (now or earlier: "useful") or dialed, never one with
  our calls in flight; first the idle unknown peers, from the source holding the most, the
  idlest first. Unknown peers whose own calls are in flight only make room for a useful peer.

For config.exempt_ips (this machine, by default) the host passes the global cap as the
per-source one: local swarms and tests run many nodes on 127.0.0.1.

Failure modes, admitted: an attacker with as many addresses as the host has slots still churns
idle unknown peers (each honest call gets through, its connection may not stay); and a flood of
handshakes from many single-connection sources can drop an honest handshake that is slower
than the flood (on loopback a handshake takes a millisecond).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def source_of(ip: str) -> str:
    """The source an address counts against: the IPv4 address, or the IPv6 /64 (IPv4-mapped
    IPv6 addresses count as their IPv4 address)."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip  # not an IP (a Unix socket, say): counted as it is
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


# --- pending handshakes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandshakeVerdict:
    admit: bool
    drop_oldest_of: str | None = None  # a source whose oldest pending handshake to drop first


def admit_handshake(
    pending: Sequence[tuple[str, float]], source: str, *, per_source: int, total: int
) -> HandshakeVerdict:
    """Whether a new inbound connection from `source` may start its handshake, given the
    pending ones as (source, started_at)."""
    counts = Counter(s for s, _ in pending)
    mine = counts[source]
    if mine >= per_source:
        return HandshakeVerdict(admit=False)
    if len(pending) < total:
        return HandshakeVerdict(admit=True)
    oldest: dict[str, float] = {}
    for s, started in pending:
        oldest[s] = min(started, oldest.get(s, started))
    # the source holding the most; among equals, the one whose oldest handshake is oldest
    top = min(counts, key=lambda s: (-counts[s], oldest[s], s))
    if counts[top] <= mine:
        return HandshakeVerdict(admit=False)
    return HandshakeVerdict(admit=True, drop_oldest_of=top)


# --- established connections ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerFacts:
    """What the host knows of one authenticated connection when it must choose."""

    key: int  # the caller's handle for the connection (e.g. its index in a list)
    source: str  # source_of(the remote IP)
    inbound: bool  # the peer dialed us
    useful: bool  # we called this peer (on this connection or an earlier one)
    ours_in_flight: bool  # our calls or streams on it are not finished
    theirs_in_flight: bool  # the peer's calls on it are being served
    idle_s: float  # seconds since the last call either way


@dataclass(frozen=True, slots=True)
class Admission:
    admit: bool
    evict: PeerFacts | None = None  # close this one first (None: nothing to close)
    reason: str = ""


def choose_victim(candidates: Sequence[PeerFacts], *, for_useful: bool = False) -> PeerFacts | None:
    """The connection to close to make room, or None if none may go (see the module docstring).
    for_useful: the newcomer is a peer we called before, which may also displace unknown peers
    that are only using us right now."""
    evictable = [
        c
        for c in candidates
        if c.inbound and not c.useful and not c.ours_in_flight and (for_useful or not c.theirs_in_flight)
    ]
    if not evictable:
        return None
    per_source = Counter(c.source for c in candidates)
    return max(evictable, key=lambda c: (not c.theirs_in_flight, per_source[c.source], c.idle_s, -c.key))


def plan_admission(connections: Sequence[PeerFacts], newcomer: PeerFacts, *, per_source: int, total: int) -> Admission:
    """Whether an authenticated inbound connection is kept, and what it displaces."""
    same_source = [c for c in connections if c.inbound and c.source == newcomer.source]
    if len(same_source) >= per_source:
        victim = choose_victim(same_source, for_useful=newcomer.useful)
        if victim is None:
            return Admission(admit=False, reason=f"{len(same_source)} connections from {newcomer.source}, all in use")
        return Admission(admit=True, evict=victim, reason=f"at the limit of {per_source} from {newcomer.source}")
    if len(connections) >= total:
        victim = choose_victim(connections, for_useful=newcomer.useful)
        if victim is None:
            return Admission(admit=False, reason=f"{len(connections)} connections open, all in use")
        return Admission(admit=True, evict=victim, reason=f"at the limit of {total} connections")
    return Admission(admit=True)
