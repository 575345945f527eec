"""OuterLoop: a SwarmNode's (node.py) outer steps, one after another, until the last or a stop.

One outer step, in the order `OuterLoop.step` runs it (the decisions are plan.py's; this module
only executes them):
1. Plan (plan_step): fetch the swarm's state first, train H inner steps (fewer for a node that
   arrived while its peers were training), or join the peers' forming group at once with weight 0.
2. Inner steps and matchmaking. The inner steps run in a thread, outside the event loop, which
   keeps serving: swarm-node's DataTrainingThread (swarm/node/training_thread.py) or the caller's own loop
   (swarm.join), each given permits (swarm/node/inner_steps.py). Matchmaking starts
   `matchmaking_time` before the slowest live peer of the step should finish and ends as soon
   as every expected peer has announced: one group of every ready node whose state equals the
   swarm's (grouping.py; swarm/averaging/matchmaking/matchmaker.py). Once a peer of the step is
   done with its inner steps (peers_wait_for_us), a training thread with no data chunk free ends
   ours with what it trained: that peer may hold the chunk and train it only in its next step.
3. The round (StepEnd.finish, step_end.py): with a group, Δ = θ_outer - θ_inner averaged (int8
   by default), weighted by tokens, and the outer Nesterov step. Without one
   (plan_without_group): fetch the swarm's result, wait for it, matchmake again, or, when no live
   peer works on this step, apply our own Δ.
4. Landing (StepEnd.stepped): eval loss, the state's hash, one `outer_step` event, publish the state.

--overlap eager|delayed: once a step's group has formed, 3 and 4 run in the background (Landing,
step_end.py) while the next step's inner steps already train (DiLoCo.begin_overlap: from θ_outer
moved by our own Δ, or from where the step ended). With --overlap-matchmaking, once its inner
steps are done and the swarm is together (plan.swarm_together: our last group held every live
server), the rest of 2 (the wait for slower peers, the matchmaking still under way) does too;
until the group forms, our record still says the step with its inner steps done
(StepFacts.unmatched), as a blocking node waiting in matchmaking would, so peers plan and
matchmake with us as before. The average (or our own Δ, when no group forms and the plan says
so) lands between two inner steps (InnerSteps.call) with the same θ_outer(t+1) as a blocking
member's, and the next matchmaking waits for it. One step is in flight at most: a node whose
next inner steps end first trains on past H until it lands (extra_steps.py). With
--overlap-matchmaking a node faster than the slowest peer of its step trains on past H into the
step's Δ first, while that peer should still be training (extra_steps.py). A step in flight
that ends in a fetch discards the next step's inner steps (REPLAN). A late joiner's step (no
inner steps of ours) and the last step block as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass

from swarm.averaging.matchmaking.matchmaker import Matchmade
from swarm.node.context import RunContext, StepFacts
from swarm.node.extra_steps import train_on_for_slower, train_until_landed
from swarm.node.grouping import Grouping
from swarm.node.plan import (
    FETCH,
    JOIN_FORMING,
    Facts,
    matchmaking_start,
    peers_still_behind,
    plan_step,
    swarm_together,
)
from swarm.node.settings import run_has_ended, stop_step
from swarm.node.step_end import RESULT_POLL, Landing, StepEnd, Unmatched
from swarm.node.view import SwarmView

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often the loop looks at the trainer's progress
FINAL_STRETCH = 3.0  # seconds before matchmaking in which peers' progress is read often
FINAL_REFRESH_SECONDS = 0.5
LATE_GATHER = 0.3  # seconds a node joining an already gathering group waits for it
WAITED_ON_RECHECK = 1.0  # seconds between readings of whether peers of our step wait for our inner steps
RUN_ENDED = "run ended"  # why a node that arrived after the run's end left at once (exit 0, not "finished")


def peers_wait_for_us(f: Facts) -> bool:
    """A live peer of our outer step is done with its inner steps: it waits for ours (matchmaking,
    or its round). Our training thread, when no data chunk is free for it, then ends our inner
    steps with what it has (InnerSteps.waited_on): at an epoch's end the chunk it waits for may
    be held by that peer, which trains the rest of it only in its next step."""
    return any(p.step == f.step and p.inner >= p.inner_steps for p in f.live())


class Replan:
    """A step ended before it had a group to finish with (a fetch, a plan to fetch): plan again."""


REPLAN = Replan()


@dataclass(slots=True)
class _Training:
    """One step's inner steps under way (_train_and_matchmake), and what runs beside them."""

    step: int
    weight: float  # the tokens this step trains: its weight in the round
    training: asyncio.Future[None]  # the inner steps' permits, all spent
    stopping: asyncio.Future[bool]  # the node's stop was set
    after: asyncio.Future[bool] | None  # the last step, landing meanwhile (--overlap); None once it landed
    matchmaking: asyncio.Future[Matchmade] | None = None  # begun while the last inner steps run


