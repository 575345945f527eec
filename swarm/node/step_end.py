"""How an outer step ends, once its inner steps are done and its matchmaking has answered
(loop.py calls these): StepEnd.finish averages and applies with the group, or, without one
(plan_without_group), takes the swarm's result, matchmakes again, or applies our own Δ; then
`stepped` evals, hashes, emits the `outer_step` event and publishes the state. StepEnd.fetch
takes the swarm's state when we fell behind. With --overlap a step ends in the background while
the next trains (Landing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarm.averaging.averager import GroupReport
from swarm.averaging.errors import AllReduceError
from swarm.averaging.matchmaking.matchmaker import Matchmade
from swarm.dht.errors import DHTError
from swarm.model.checkpoint import CheckpointError
from swarm.model.compression import outgoing
from swarm.node.context import RunContext, StepFacts
from swarm.node.errors import NodeError
from swarm.node.grouping import Grouping
from swarm.node.plan import (
    APPLY_OWN,
    AWAIT_RESULT,
    END,
    FETCH,
    RECHECK,
    RETRY,
    StepPlan,
    plan_without_group,
    result_still_coming,
    servers_behind,
    unkept_markers,
)
from swarm.node.view import SwarmView
from swarm.p2p.errors import P2PError
from swarm.p2p.peer_id import PeerID
from swarm.state.fetcher import FetchError
from swarm.utils.log_once import RateLimitedLog
from swarm.utils.process_memory import resident_bytes

if TYPE_CHECKING:
    from swarm.node.inner_steps import InnerProgress

logger = logging.getLogger(__name__)

RESULT_POLL = 0.5  # seconds between looks for a step's result while waiting for it
# a group of our step formed without us: its result is seconds away, and the sooner we hold it
# the more of the next step we train with the others (bounded by max_wait: a few lookups a second)
AWAIT_POLL = 0.15


@dataclass(frozen=True, slots=True)
class Unmatched:
    """A step whose inner steps are done, ending in the background (--overlap) while the next
    trains: `matchmaking` formed its group, or is still under way, or (None) has not begun (the
    slowest peers are still training; --overlap-matchmaking)."""

    matchmaking: asyncio.Future[Matchmade] | None
    weight: float  # the tokens the step trained: its weight in the round

    @property
    def formed(self) -> bool:
        """The group has formed already (plain --overlap, or a quick matchmaking)."""
        m = self.matchmaking
        if m is None or not m.done() or m.cancelled() or m.exception() is not None:
            return False
        return m.result().group is not None


@dataclass(slots=True)
class _Groupless:
    """What the matchmakings of one step that found no group have told us (StepEnd.finish)."""

    since: float | None = None  # the last matchmaking without a group ended then (the event loop's time)
    first: float | None = None  # the first one did
    late: bool = False  # a group of our state formed without us at this step: its result exists
    late_by: frozenset[PeerID] = field(default_factory=frozenset)  # whose FORMED markers said so
    confirmed: bool = False  # the last step: a RECHECK found the group that formed without us standing

    def no_group(self, found: Matchmade, now: float) -> None:
        """A matchmaking of the step ended without a group (`found`), or its round failed."""
        if self.since is None:
            self.since = now
        self.late, self.late_by = self.late or found.late, self.late_by | found.late_by
        if self.first is None:
            self.first = self.since


class StepEnd:
    """The end of the node's outer steps (the module docstring). Reads the run's context, and
    writes the StepFacts fields named after its methods: fetches, state_sha, known_at,
    last_group, tokens, last_eval, eval_s, run_over."""

    def __init__(self, ctx: RunContext, facts: StepFacts, view: SwarmView, groups: Grouping) -> None:
        self.ctx, self.facts, self.view, self.groups = ctx, facts, view, groups
        self._fetch_failures = RateLimitedLog(logger, burst=3, period=30.0)  # a late node looks a few times a second

    async def finish(self, step: int, found: Matchmade, landing: Landing | None = None) -> bool:
        """The end of outer step `step`, whatever happened: average and apply with the group, or
        (plan_without_group) take the swarm's result, matchmake again, or apply our own Δ. True
        when the step was applied to what we hold, False after a fetch or a stop. `landing`:
        the step ends in the background while the next one trains (--overlap)."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        g = _Groupless()
        while ctx.diloco.outer_step == step:
            if found.group is not None:  # stopping or not: the group counts on our part
                report = await self._round(step, found, landing)
                if report is not None:
                    await self.stepped(step, report, None if landing is None else landing.progress)
                    return True
                found = Matchmade(None, found.seconds)
            if ctx.stop.is_set():
                return False
            g.no_group(found, loop.time())
            await ctx.book.refresh()
            facts = self.view.read()
            plan = plan_without_group(facts, late=g.late, other_state=found.other_state,
                                      waited=loop.time() - g.since, max_wait=ctx.config.max_wait,
                                      ready_peers=found.peers, groupless_for=loop.time() - g.first,
                                      last=self.facts.last_step(step), late_confirmed=g.confirmed)  # fmt: skip
            if plan.action == APPLY_OWN:  # with peers in the run, a reason to look at
                logger.log(logging.WARNING if facts.peers else logging.INFO, "step %d: %s: %s", step, plan.why,
                           facts.summary())  # fmt: skip
            if plan.action == END:
                logger.warning("step %d: %s", step, plan.why)
                self.facts.run_over = True
                return False
            after = await self._without_group(step, plan, found, g, landing)
            if isinstance(after, bool):
                return after
            found = after
        return False

    async def _without_group(self, step: int, plan: StepPlan, found: Matchmade, g: _Groupless,
                             landing: Landing | None) -> Matchmade | bool:  # fmt: skip
        """Follow a plan_without_group (not END): True or False ends the step as `finish` says;
        a Matchmade is the step's next matchmaking to go on with."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        if plan.action == APPLY_OWN:
            await ctx.inner.call(ctx.diloco.apply_own)
            await self.stepped(step, GroupReport(None, matchmaking_s=found.seconds),
                               None if landing is None else landing.progress)  # fmt: skip
            return True
        if plan.action == FETCH:
            logger.info("step %d: %s: fetching the swarm's state", step, plan.why)
            if await self.fetch(alone=False, other_state=found.other_state, missed=g.late):
                self._judge_markers(step, g.late_by)
                return False  # the peers are already training on it: our next step is late
            await asyncio.sleep(RESULT_POLL)
            return Matchmade(None, found.seconds)  # nothing to fetch yet: look again
        if plan.action == RETRY and await self._result_coming(step, g):
            plan = StepPlan(AWAIT_RESULT, "the round of the group that formed without us is still under way")
        if plan.action == AWAIT_RESULT:  # the holders may show the result before the records do
            if await self.fetch(alone=False, missed=g.late):
                self._judge_markers(step, g.late_by)
                return False
            await asyncio.sleep(AWAIT_POLL)
            return found
        if plan.action == RECHECK:  # trusting the markers still (plan_without_group)
            logger.info("step %d: %s", step, plan.why)
            again = await self.groups.matchmake(step, float(ctx.diloco.round_tokens))
            g.late, g.late_by, g.confirmed = again.late, again.late_by, again.late
            g.since = None if again.group is not None else loop.time()
            return again
        # RETRY
        if g.late and g.late_by and g.since is not None and loop.time() - g.since >= ctx.config.max_wait:
            # we waited max_wait for the result of their group: none came. Believing
            # their markers again would keep us (and anyone they fool) waiting forever
            ctx.averager.distrust_formed(g.late_by)
            g.late, g.late_by = False, frozenset()
        logger.info(
            "step %d: %s%s",
            step,
            plan.why,
            " (the step's result was computed without us; its holders may have left)" if g.late else "",
        )
        await asyncio.sleep(RESULT_POLL)
        again = await self.groups.after_peers(step, float(ctx.diloco.round_tokens))
        if again is None:
            return False
        if again.group is not None and await self._second_group(step, again):
            ctx.averager.abandon(again.group)  # its members' streams to us are refused now
            again = Matchmade(None, again.seconds, late=True)  # its result is the step's: await it
        g.since = None if again.group is not None else loop.time()
        return again

    async def _second_group(self, step: int, found: Matchmade) -> bool:
        """Is the group we formed on a retry a second one of our state, beside a larger one
        (ready.outvoted) whose markers came after our first matchmaking? (Two nodes of a soak
        late for a group of 20 averaged the step again as a group of two.)"""
        assert found.group is not None
        ctx = self.ctx
        try:
            larger = await ctx.averager.outvoted(step, found.group.group_id, self.facts.state_sha,
                                                 ctx.lineage.lineage.voters())  # fmt: skip
        except (P2PError, DHTError, TimeoutError) as e:  # unread: the round goes on, as before this check
            logger.info("step %d: could not check for a larger group beside ours: %s", step, e)
            return False
        if larger:
            members = len(found.group.members)
            logger.warning("step %d: a larger group of our state formed at this step before ours (of %d): "
                           "taking its result, not averaging the step again", step, members)  # fmt: skip
        return larger

    async def _result_coming(self, step: int, g: _Groupless) -> bool:
        """Late past max_wait: is the result of the group that formed without us still coming?"""
        if not (g.late and g.late_by and g.since is not None):
            return False
        at_step = any(p.peer_id in g.late_by and p.step == step for p in self.view.read().live())
        # one read of the step's markers, only while their owners still say the step
        standing = g.late_by & await self.ctx.averager.formed(step) if at_step else frozenset()
        config = self.ctx.config
        waited = asyncio.get_running_loop().time() - g.since
        return result_still_coming(waited, config.max_wait, config.part_timeout, at_step, bool(standing))

    def _judge_markers(self, step: int, late_by: frozenset[PeerID]) -> None:
        """We took the swarm's result of `step` after FORMED markers of `late_by` said a group of
        our state formed without us: the owners plan.unkept_markers names promised a group that
        gave us nothing, and their markers are not believed again. A fetch from beyond our
        lineage's record of that round (its anchor is later) says nothing of them."""
        link = self.ctx.keeper.lineage.lineage.link_into(step + 1)
        if link is None:
            return
        live = frozenset(p.peer_id for p in self.view.read().live())
        if unkept := unkept_markers(late_by, frozenset(link.members), live):
            self.ctx.averager.distrust_formed(unkept)

    async def _round(self, step: int, found: Matchmade, landing: Landing | None) -> GroupReport | None:
        """Average with the group that formed and apply the outer step; None when the round failed."""
        if landing is not None and landing.round_begins():  # our record says the next step at once:
            # peers there expect us (we train it already). Stored beside the round: the round must
            # not wait for the DHT's round trips (every member's late start is the whole group's)
            report, _ = await asyncio.gather(self._average(found), self.view.publish())
        else:
            report = await self._average(found)
        if report is None:
            self.ctx.averager.round_failed(step)
            if landing is not None:
                # overlapped: our record has said the next step since the group formed. Its
                # members' rounds failed too, and they must find us at this step again (done
                # training it), or each would read the others as past it and step alone
                landing.round_failed()
                await self.view.publish()
        return report

    async def _average(self, found: Matchmade) -> GroupReport | None:
        ctx, diloco, feedback = self.ctx, self.ctx.diloco, self.ctx.feedback
        step, base = diloco.outer_step, self.facts.state_sha.hex()  # the state the group averaged from
        # an overlapped step's Δ is set aside (begin_overlap) and read as it is; otherwise the
        # inner steps must be between two steps (the round would wait for the one under way)
        deltas = diloco.round_deltas() if diloco.pending is not None else await ctx.inner.call(diloco.round_deltas)
        # what this step sends: the residual of earlier steps with it (error feedback), only the
        # step's chosen blocks with a density below 1 (beside: the inner steps go on meanwhile)
        payload = await ctx.inner.beside(outgoing, deltas, ctx.compression, feedback, ctx.config.run_id,
                                         diloco.outer_step, ctx.block_size)  # fmt: skip
        # a watcher (swarm-sim's soak) sees the round begin: its outer_step event ends it
        if found.group is not None:
            ctx.events.emit("round", outer_step=step, group_size=len(found.group.members),
                            group_id=found.group.group_id.hex())  # fmt: skip
        try:
            averaged, report = await ctx.averager.run_round(found.group, payload.tensors, found.seconds)
        except AllReduceError as e:
            logger.warning("all-reduce of step %d failed: %s", diloco.outer_step, e)
            return None
        update = await ctx.inner.beside(payload.unpack, averaged)  # tensor work, off the loop: reads no θ_inner
        try:
            await ctx.inner.call(diloco.apply_outer, update)
        except ValueError as e:  # a non-finite average (never from a robust round): θ_outer stays
            logger.error("step %d: refusing the group's average, as if the round failed: %s", diloco.outer_step, e)
            return None
        # a node that missed this group can take the step from it (state/update.py) before we advertise it
        ctx.keeper.record_update(step, base, update, ctx.compression.codec, ctx.block_size)
        if feedback is not None and payload.compensated is not None:
            feedback.commit(payload.compensated)
        return report

    async def stepped(self, step: int, report: GroupReport, progress: InnerProgress | None = None) -> None:
        """After the outer step is applied: eval (of θ_outer), hash, receipt, event, publish.
        `progress`: the step's inner steps, when the next step's already run (--overlap)."""
        ctx, diloco, config, facts = self.ctx, self.ctx.diloco, self.ctx.config, self.facts
        last = facts.stop_at is not None and diloco.outer_step >= facts.stop_at
        evaluate = last or diloco.outer_step % config.eval_every == 0
        if evaluate and ctx.evaluate is not None:
            began = time.perf_counter()
            facts.last_eval = float(await ctx.inner.call(diloco.on_outer_weights, ctx.evaluate))
            facts.eval_s += time.perf_counter() - began
        parent = facts.state_sha
        sha = await self.rehash()
        overlapped = progress is not None  # the next step's inner steps ran while this one's round did
        progress = progress or ctx.inner.snapshot()
        weight = progress.inner_done * config.batch_size * config.seq_len
        group = report.group  # the receipt of the round (or of our Δ alone) that made this state
        voters = ctx.lineage.lineage.voters()  # of the round before this one: they weigh a fork of it
        if group is not None:
            members = [(m.peer_id, m.weight) for m in group.members]
            ctx.lineage.record_round(step, group.group_id, members, parent, facts.state_sha)
        else:
            ctx.lineage.record_alone(step, float(weight), parent, facts.state_sha)
        facts.tokens += weight
        facts.last_group = len(report.members) if report.group_id is not None else 1
        if report.group_id is not None:  # in sync with a group: the swarm was at this step now
            self.groups.forks.stepped(step, bytes.fromhex(report.group_id), parent, voters)
            self.in_sync()
        self._emit_step(step, report, progress, sha, evaluate=evaluate, overlapped=overlapped)
        await ctx.keeper.publish(diloco, local=ctx.feedback.state_dict if ctx.feedback is not None else None)

    def _emit_step(self, step: int, report: GroupReport, progress: InnerProgress, sha: str, *, evaluate: bool,
                   overlapped: bool) -> None:  # fmt: skip
        """The `outer_step` event (events.py's docstring lists its fields)."""
        ctx, facts = self.ctx, self.facts
        wall_s = asyncio.get_running_loop().time() - facts.began
        ctx.events.emit("outer_step", outer_step=step,
                        train_loss=sum(progress.losses) / len(progress.losses) if progress.losses else None,
                        eval_loss=facts.last_eval if evaluate else None, state_sha256=sha,
                        group_size=facts.last_group, group_id=report.group_id, bytes_sent=report.bytes_sent,
                        bytes_received=report.bytes_received, matchmaking_s=round(report.matchmaking_s, 4),
                        round_s=round(report.reduce_s + report.gather_s, 4), inner_done=progress.inner_done,
                        part_timeout_s=round(report.part_timeout, 3),
                        clipped=sum(len(members) for members in report.clipped.values()),
                        inner_s=round(progress.inner_s, 4), wall_s=round(wall_s, 4), eval_s=round(facts.eval_s, 4),
                        tokens=facts.tokens,
                        inner_ahead=ctx.diloco.inner_done if overlapped else 0,
                        tokens_per_s=round(facts.tokens / wall_s, 1) if wall_s > 0 else 0.0,
                        rss_bytes=resident_bytes())  # fmt: skip

    async def fetch(self, *, alone: bool, other_state: bool = False, missed: bool = False) -> bool:
        """Fetch the swarm's state when we should (swarm/state/keeper.py); True after a fetch.
        `alone`: our last step was taken alone. `missed`: a group of our state formed at this
        step without us (trust.Known.missed)."""
        ctx, diloco = self.ctx, self.ctx.diloco
        try:
            fetched = await ctx.keeper.catch_up(diloco, alone_last_step=alone, servers_behind=servers_behind(
                self.view.read()), other_state=other_state, horizon=self.view.horizon(), missed=missed)  # fmt: skip
        except CheckpointError as e:  # IncompatibleState: the run's state is not for this node
            raise NodeError(f"cannot use the run's state: {e}") from None
        except FetchError as e:
            self._fetch_failures.log("fetch", "could not fetch the swarm's state: %s", e)
            return False
        if fetched is None:
            return False
        if ctx.feedback is not None:  # its residual is of a state we no longer hold
            ctx.feedback.reset()
        self.groups.forks.forget()
        self.view.ahead.fetched()
        # our next step is late (StepFacts.late), and the nodes we started with (--start-with)
        # no longer count as our last group: the run went on without that start
        self.facts.fetches += 1
        self.in_sync()
        sha = await self.rehash()
        ctx.events.fetched(diloco.outer_step, *fetched, sha)
        # our record says our new step now, not at the next tick: peers matchmaking it count a
        # peer one step behind as expected (plan.expected_peers) only if they see where we are;
        # with records publish_interval old, a newcomer was late for each of its first steps
        await self.view.publish()
        return True

    def in_sync(self) -> None:
        """We hold the swarm's state of now (a fetch, a step with a group): the base of the
        plausible-step horizon (SwarmView.horizon)."""
        self.facts.known_at = (self.ctx.diloco.outer_step, self.ctx.clock())

    async def rehash(self) -> str:
        """The state we hold changed (the start, an outer step, a fetch): its hash, which we
        announce in matchmaking from now on. Computed beside the inner steps: it reads θ_outer."""
        sha = await self.ctx.inner.beside(self.ctx.diloco.state_sha256)
        self.facts.state_sha = bytes.fromhex(sha)
        return sha


