"""Grouping: how a node's step finds its group (the matchmaking itself is the averager's,
swarm/averaging/matchmaking/matchmaker.py): whom to expect, how long to wait for slower peers,
and, before it announces, whether its state is a fork's smaller lineage (ForkWatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import NamedTuple

from swarm.averaging.averager import Averager
from swarm.averaging.matchmaking.matchmaker import Matchmade
from swarm.dht.errors import DHTError
from swarm.node.context import RunContext, StepFacts
from swarm.node.plan import expected_peers, matchmaking_start, peers_matchmaking
from swarm.node.view import SwarmView
from swarm.p2p.errors import P2PError
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

WAIT_RECHECK_S = 1.0  # seconds between readings of the peers' records while waiting for slower ones
# our last rounds whose steps' ready sets we check for a larger group beside ours (a fork) before
# each matchmaking: a faster smaller lineage is a step or two ahead of the larger one's markers
LINEAGE_STEPS = 3


class Round(NamedTuple):
    """One of our rounds, as ForkWatch weighs a group formed beside it (ready.outvoted)."""

    step: int
    group_id: bytes
    parent: bytes  # the state it started from
    voters: frozenset[PeerID] | None  # the members of the round that made `parent`


class ForkWatch:
    """Our last rounds since our state's lineage began, and whether a larger group formed beside
    one of them: then our state is a fork's smaller lineage, and we fetch the larger one's."""

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait
        self.rounds: deque[Round] = deque(maxlen=LINEAGE_STEPS)
        # the event loop's time our lineage was first found outvoted (no fetch since); None: it is not
        self.outvoted_since: float | None = None

    def stepped(self, step: int, group_id: bytes, parent: bytes, voters: frozenset[PeerID] | None) -> None:
        """A round of ours made the state we hold, from `parent`; `voters`: the members of the
        round that made `parent` (None: no round of two before it)."""
        self.rounds.append(Round(step, group_id, parent, voters))

    def forget(self) -> None:
        """We fetched another lineage's state: our rounds no longer say where it comes from."""
        self.rounds.clear()
        self.outvoted_since = None

    async def outvoted(self, averager: Averager, step: int) -> bool:
        """Is our state a fork's smaller lineage? A larger group formed beside one of our last
        rounds (ready.outvoted): then we fetch the swarm's state instead of matchmaking with ours,
        waiting for the larger lineage to reach our step when it is behind. Not for longer than
        max_wait: live identities that renew FORMED markers of a fake larger group, and serve no
        state, must not stop us for good (as distrust_formed bounds a fake marker of our state)."""
        for earlier in reversed(self.rounds):
            if earlier.step < step and await averager.outvoted(
                earlier.step, earlier.group_id, earlier.parent, earlier.voters
            ):
                now = asyncio.get_running_loop().time()
                if self.outvoted_since is None:
                    self.outvoted_since = now
                if now - self.outvoted_since < self.max_wait:
                    return True
                logger.warning("step %d: the larger lineage's state did not come in %.0fs: going on with ours",
                               step, self.max_wait)  # fmt: skip
                self.rounds.clear()
                break
        self.outvoted_since = None
        return False


class Grouping:
    """Matchmaking for the node's steps, with the state it holds (StepFacts.state_sha)."""

    def __init__(self, ctx: RunContext, facts: StepFacts, view: SwarmView) -> None:
        self.ctx, self.facts, self.view = ctx, facts, view
        self.forks = ForkWatch(ctx.config.max_wait)

    async def matchmake(self, step: int, weight: float, *, gather: float | None = None,
                        joining: bool = False) -> Matchmade:  # fmt: skip
        """One matchmaking of `step` with our state and `weight` (tokens); no group when it
        failed or our lineage is outvoted. `joining`: a late joiner's, with no inner steps."""
        ctx = self.ctx
        facts = self.view.read()
        expected = frozenset() if joining else expected_peers(facts, ctx.clock(), ctx.config.max_wait)
        try:
            if not joining and await self.forks.outvoted(ctx.averager, step):
                return Matchmade(None, 0.0, outvoted=True)
            lineage = ctx.lineage.lineage
            made_by = lineage.link_into(step)  # the round that made our state
            parent_round = made_by.members if made_by is not None and made_by.result == self.facts.state_sha else None
            return await ctx.averager.form_group(weight, step, self.facts.state_sha, gather=gather, expected=expected,
                                                 as_client=joining, voters=lineage.voters(), parent_round=parent_round,
                                                 live=frozenset(p.peer_id for p in facts.live()))  # fmt: skip
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("matchmaking for step %d failed: %s", step, e)
            return Matchmade(None, 0.0)

    async def wait_for_peers(self) -> None:
        """Until the slowest live peer of our step should be done (bounded by max_wait from when
        we started waiting), or a peer of our step is matchmaking it already (plan.peers_matchmaking),
        or stop. The peers' records and the step's ready set are read again every WAIT_RECHECK_S:
        a pace first measured slow (a caller's loop that started late) predicts a finish that its
        next record moves earlier, and peers that finished early must not form their group
        while we sleep out the first prediction."""
        ctx, config = self.ctx, self.ctx.config
        started, logged = ctx.clock(), False
        while not ctx.stop.is_set():
            await ctx.book.refresh()
            now = ctx.clock()
            start = matchmaking_start(self.view.read(), now, config.matchmaking_time, config.max_wait)
            delay = min(start, started + config.max_wait) - now
            if delay <= 0:
                return
            # are peers forming a group already? Read at every recheck, however short the rest of
            # our wait: peers that announced before us close their window before ours would end
            # (a soak node, matchmaking again after a failed one, slept 4.9 s through such a
            # group, formed 0.5 s before its wait ended, and missed the step)
            step = ctx.diloco.outer_step
            if await self._peers_matchmaking(step, delay):
                return
            if not logged:
                logger.info("waiting up to %.1fs for slower peers of step %d", delay, step)
                logged = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), min(delay, WAIT_RECHECK_S))

    async def _peers_matchmaking(self, step: int, within: float) -> bool:
        """Are peers of our step matchmaking it with our state already (plan.peers_matchmaking)?
        One read of its ready set, bounded by `within` (the rest of our wait: past it we
        matchmake anyway)."""
        try:
            announced = await asyncio.wait_for(self.ctx.averager.announced(step), within)
        except asyncio.TimeoutError:
            return False
        if matchmaking := peers_matchmaking(self.view.read(), announced, self.facts.state_sha):
            logger.info("step %d: %d peer(s) of our step are matchmaking it already: joining them", step, matchmaking)
            return True
        return False

    async def after_peers(self, step: int, weight: float) -> Matchmade | None:
        """wait_for_peers, then matchmake; None when stopped meanwhile."""
        await self.wait_for_peers()
        return None if self.ctx.stop.is_set() else await self.matchmake(step, weight)