class OuterLoop:
    """The outer-step loop of a SwarmNode (the module docstring): `run` takes the steps one after
    another (with --overlap, the end of each in the background while the next trains), then
    serves our state to late peers a while. It owns the view of the swarm (SwarmView), the
    matchmaking (Grouping) and the step's end (StepEnd), all made for the run's context."""

    def __init__(self, ctx: RunContext, facts: StepFacts) -> None:
        self.ctx, self.facts = ctx, facts
        self.view = SwarmView(ctx, facts)
        self.groups = Grouping(ctx, facts, self.view)
        self.ends = StepEnd(ctx, facts, self.view, self.groups)
        # --start-with: the nodes that started the run with us, our "last group" before our first
        # step, and the fetches by then (a fetch since: the run went on without that start); run sets them
        self._started_with = (0, 0)

    async def run(self, started_with: int = 0) -> str:
        """Train until the stop or the last step; returns why it ended: "stopped", "finished" (the
        run's end), "left" (--leave-after-steps; the run goes on) or RUN_ENDED (it had ended before
        we arrived: nothing to train)."""
        ctx, config = self.ctx, self.ctx.config
        end = config.run_end
        if run_has_ended(end, ctx.diloco.outer_step, [p.step for p in self.view.read().peers], ctx.keeper.holder_steps):
            logger.warning("the run ended at step %d (all %d of its outer steps done) before this node joined: "
                           "nothing left to train", end, end)  # fmt: skip
            return RUN_ENDED
        self.facts.stop_at = stop_step(end, config.leave_after_steps, ctx.diloco.outer_step)
        leaving = self.facts.stop_at != end
        self._started_with = (started_with, self.facts.fetches)
        self.facts.began = asyncio.get_running_loop().time()
        in_flight: asyncio.Future[bool] | None = None  # --overlap: the last step's end, landing meanwhile
        try:
            while True:
                if ctx.stop.is_set():
                    return "stopped"
                if in_flight is None and not self._steps_left():
                    break
                # the step takes the one in flight over: it settles that one, whatever happens
                last, in_flight = in_flight, None
                in_flight, going_on = await self.step(last)
                if not going_on:
                    return "stopped"
            await self.view.publish()  # our last record says we are done: nobody lingers for us
            await self._linger()
            if leaving:
                logger.info("leaving the run after outer step %d (%d outer steps done; --leave-after-steps)",
                            ctx.diloco.outer_step - 1, ctx.diloco.outer_step)  # fmt: skip
                return "left"
            return "finished"
        finally:
            if in_flight is not None:  # stopped while it lands: the group counts on our part of it
                await self._settle(in_flight)

    async def step(self, in_flight: asyncio.Future[bool] | None) -> tuple[asyncio.Future[bool] | None, bool]:
        """One outer step, top to bottom: (the step landing in the background, if any; False when
        stopped). `in_flight`: the last step, still landing (--overlap): the next step trains at
        once, and matchmakes once the last has landed."""
        ctx = self.ctx
        # 1. plan, and 2. inner steps with matchmaking
        if in_flight is not None:
            step = ctx.diloco.working_step
            found = await self._train_and_matchmake(step, ctx.config.inner_steps, after=in_flight)
        else:
            step, found = await self._plan_and_train()
        if found is None:
            return None, False
        if isinstance(found, Replan):  # a fetch replaced the state (or the step in flight ended in one): plan afresh
            return None, True
        # 3. the round and 4. landing: in the background while the next step trains (--overlap)
        if isinstance(found, Unmatched):
            landing = Landing(self.ends, step, found, ctx.inner.snapshot())  # its own inner steps
            await ctx.inner.call(functools.partial(ctx.diloco.begin_overlap, eager=ctx.config.overlap == "eager"))
            return asyncio.ensure_future(landing.land()), True
        await self.ends.finish(step, found)
        return None, True

    # --- 1. plan ------------------------------------------------------------------------------

    async def _plan_and_train(self) -> tuple[int, Matchmade | Unmatched | Replan | None]:
        """One step as plan_step says: (the step, its group; REPLAN to plan again; None: stopped)."""
        ctx, facts = self.ctx, self.facts
        if facts.last_group > 0:  # after our first step here: fell behind? missed a group?
            await self.ends.fetch(alone=facts.last_group == 1)
        step = ctx.diloco.outer_step
        if not self._steps_left():
            return step, REPLAN
        await ctx.book.refresh()
        seen = self.view.read()
        plan = plan_step(seen)
        facts.planned_at = facts.fetches  # planned: no longer late, until the next fetch
        if plan.action == FETCH:
            if await self.ends.fetch(alone=False):
                return step, REPLAN
            self._fetch_came_to_nothing(seen)
            with contextlib.suppress(asyncio.TimeoutError):  # look again soon, unless stopped
                await asyncio.wait_for(ctx.stop.wait(), RESULT_POLL)
            return step, REPLAN
        if plan.action == JOIN_FORMING:
            logger.info("step %d: %s: joining with no inner steps of ours", step, plan.why)
            ctx.inner.start_step(0)
            await self.view.publish()  # "done with this step's inner steps": the group expects us
            found = await self.groups.matchmake(step, weight=0.0, gather=LATE_GATHER, joining=True)
            if found.group is None and not (found.late or found.other_state):
                # the group may have been made final a moment before our join (its FORMED markers
                # are stored after it): look once more before training a whole step behind it
                # (16 nodes under load: 7 trained each step while the other 9 averaged it, and
                # fetched its result, one step behind for the whole run)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ctx.stop.wait(), RESULT_POLL)
                if ctx.stop.is_set():
                    return step, None
                found = await self.groups.matchmake(step, weight=0.0, gather=LATE_GATHER, joining=True)
            if found.group is not None or found.late or found.other_state:
                return step, found
            # nobody took us in: the records that showed our step's peers matchmaking were stale,
            # or were a fork's other lineage at our step. A joiner has nothing to give and cannot
            # lead; had every node of the step read the records so, none would ever train
            logger.info("step %d: no group was forming after all: training the step", step)
            return step, await self._train_and_matchmake(step, ctx.config.inner_steps)
        if plan.inner_steps < ctx.config.inner_steps:
            logger.info("step %d: %s: %d of %d inner steps", step, plan.why, plan.inner_steps, ctx.config.inner_steps)
        return step, await self._train_and_matchmake(step, plan.inner_steps)

    def _fetch_came_to_nothing(self, seen: Facts) -> None:
        """We planned to fetch the swarm's newer state and took nothing: past max_wait of that,
        the peers whose records said they were ahead are not believed until they average with
        us (view.AheadWatch)."""
        ahead = [p.peer_id for p in seen.live() if p.step > seen.step and not p.client]
        dropped = self.view.ahead.came_to_nothing(seen.step, seen.now, ahead)
        if dropped:
            logger.warning("step %d: %d peer(s) said they were at a later step and no state of theirs came in "
                           "%.0fs: planning our step without them (their records ahead are not believed until "
                           "they average with us)",
                           seen.step, len(dropped), self.ctx.config.max_wait)  # fmt: skip

    def _steps_left(self) -> bool:
        if self.facts.run_over:
            return False
        return self.facts.stop_at is None or self.ctx.diloco.outer_step < self.facts.stop_at

    # --- 2. inner steps and matchmaking -------------------------------------------------------

    async def _train_and_matchmake(
        self, step: int, target: int, *, after: asyncio.Future[bool] | None = None
    ) -> Matchmade | Unmatched | Replan | None:
        """Train `target` inner steps; start matchmaking while the last ones run (module
        docstring, 2). None when stopped; Unmatched with --overlap (the group may still be
        forming). `after`: the last step in flight (--overlap): matchmaking waits for it to land;
        REPLAN when it did not (a fetch replaced the state)."""
        ctx = self.ctx
        ctx.inner.start_step(target)
        weight = float(target * ctx.config.batch_size * ctx.config.seq_len)  # tokens this step
        t = _Training(step, weight, asyncio.ensure_future(ctx.inner.train(target)),
                      asyncio.ensure_future(ctx.stop.wait()), after)  # fmt: skip
        try:
            if not await self._inner_steps(t):
                return await self._replan(t.training)
            if t.stopping.done() and t.matchmaking is None:
                ctx.inner.finish()  # the node closes the steps at exit, once a round in flight has landed
                await asyncio.gather(t.training, return_exceptions=True)
                return None
            t.training.result()  # raises NodeError on divergence
            if t.after is not None:  # trained before the last round landed: train on until it does
                await train_until_landed(self.ctx, t.after, t.stopping)
                if not t.after.done():
                    return None
                if not t.after.result():
                    return await self._replan(t.training)
                t.after = None
            return await self._matchmade(t)
        except BaseException:  # the training failed (a divergence, a rank of the node lost): the node ends,
            # and our matchmaking must end with it, before the loop closes, not run on orphaned
            if t.matchmaking is not None and not t.matchmaking.done():
                t.matchmaking.cancel()
                await asyncio.wait({t.matchmaking})
                if not t.matchmaking.cancelled() and t.matchmaking.exception() is not None:
                    logger.debug("step %d: matchmaking ended with %r", step, t.matchmaking.exception())
            raise
        finally:
            t.stopping.cancel()
            if t.matchmaking is not None and not t.matchmaking.done() and ctx.stop.is_set():
                t.matchmaking.cancel()
            if t.after is not None and not t.after.done():
                await self._settle(t.after)

    async def _inner_steps(self, t: _Training) -> bool:
        """While the inner steps run: publish our record, begin matchmaking when the slowest peer
        is due (module docstring, 2), and notice the last step landing. Returns when they are
        done, or at a stop before matchmaking began; False when the step in flight ended in a
        fetch (its state replaced ours: plan again)."""
        ctx, config = self.ctx, self.ctx.config
        timed, last_event, last_refresh, last_look = False, 0.0, 0.0, 0.0
        # the permits first (train runs up to its first await): the record's store takes
        # round trips on a busy link, which the trainer must not wait for
        await asyncio.sleep(0)
        await self.view.publish()
        # a stop ends the step at once unless matchmaking has begun: then the group may count
        # on us, and we finish the inner steps and the round ("finishes the round under way")
        while not t.training.done() and not (t.stopping.done() and t.matchmaking is None):
            waits = {t.training} if t.stopping.done() else {t.training, t.stopping}
            if t.after is not None and not t.after.done():
                waits.add(t.after)
            await asyncio.wait(waits, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
            if t.after is not None and t.after.done():
                if not t.after.result():  # raises what the round raised
                    return False
                t.after = None  # landed: this is now the step we hold
                await self.view.publish()
            now = ctx.clock()
            if now - last_look >= WAITED_ON_RECHECK:
                last_look = now
                ctx.inner.waited_on = peers_wait_for_us(self.view.read())
            if not timed and ctx.inner.snapshot().inner_done > 0:  # peers learn our pace at once
                timed = True
                await self.view.publish()
            left = ctx.inner.seconds_left()
            if (t.matchmaking is None and t.after is None and not t.stopping.done()
                    and left <= config.matchmaking_time + FINAL_STRETCH):  # fmt: skip
                if now - last_refresh >= FINAL_REFRESH_SECONDS:  # a late peer's record must not be missed
                    last_refresh = now
                    await ctx.book.refresh()
                start = matchmaking_start(self.view.read(), now + left, config.matchmaking_time, config.max_wait)
                if now >= start:
                    t.matchmaking = asyncio.ensure_future(self.groups.matchmake(t.step, t.weight))
            if now - last_event >= 2.0:
                last_event = now
                ctx.events.progress(t.step, ctx.inner.snapshot(), config.inner_steps)
        return True

    async def _matchmade(self, t: _Training) -> Matchmade | Unmatched | None:
        """The step's inner steps are done: its group, once matchmaking (begun now after the wait
        for slower peers, unless it has) answers; with --overlap an Unmatched, whose round runs
        while the next step trains. None when stopped while waiting."""
        ctx = self.ctx
        overlaps = self._overlaps(t.step)
        if overlaps and ctx.config.overlap_matchmaking and swarm_together(self.view.read(), self._last_group()):
            await train_on_for_slower(ctx, self.view, t.stopping)
            # the matchmaking is the landing's now (not cancelled when this step ends); our
            # record is published as the next step trains
            handed, t.matchmaking = t.matchmaking, None
            return Unmatched(handed, t.weight)
        await self.view.publish()
        if t.matchmaking is None:  # nobody told us to start yet: wait for slower peers, bounded
            await self.groups.wait_for_peers()
            if ctx.stop.is_set():
                return None
            t.matchmaking = asyncio.ensure_future(self.groups.matchmake(t.step, t.weight))
        found = await t.matchmaking
        if overlaps and found.group is not None:  # formed: its round runs while the next step trains
            return Unmatched(t.matchmaking, t.weight)
        return found

    def _overlaps(self, step: int) -> bool:
        """--overlap: this step may end in the background while the next one trains. Not a step we
        trained nothing of (a late joiner's), nor the last (nothing left to train). It does once
        its group has formed; with --overlap-matchmaking from the end of its inner steps, when the
        swarm is together (plan.swarm_together; while nodes straggle in, their groups form first)."""
        ctx = self.ctx
        return ctx.config.overlap != "none" and ctx.diloco.inner_done > 0 and not self.facts.last_step(step)

    def _last_group(self) -> int:
        """The size of our last group; before our first step here, the nodes that started the run
        with us (--start-with), unless we fetched since."""
        started_with, fetches = self._started_with
        if self.facts.last_group or self.facts.fetches > fetches:
            return self.facts.last_group
        return started_with

    async def _replan(self, training: asyncio.Future[None]) -> Replan | None:
        """The round in flight ended in a fetch: the permits left are taken back and the step is
        planned afresh from the fetched state."""
        await self.ctx.inner.revoke()
        await asyncio.gather(training, return_exceptions=True)
        return None if self.ctx.stop.is_set() else REPLAN

    # --- after the steps ----------------------------------------------------------------------

    async def _settle(self, in_flight: asyncio.Future[bool]) -> None:
        """Wait for a round in flight to end (its own timeouts bound it); a failure is logged."""
        try:
            await asyncio.wait({in_flight})
        except asyncio.CancelledError:
            in_flight.cancel()
            raise
        if not in_flight.cancelled() and in_flight.exception() is not None:
            logger.error("the round in flight failed", exc_info=in_flight.exception())

    async def _linger(self) -> None:
        """Done: serve our state a while longer to the live peers still on an earlier step
        (plan.peers_still_behind), at most max_wait."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        deadline = loop.time() + ctx.config.max_wait
        while not ctx.stop.is_set() and loop.time() < deadline:
            await ctx.book.refresh()
            behind = peers_still_behind(self.view.read())
            if not behind:
                return
            logger.info("finished; serving our state to %d peer(s) still behind", len(behind))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), RESULT_POLL)