class Landing:
    """A step whose inner steps are done, ending in the background (--overlap) while the next
    step trains (loop.py). The one writer of StepFacts.unmatched: until its group forms, and
    again after a failed round, our record says this step with its inner steps done, as a
    blocking node waiting in matchmaking would, so peers plan and matchmake with us as before."""

    def __init__(self, ends: StepEnd, step: int, unmatched: Unmatched, progress: InnerProgress) -> None:
        self.ends, self.step, self.unmatched = ends, step, unmatched
        self.progress = progress  # the step's own inner steps, before the next step's begin
        self._says = (step, progress.inner_done, progress.target)
        if not unmatched.formed:  # set before the next step begins: no record says it meanwhile
            ends.facts.unmatched = self._says

    def round_begins(self) -> bool:
        """A round of the step begins: our record may say the next step. True when it said this one."""
        said, self.ends.facts.unmatched = self.ends.facts.unmatched is not None, None
        return said

    def round_failed(self) -> None:
        """The round failed: our record says this step again until another round begins."""
        self.ends.facts.unmatched = self._says

    async def land(self) -> bool:
        """The step's matchmaking's result, or (not begun) the wait for slower peers and a
        matchmaking, then StepEnd.finish. False when stopped first, or after a fetch."""
        try:
            if self.unmatched.matchmaking is not None:
                found: Matchmade | None = await self.unmatched.matchmaking
            else:
                found = await self.ends.groups.after_peers(self.step, self.unmatched.weight)
            if found is None:
                return False
            return await self.ends.finish(self.step, found, self)
        finally:
            self.ends.facts.unmatched = None
