"""SwarmView: what a node reads of its swarm and says of itself, through the run's progress
records (progress.py). `read` turns the peers' records into the facts the plans decide on
(plan.Facts); `publish` stores our own record.
"""

from __future__ import annotations

import logging

from swarm.node.context import RunContext, StepFacts
from swarm.node.plan import Facts, borrowed_pace, median_pace
from swarm.node.progress import OwnProgress, implausible
from swarm.p2p.peer_id import PeerID
from swarm.state.trust import step_horizon
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)


class SwarmView:
    """The node's reading of the progress book, and its own record in it."""

    def __init__(self, ctx: RunContext, facts: StepFacts) -> None:
        self.ctx, self.facts = ctx, facts
        self._bad_records = OncePerPeer(logger)  # a peer's unbelievable record is logged once
        # the last inner-step pace seen (ours or the peers' median); 0: none yet. Remembered: a
        # newcomer whose peers all left still knows how fast the run went (horizon)
        self._pace_seen = 0.0

    def read(self) -> Facts:
        """The facts the plans decide on, from the records the book read last."""
        ctx = self.ctx
        pace, now = ctx.inner.snapshot().sec_per_step, ctx.clock()
        horizon = self.horizon()
        peers = []
        for p in ctx.book.peers:  # records the run cannot produce are not believed (progress.implausible)
            why = implausible(p, now=now, inner_steps=ctx.config.inner_steps, max_step=horizon)
            if why is None and p.settings is not None and p.settings.digest != ctx.settings.digest:
                why = "it trains with other run settings (never grouped with: not waited for)"
            if why is None:
                peers.append(p)
            else:
                self._bad_records.log(p.peer_id, "progress", "ignoring its progress record: %s", why)
        return Facts(step=ctx.diloco.outer_step, inner_steps=ctx.config.inner_steps, own_sec=pace,
                     client=ctx.client, peers=tuple(peers), now=now, fresh_for=ctx.book.fresh_for,
                     late=self.facts.late, watched_for=now - ctx.book.first_read,
                     sees_peers=ctx.book.read_ok, own_record_age=now - ctx.book.stored_at,
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
        await ctx.book.publish(OwnProgress(
            maddrs=ctx.maddrs(), client=ctx.client, step=step, inner=inner, H=target, sec_per_step=sec,
            train_loss=sum(losses) / len(losses) if losses else None,
            eval_loss=facts.last_eval, group_size=facts.last_group,
            tokens_per_s=round(config.batch_size * config.seq_len / sec, 1) if sec > 0 else None,
            settings=ctx.settings.wire(), evals=ctx.events.evals, bytes_sent=ctx.events.wire_sent,
            bytes_received=ctx.events.wire_received, reach=ctx.reach(),
        ))  # fmt: skip
