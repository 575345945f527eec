"""What matchmaking keeps of one step while it runs (StepState), and what it found (Matchmade)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.p2p.peer_id import PeerID

__all__ = ["Matchmade", "StepState"]


@dataclass(frozen=True, slots=True)
class Matchmade:
    """What matchmaking found for one step. group None: no group (alone, late, of another
    state, or the leader gave up); swarm_state: the state the swarm starts this step from, when
    it differs from ours (we must fetch it before we can contribute)."""

    group: GroupInfo | None
    seconds: float
    late: bool = False  # a group of our state formed without us
    swarm_state: bytes | None = None
    late_by: frozenset[PeerID] = frozenset()  # late: the owners of the FORMED markers that said so
    outvoted: bool = False  # a larger group formed beside ours at an earlier step: we are a fork's smaller lineage
    # no group, but other nodes of our state were ready with us (we led or joined them): we are
    # not alone at this step, whatever their progress records say (plan_without_group)
    peers: int = 0

    @property
    def other_state(self) -> bool:
        """Our state is not the swarm's: fetch it before we can contribute."""
        return self.swarm_state is not None or self.outvoted


@dataclass
class StepState:
    me: MemberInfo
    leading: bool = False
    leader: MemberInfo | None = None  # whom we joined, when not leading
    joiners: dict[PeerID, MemberInfo] = field(default_factory=dict)
    expected: set[PeerID] = field(default_factory=set)
    late_by: frozenset[PeerID] = frozenset()  # the leader found itself late: whose FORMED markers said so
    result: asyncio.Future[GroupInfo | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    role_known: asyncio.Event = field(default_factory=asyncio.Event)  # leading, or joined a leader
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # a joiner arrived (the leader waits on it)
    voters: frozenset[PeerID] | None = None  # whose vote on the swarm's state counts (ready.decide)
    # the round that made our state (member -> weight; None: not known) and the peers live by their
    # progress records: whom a group we lead must not leave behind (ready.left_behind)
    parent_round: Mapping[PeerID, float] | None = None
    live: frozenset[PeerID] = frozenset()
