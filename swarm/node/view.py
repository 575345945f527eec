"""SwarmView: what a node reads of its swarm and says of itself, through the run's progress
records (progress.py). `read` turns the peers' records into the facts the plans decide on
(plan.Facts); `publish` stores our own record.

A record that says a later step than ours makes the node fetch instead of train (plan.FETCH), so
records ahead are believed only while they can lead to a state: not those of a peer that
advertised a state whose lineage we refused (Adoption.forked: a fork, not our swarm's result), nor
those of peers we planned to fetch from for max_wait while no state came (AheadWatch). Without
that, as many identities as stood at a node's step, saying they were ahead, held it in FETCH for
as long as they kept saying it, and honest nodes whose own round was the one endorsed waited
minutes on the results of a fork they refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from swarm.node.context import RunContext, StepFacts
from swarm.node.plan import Facts, borrowed_pace, median_pace
from swarm.node.progress import OwnProgress, PeerProgress, implausible
from swarm.p2p.peer_id import PeerID
from swarm.state.trust import step_horizon
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)

LEAVE_RECORD_S = 5.0  # seconds a leaving node gives the store of its last progress record
MAX_UNBELIEVED = 4096  # peers whose records ahead are not believed; past it the memory starts over


class AheadWatch:
    """The peers whose records said a later step than ours while no state of theirs reached us.
    A node that planned to fetch (plan.FETCH) at one step for `max_wait` and took nothing stops
    believing the records ahead of the peers it waited on, until one of them is a member of the
    round that made the state we hold (it averaged: it is there). Each identity that says it is
    ahead and serves nothing holds the swarm once, for max_wait, as a fake FORMED marker does
    (grouping.ForkWatch); those records count only with a proof of a costly id (progress.py)."""

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait
        self._waiting: tuple[int, float] | None = None  # (our step, since when) we plan a fetch that brings nothing
        self._unbelieved: set[PeerID] = set()

    def came_to_nothing(self, step: int, now: float, ahead: Iterable[PeerID]) -> frozenset[PeerID]:
        """A fetch planned at our outer step `step`, at time `now`, took nothing while the peers
        `ahead` said a later step. Returns the peers no longer believed from now on (logged by
        the caller): none until we have planned it for max_wait."""
        if self._waiting is None or self._waiting[0] != step:
            self._waiting = (step, now)
        if now - self._waiting[1] < self.max_wait:
            return frozenset()
        self._waiting = None
        new = frozenset(ahead) - self._unbelieved
        if len(self._unbelieved) + len(new) > MAX_UNBELIEVED:
            self._unbelieved.clear()
        self._unbelieved |= new
        return new

    def fetched(self) -> None:
        """A fetch took a state: the wait it ends was not for nothing."""
        self._waiting = None

    def averaged_with(self, mates: frozenset[PeerID]) -> None:
        """The round that made the state we hold had `mates`: they are there, believed again."""
        self._unbelieved -= mates

    def believed(self, p: PeerProgress, step: int) -> bool:
        """Whether record `p` counts for a node at outer step `step`: one at or behind it does."""
        return p.step <= step or p.peer_id not in self._unbelieved


def ahead_problem(p: PeerProgress, step: int, forked: dict[PeerID, int], watch: AheadWatch) -> str | None:
    """Why a record ahead of our outer step `step` cannot lead us to a state (None: it can, or
    it is not ahead). `forked`: Adoption.forked."""
    if p.step <= step:
        return None
    refused = forked.get(p.peer_id)
    if refused is not None and p.step >= refused:
        return f"it is at step {p.step} of a lineage we refused (its state of step {refused}): not waited on"
    if not watch.believed(p, step):
        return f"it said it was ahead, and no state came from it in {watch.max_wait:.0f}s: not waited on"
    return None


class SwarmView:
    """The node's reading of the progress book, and its own record in it."""

    def __init__(self, ctx: RunContext, facts: StepFacts) -> None:
        self.ctx, self.facts = ctx, facts
        self._bad_records = OncePerPeer(logger)  # a peer's unbelievable record is logged once
        # the last inner-step pace seen (ours or the peers' median); 0: none yet. Remembered: a
        # newcomer whose peers all left still knows how fast the run went (horizon)
        self._pace_seen = 0.0
        self.ahead = AheadWatch(ctx.config.max_wait)

    def read(self) -> Facts:
        """The facts the plans decide on, from the records the book read last."""
        ctx = self.ctx
        pace, now = ctx.inner.snapshot().sec_per_step, ctx.clock()
        horizon = self.horizon()
        mates = self.last_round()  # they averaged with us: on our lineage, whatever we refused of theirs before
        forked = {peer: at for peer, at in ctx.keeper.adoption.forked().items() if peer not in mates}
        step = ctx.diloco.outer_step
        self.ahead.averaged_with(mates)
        peers = []
        for p in ctx.book.peers:  # records the run cannot produce are not believed (progress.implausible)
            why = implausible(p, now=now, inner_steps=ctx.config.inner_steps, max_step=horizon)
            if why is None and p.settings is not None and p.settings.digest != ctx.settings.digest:
                why = "it trains with other run settings (never grouped with: not waited for)"
            if why is not None:
                self._bad_records.log(p.peer_id, "progress", "ignoring its progress record: %s", why)
            elif (unbacked := ahead_problem(p, step, forked, self.ahead)) is not None:
                self._bad_records.log(p.peer_id, "ahead", "%s", unbacked)  # once per peer, as it begins
            else:
                peers.append(p)
        return Facts(step=step, inner_steps=ctx.config.inner_steps, own_sec=pace,
                     client=ctx.client, peers=tuple(peers), now=now, fresh_for=ctx.book.fresh_for,
                     late=self.facts.late, watched_for=now - ctx.book.first_read,
                     sees_peers=ctx.book.read_ok, own_record_age=now - ctx.book.stored_at, unknown=ctx.unknown(),
                     last_round=self.last_round())  # fmt: skip

    def last_round(self) -> frozenset[PeerID]:
        """The members of the round that made the state we hold (none for a state a round did not
        make: the run's first, or a step taken alone). Our own record is not among the peers'."""
        ctx = self.ctx
        link = ctx.lineage.lineage.link_into(ctx.diloco.outer_step)
        return frozenset(link.members) if link is not None and len(link.members) >= 2 else frozenset()

    def horizon(self) -> int | None:
        """The highest outer step the run can have reached by now (trust.step_horizon), from the
        swarm's step we last knew (a fetch, a step with a group), at our pace or the peers'
        median, whichever is faster (a slow node among fast ones must still follow them). None
        before we know any."""
        ctx = self.ctx
        own = ctx.inner.snapshot().sec_per_step
        paces = [s for s in (own, median_pace(list(ctx.book.peers))) if s > 0]
        if paces:
            self._pace_seen = min(paces)
        if self.facts.known_at is None:
            return None
        step, since = self.facts.known_at
        return step_horizon(step, ctx.clock() - since, self._pace_seen, ctx.config.inner_steps)

    async def publish(self) -> None:
        """Store our progress record: our step, inner steps and pace, for the peers' plans."""
        await self.ctx.book.publish(self._own_record())

    async def leave(self) -> None:
        """Our last progress record says that we left the run, so that no peer waits for our step
        until our record ages out. Bounded: a node on its way out does not hang on its DHT."""
        try:
            await asyncio.wait_for(self.ctx.book.leave(self._own_record()), LEAVE_RECORD_S)
        except asyncio.TimeoutError:
            logger.info("our last progress record (we left the run) was not stored in %.0fs: peers see our "
                        "record age out instead", LEAVE_RECORD_S)  # fmt: skip

    def _own_record(self) -> OwnProgress:
        ctx, facts, config = self.ctx, self.facts, self.ctx.config
        p = ctx.inner.snapshot()
        # the model's own count: the trainer's snapshot still shows the last step's right after it
        step, inner, target = ctx.diloco.working_step, ctx.diloco.inner_done, p.target
        if facts.unmatched is not None:  # the next step trains while this one's group forms
            step, inner, target = facts.unmatched
        # past H (extra steps while a round lands, loop.py): peers believe no H above the run's
        target = min(target, config.inner_steps)
        inner = min(inner, target)
        sec = p.sec_per_step
        if sec <= 0:  # no step timed yet (a newcomer): assume the peers' pace until we know ours
            sec = borrowed_pace(list(ctx.book.peers))
        losses = p.losses[-10:]
        return OwnProgress(
            maddrs=ctx.maddrs(), client=ctx.client, step=step, inner=inner, H=target, sec_per_step=sec,
            train_loss=sum(losses) / len(losses) if losses else None,
            eval_loss=facts.last_eval, group_size=facts.last_group,
            tokens_per_s=round(config.batch_size * config.seq_len / sec, 1) if sec > 0 else None,
            settings=ctx.settings.wire(), evals=ctx.events.evals, bytes_sent=ctx.events.wire_sent,
            bytes_received=ctx.events.wire_received, reach=ctx.reach(),
        )  # fmt: skip
