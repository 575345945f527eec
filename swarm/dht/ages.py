"""Asking a DHT node how long it has known some peers (`dht.ages`, served by DHTServing).

A newcomer has seen nothing of a run and cannot tell a long-standing peer from an identity made a
minute ago; the nodes it was told to join through (--initial-peers) can: their routing tables
note when each contact was first taken in. state/trust.py prefers states advertised by peers they
have known for a while ("seasoned"), so a fresh crowd of identities cannot outvote them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from swarm.dht import protocol as proto
from swarm.dht.node import DHTNode
from swarm.p2p.errors import BadRequest
from swarm.p2p.peer_id import PeerID


async def ages_known_by(dht: DHTNode, maddr: str, peers: Sequence[PeerID], timeout: float) -> dict[PeerID, float]:
    """Seconds `maddr`'s DHT node has known each of `peers` (those it knows), asked MAX_AGE_QUERY
    at a time: a flood of fresh holders listed first must not push the others out of the question.
    Raises P2PError when it cannot be asked or answers nonsense."""
    known: dict[PeerID, float] = {}
    asked = list(peers)
    for start in range(0, len(asked), proto.MAX_AGE_QUERY):
        batch = asked[start : start + proto.MAX_AGE_QUERY]
        _, reply = await dht.transport.call_maddr(maddr, proto.AGES, {"peers": [p.to_bytes() for p in batch]}, timeout)
        ages = reply.get("ages") if isinstance(reply, dict) else None
        if not isinstance(ages, list) or len(ages) != len(batch):
            raise BadRequest("ages: the reply must list one age per peer asked")
        for peer, age in zip(batch, ages, strict=True):
            if age is None:
                continue
            if isinstance(age, bool) or not isinstance(age, int | float) or not math.isfinite(age) or age < 0:
                raise BadRequest("ages: an age is a finite number of seconds >= 0, or None")
            known[peer] = float(age)
    return known
