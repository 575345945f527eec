"""How peers reach a host: directly, by a punched connection, or only through a relay.

    reach = own_reach(reachable=False, listen_port=31337, observed_port=31337, outcomes=["relayed", "punched"])
    # "punched"

A host says this about itself (averaging/messages.py's MemberInfo carries it), from what it can
know alone: the dial-back check (autonat.py), the port its relay observed for its listening
port (relay_wire.py: `observed`, with P2PConfig.reuse_port), and the outcomes of its hole punches
(punch.py). A relayed member owns no part, unless no live peer could (relayed_may_own). A
member that lies hurts only itself: one that says "punched" from behind a
symmetric NAT owns a part that everyone reaches through the relay (a slow owner), and one that
says "relayed" owns none (a client).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

DIRECT, PUNCHED, RELAYED = "direct", "punched", "relayed"
REACHES = (DIRECT, PUNCHED, RELAYED)


def relayed_may_own(peers: Iterable[tuple[bool, str | None]]) -> bool:
    """May a relayed node own parts of the average? Only when none of the live `peers` (client
    flag, reach; None: not said, as direct) could own them: a swarm whose members are all
    reached through relays averages through them or not at all."""
    return not any(not client and reach != RELAYED for client, reach in peers)


def reach_of(value: Any) -> str | None:
    """A peer's record's reach, when it is one of REACHES (None otherwise: not said, or not one)."""
    return value if isinstance(value, str) and value in REACHES else None


def own_reach(*, reachable: bool, listen_port: int | None, observed_port: int | None,
              outcomes: Iterable[str]) -> str:  # fmt: skip
    """DIRECT when peers can dial us (or nobody could tell us otherwise); behind NAT, PUNCHED when
    a punch of ours worked, or when the relay saw our listening port unchanged (a NAT that keeps
    the port maps it the same way for every peer, so punches will work); RELAYED otherwise (a
    symmetric NAT picks a new port per destination: the one the relay saw is of no use to
    anyone else)."""
    if reachable:
        return DIRECT
    if PUNCHED in set(outcomes):
        return PUNCHED
    if listen_port is not None and observed_port == listen_port:
        return PUNCHED
    return RELAYED
