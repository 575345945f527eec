"""Averager: what the training code calls once per outer step.

    averager = Averager(dht_node, host, run_id="run1", config=AveragingConfig())
    averaged, report = await averager.step(pseudo_gradients, weight=tokens, step=outer_step)

`step` forms the group of this outer step through the DHT (matchmaking/matchmaker.py: every ready node of
the same state), runs the butterfly all-reduce of the flattened tensors with it (rounds/flat.py;
rounds/grid.py beyond max_group_size), and returns new tensors shaped and typed like the
inputs, plus a GroupReport. With no group (alone, late, of another state) it returns copies of
the inputs and `report.group_id is None`. It raises AllReduceError when a group was formed but
the round could not complete; the inputs are never modified.

Owner audit (audit/flat.py): a part owner the audit catches lying is excluded for the
Averager's lifetime (`excluded`): matchmaking ignores its announcements and refuses a group that
holds it. A lie every member sees fails the round (AuditError, an AllReduceError: the caller
matchmakes the step again); one that only this member sees (its own contribution misstated)
excludes the owner without failing the round.

`step` is `form_group` then `run_round`; a trainer calls them apart to form the group while it
finishes its last inner steps, so matchmaking costs no compute time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError, AuditError
from swarm.averaging.matchmaking.matchmaker import Matchmade, Matchmaker
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.rounds.bandwidth import LinkEstimate
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.grid import GridRound
from swarm.averaging.rounds.overdue import probe_margin
from swarm.averaging.rounds.registry import RoundRegistry
from swarm.averaging.rounds.timeouts import RoundClock, group_part_timeout, measures_busy, measures_round
from swarm.dht.node import DHTNode
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.p2p.reach import DIRECT, RELAYED
from swarm.utils.tensor_layout import flatten, restore

logger = logging.getLogger(__name__)

MAX_FORMED = 8  # formation times kept for groups not averaged yet


@dataclass
class GroupReport:
    group_id: str | None  # hex; None when this step ran alone
    members: list[str] = field(default_factory=list)  # PeerIDs in the group's order
    contributions: dict[int, list[int]] = field(default_factory=dict)  # part -> member indices included
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float = 0.0
    reduce_s: float = 0.0  # round start until our own part was averaged
    gather_s: float = 0.0  # the rest of the round: receiving the other parts' averages
    clipped: dict[int, list[int]] = field(default_factory=dict)  # our parts -> members dropped/clipped
    group: GroupInfo | None = None  # the group of the round (its members' announced weights: the round's receipt)
    part_timeout: float = 0.0  # seconds: the round's bound on each wait (rounds/timeouts.py); 0 when alone


class Averager:
    """One node's averaging for a run: owns its Matchmaker, its round registry (the all-reduce
    handlers on the shared host) and the set of owners its audits caught. Call `step` once per
    outer step, or `form_group` then `run_round` (module docstring); `close` when done."""

    def __init__(self, dht: DHTNode, host: P2PHost, run_id: str, config: AveragingConfig | None = None, *,
                 reach: Callable[[], str] = lambda: DIRECT,
                 relayed_may_own: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.dht, self.host, self.run_id = dht, host, run_id
        # how peers reach us now (p2p/reach.py): asked at every matchmaking, as punches settle
        self.reach = reach
        self.relayed_may_own = relayed_may_own  # relayed, and no live peer could own the parts
        self.config = config or AveragingConfig()
        self.excluded: set[PeerID] = set()  # owners our audits caught lying: never grouped with again
        self.matchmaker = Matchmaker(dht, host, run_id, self.config, excluded=self.excluded)
        self.registry = RoundRegistry(host, self.config)
        self.link = LinkEstimate()  # what our rounds measured of our link (rounds/bandwidth.py)
        self.clock = RoundClock()  # how long our rounds took: the next round's part timeout (rounds/timeouts.py)
        self._formed: dict[bytes, float] = {}  # group id -> when form_group returned it (time.monotonic)

    def close(self) -> None:
        self.matchmaker.close()
        self.registry.close()

    async def drain(self, timeout: float) -> int:
        """Wait until the rounds' streams being served now are done (at most `timeout`): what
        this member still owes its group (a result it reduced, a copy asked for). Returns how
        many were still being served."""
        return await self.registry.drain(timeout)

    def member_info(self, weight: float, state: bytes = b"", *, as_client: bool = False) -> MemberInfo:
        reach = self.reach()
        # a member the others reach only through a relay owns no part (every member would send its
        # slice of that part over the relay), unless nobody else could
        client = self.config.client_mode or as_client or (reach == RELAYED and not self.relayed_may_own())
        maddrs = () if client else tuple(self.host.visible_maddrs)
        bandwidth = 0.0 if client else self.bandwidth()
        weight = min(float(weight), self.config.max_weight)  # above it, peers would ignore us
        timeout = self.clock.announced(self.config.part_timeout)
        return MemberInfo(self.host.peer_id, maddrs, weight, bandwidth, client, state, reach, timeout)

    def bandwidth(self) -> float:
        """MB/s we announce: measured (config.measure_bandwidth) once a round has, else configured."""
        if self.config.measure_bandwidth:
            return self.link.announced_mb_s(self.config.bandwidth)
        return self.config.bandwidth

    async def step(
        self, tensors: Sequence[torch.Tensor], weight: float, step: int, state: bytes = b""
    ) -> tuple[list[torch.Tensor], GroupReport]:
        vector = await asyncio.to_thread(_flatten, tensors)  # refuses bad input before matchmaking
        found = await self.form_group(weight, step, state)
        return await self._run(found.group, vector, tensors, found.seconds)

    async def form_group(
        self,
        weight: float,
        step: int,
        state: bytes = b"",
        *,
        gather: float | None = None,
        expected: frozenset[PeerID] | None = None,
        as_client: bool = False,
        voters: frozenset[PeerID] | None = None,
        parent_round: Mapping[PeerID, float] | None = None,
        live: frozenset[PeerID] = frozenset(),
    ) -> Matchmade:
        """Matchmaking alone: the group for this step, or why there is none. A trainer may start
        it before its tensors are ready (hivemind's pre-scheduled step) and hand the group to
        run_round later; `weight` is what it will contribute (0: it only takes the average),
        `state` the sha256 of the state it starts from. `gather`: the longest wait for the
        `expected` peers (default matchmaking_time). `as_client`: take part as a client-mode
        member (never leads, owns no part), so that a node joining a group already gathering
        cannot change who leads it. `voters`: whose vote on the swarm's state counts (the members
        of our last round: ready.decide; None: everyone's). `parent_round`: the round that made
        `state` (member -> weight), whose `live` members a group we lead must not leave behind
        (ready.left_behind)."""
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        if gather is not None and not (math.isfinite(gather) and gather >= 0):
            raise ValueError(f"gather must be a finite number of seconds >= 0, got {gather}")
        me = self.member_info(weight, state, as_client=as_client)
        found = await self.matchmaker.form_group(step, me, gather, expected, voters, parent_round, live)
        if found.group is not None and len(found.group.members) < 2:
            return Matchmade(None, found.seconds, peers=found.peers)
        if found.group is not None:  # its round tells from this whether it began late (rounds/confirm.py)
            group = found.group
            self._formed[group.group_id] = time.monotonic()
            while len(self._formed) > MAX_FORMED:  # groups formed and never averaged: the oldest go
                del self._formed[next(iter(self._formed))]
            # members already done with their inner steps send to us before our round begins
            self.registry.expect(group.group_id, group_part_timeout([m.timeout for m in group.members],
                                                                    self.config.part_timeout))  # fmt: skip
        return found

    def abandon(self, group: GroupInfo) -> None:
        """We will not run the round of `group` (from form_group): its members' streams to us are
        refused from now on, and they take our parts to backups."""
        self._formed.pop(group.group_id, None)
        self.registry.abandon(group.group_id)

    def exclude(self, peers: Sequence[PeerID], why: str) -> None:
        """Never group with these peers again (logged once per peer)."""
        for peer in peers:
            if peer not in self.excluded and peer != self.host.peer_id:
                self.excluded.add(peer)
                logger.warning("excluding peer %s from averaging for the rest of the run: %s", peer, why)

    async def announced(self, step: int) -> dict[PeerID, bytes]:
        """One read of who matchmakes `step` now: the peers ready for it and those in a group of
        it already, each with the state it named."""
        view = await self.matchmaker.board.read(step)
        return {**{p: m.state for p, m in view.ready.items()}, **view.formed}

    async def formed(self, step: int) -> frozenset[PeerID]:
        """One read of who holds a FORMED marker of `step` now (in a group of it, its round not
        failed); markers we distrust are left out."""
        return frozenset((await self.matchmaker.board.read(step)).formed)

    def distrust_formed(self, peers: Set[PeerID]) -> None:
        """Their FORMED markers made us wait max_wait for a result that never came: ignore them."""
        self.matchmaker.board.distrust_formed(peers)

    async def outvoted(self, step: int, group_id: bytes, state: bytes, voters: frozenset[PeerID] | None = None) -> bool:
        """Did a larger group than ours (`group_id`, from `state`) form at `step`, weighed by
        `voters`? Then our lineage is a fork's smaller one (matchmaking/matchmaker.py,
        ready.outvoted)."""
        return await self.matchmaker.outvoted(step, group_id, state, voters)

    def round_failed(self, step: int) -> None:
        """The round of `step` failed: the step may be matchmade again (see matchmaking/matchmaker.py)."""
        self.matchmaker.round_failed(step)

    async def run_round(
        self, group: GroupInfo | None, tensors: Sequence[torch.Tensor], matchmaking_s: float = 0.0
    ) -> tuple[list[torch.Tensor], GroupReport]:
        """The all-reduce of `tensors` with `group` (from form_group); copies when alone."""
        vector = await asyncio.to_thread(_flatten, tensors)  # also refuses non-finite values
        return await self._run(group, vector, tensors, matchmaking_s)

    async def _run(
        self, group: GroupInfo | None, vector: torch.Tensor, tensors: Sequence[torch.Tensor], matchmaking_s: float
    ) -> tuple[list[torch.Tensor], GroupReport]:
        if group is None:
            return [t.detach().clone() for t in tensors], GroupReport(None, matchmaking_s=matchmaking_s)
        # Beyond max_group_size the hierarchical butterfly: the same average, about 2*sqrt(n) peers each.
        flat = len(group.members) <= self.config.max_group_size
        pace = self.link.pace() if self.config.measure_bandwidth and flat else None
        # every wait of this round is bounded by what the members' recent rounds took (the same
        # value on every member: timeouts.group_part_timeout), the flag at most
        timeout = group_part_timeout([m.timeout for m in group.members], self.config.part_timeout)
        config = dataclasses.replace(self.config, part_timeout=timeout)
        formed_at = self._formed.pop(group.group_id, None)
        # a sender this much later than our fast rounds took is probed: gone, it is left out at
        # once instead of after the part timeout (rounds/overdue.py)
        probe_after = probe_margin(self.clock.recent())
        try:
            if flat:
                round_ = AllReduceRound(self.host, self.registry, group, vector, config, upload=pace,
                                        formed_at=formed_at, probe_after=probe_after)  # fmt: skip
            else:
                round_ = GridRound(self.host, self.registry, group, vector, config, formed_at=formed_at,
                                   probe_after=probe_after)  # fmt: skip
            averaged, rr = await round_.run()
        except AuditError as e:
            self.clock.failed()
            self.exclude(e.owners, str(e))
            raise
        except AllReduceError:
            self.clock.failed()
            raise
        self.exclude(rr.audit_excluded, "it misstated our contribution to its part")
        # lasted: since the group formed, when the other members' waits began too (timeouts.measures_round)
        lasted = rr.total_s if formed_at is None else max(rr.total_s, time.monotonic() - formed_at)
        # a round that waited measured the traffic beside it, not how fast our link is busy (timeouts.measures_busy)
        busy = rr.busy if measures_busy(lasted, self.clock.recent()) else None
        waited = not measures_round(lasted, timeout)  # it measures its timeout, not our link nor the pace
        self.link.observe(rr.up, rr.down, busy, paced=pace is not None, timed_out=waited)
        if not waited:
            self.clock.observe(rr.total_s)
        report = GroupReport(
            group.group_id.hex(),
            rr.members,
            rr.contributions,
            rr.bytes_sent,
            rr.bytes_received,
            matchmaking_s,
            rr.reduce_s,
            max(0.0, rr.total_s - rr.reduce_s),
            rr.clipped,
            group,
            timeout,
        )
        return restore(averaged, tensors), report


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The round's one vector; the values of every pseudo-gradient are checked here, once."""
    if not tensors:
        raise ValueError("nothing to average")
    vector = flatten(tensors)
    if not torch.isfinite(vector).all():
        raise ValueError("refusing to average non-finite values (NaN or inf)")
    return vector
