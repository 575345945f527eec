"""OuterStepLoop: a SwarmNode's (node.py) outer steps, one after another, until the last or a stop.

One outer step (the decisions are swarm/node/plan.py's; this module only executes them):
1. plan_step: fetch the swarm's state first, train H inner steps (fewer for a node that arrived
   while its peers were training), or join the peers' forming group at once with weight 0.
2. Inner steps run in a thread, outside the event loop, which keeps serving: swarm-node's
   DataLoop (swarm/node/data_loop.py) or the caller's own loop (swarm.join), each given permits
   (swarm/node/permits.py).
   Matchmaking starts `matchmaking_time` before the slowest live peer of the step should finish
   and ends as soon as every expected peer has announced: one group of every ready node whose
   state equals the swarm's (swarm/averaging/matchmaking/matchmaker.py).
3. With a group: Δ = θ_outer - θ_inner averaged (int8 by default), weighted by tokens; the outer
   Nesterov step. Without one (plan_without_group): fetch the swarm's result, wait for it,
   matchmake again, or, when no live peer works on this step, apply our own Δ.
4. finish_step: eval loss, the state's hash, one `outer_step` event, publish the state.
3 and 4 (and fetching, matchmaking, the facts the plans read) are StepEnd's (step_end.py).

--overlap eager|delayed (issue 14): once a step's group has formed, 3 and 4 run in the background
while the next step's inner steps already train (DiLoCo.begin_overlap: from θ_outer moved by our
own Δ, or from where the step ended). With --overlap-matchmaking, once its inner steps are done
and the swarm is together (plan.swarm_together: our last group held every live server), the rest
of 2 (the wait for slower peers, the matchmaking still under way) does too; until the group
forms, our record still says the step with its inner steps done (`_unmatched`), as a blocking
node waiting in matchmaking would, so peers plan and matchmake with us as before. The average
(or our own Δ, when no group forms and the plan says so) lands between two inner steps
(UserSteps.call) with the same θ_outer(t+1) as a blocking member's, and the next matchmaking
waits for it. One step is in flight at most: a node whose next inner steps end first trains on
past H until it lands (_train_until_landed). With --overlap-matchmaking a node faster than the
slowest peer of its step trains on past H into the step's Δ first, while that peer should still
be training (_train_on_for_slower): the round cannot start sooner, and a next step begun early
would only train more inner steps from the proxy before the average lands. A step in flight that
ends in a fetch discards the next step's inner steps (REPLAN). A late joiner's step (no inner
steps of ours) and the last step block as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.averaging.averager import Averager
from swarm.averaging.matchmaking.matchmaker import Matchmade
from swarm.node.plan import (
    FETCH,
    JOIN_FORMING,
    matchmaking_start,
    peers_still_behind,
    plan_step,
    steps_for_slower,
    swarm_together,
)
from swarm.node.progress import ProgressBook
from swarm.node.step_end import RESULT_POLL, StepEnd
from swarm.state.keeper import StateKeeper

if TYPE_CHECKING:
    from swarm.node.permits import InnerProgress

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often the loop looks at the trainer's progress
FINAL_STRETCH = 3.0  # seconds before matchmaking in which peers' progress is read often
FINAL_REFRESH_SECONDS = 0.5
LATE_GATHER = 0.3  # seconds a node joining an already gathering group waits for it


class Replan:
    """A step ended before it had a group to finish with (a fetch, a plan to fetch): plan again."""


REPLAN = Replan()


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


class OuterStepLoop(StepEnd):
    """The outer-step loop of a SwarmNode (see the module docstring): `_train` runs the steps
    (with --overlap, the end of each in the background while the next trains), `_linger` serves
    our state to late peers at the end. How a step ends: StepEnd (step_end.py)."""

    async def _train(self, averager: Averager, keeper: StateKeeper, book: ProgressBook, stop: asyncio.Event) -> str:
        in_flight: asyncio.Future[bool] | None = None  # --overlap: the last step's end, landing meanwhile
        try:
            while True:
                if stop.is_set():
                    return "stopped"
                if in_flight is not None:  # train the next step at once; matchmake once the last has landed
                    step, after, in_flight = self.diloco.working_step, in_flight, None  # after: settled in there
                    found = await self._train_and_matchmake(averager, book, step, self.config.inner_steps, stop,
                                                            after=after)  # fmt: skip
                else:
                    if not self._steps_left():
                        break
                    step, found = await self._plan_and_train(averager, keeper, book, stop)
                if found is None:
                    return "stopped"
                if found is REPLAN:  # the round in flight ended in a fetch: the next step is planned afresh
                    continue
                if isinstance(found, Unmatched):
                    progress = self.inner.snapshot()  # step's own, before round step+1's steps begin
                    if not found.formed:  # our record says this step until its group forms
                        self._unmatched = (step, progress.inner_done, progress.target)
                    await self.inner.call(functools.partial(self.diloco.begin_overlap,
                                                            eager=self.config.overlap == "eager"))  # fmt: skip
                    in_flight = asyncio.ensure_future(self._finish_unmatched(averager, keeper, book, step, found,
                                                                             stop, progress))  # fmt: skip
                    continue
                await self._finish_step(averager, keeper, book, step, found, stop)
            await self._publish(book)  # our last record says we are done: nobody lingers for us
            await self._linger(book, stop)
            return "finished"
        finally:
            if in_flight is not None:  # stopped while it lands: the group counts on our part of it
                await self._settle(in_flight)

    async def _plan_and_train(
        self, averager: Averager, keeper: StateKeeper, book: ProgressBook, stop: asyncio.Event
    ) -> tuple[int, Matchmade | Replan | None]:
        """One step as plan_step says: (the step, its group; REPLAN to plan again; None: stopped)."""
        config, diloco = self.config, self.diloco
        if self._last_group > 0:  # after our first step here: fell behind? missed a group?
            await self._fetch(keeper, book, alone=self._last_group == 1)
        step = diloco.outer_step
        if not self._steps_left():
            return step, REPLAN
        await book.refresh()
        plan = plan_step(self._facts(book))
        self._late = False
        if plan.action == FETCH:
            if not await self._fetch(keeper, book, alone=False):
                with contextlib.suppress(asyncio.TimeoutError):  # look again soon, unless stopped
                    await asyncio.wait_for(stop.wait(), RESULT_POLL)
            return step, REPLAN
        if plan.action == JOIN_FORMING:
            logger.info("step %d: %s: joining with no inner steps of ours", step, plan.why)
            self.inner.start_step(0)
            return step, await self._matchmake(averager, book, step, weight=0.0, gather=LATE_GATHER, joining=True)
        if plan.inner_steps < config.inner_steps:
            logger.info("step %d: %s: %d of %d inner steps", step, plan.why, plan.inner_steps, config.inner_steps)
        return step, await self._train_and_matchmake(averager, book, step, plan.inner_steps, stop)

    def _steps_left(self) -> bool:
        if self._run_over:
            return False
        return self.config.max_outer_steps is None or self.diloco.outer_step < self.config.max_outer_steps

    def _overlaps(self, step: int) -> bool:
        """--overlap: this step may end in the background while the next one trains. Not a step we
        trained nothing of (a late joiner's), nor the last (nothing left to train). It does once
        its group has formed; with --overlap-matchmaking from the end of its inner steps, when the
        swarm is together (plan.swarm_together; while nodes straggle in, their groups form first)."""
        return self.config.overlap != "none" and self.diloco.inner_done > 0 and not self._last_step(step)

    async def _finish_unmatched(
        self,
        averager: Averager,
        keeper: StateKeeper,
        book: ProgressBook,
        step: int,
        unmatched: Unmatched,
        stop: asyncio.Event,
        progress: InnerProgress,
    ) -> bool:
        """The end of a step (Unmatched) in the background: its matchmaking's result, or (not begun)
        the wait for slower peers and a matchmaking, then _finish_step. False when stopped first."""
        try:
            if unmatched.matchmaking is not None:
                found: Matchmade | None = await unmatched.matchmaking
            else:
                found = await self._matchmake_after_peers(averager, book, step, unmatched.weight, stop)
            if found is None:
                return False
            return await self._finish_step(averager, keeper, book, step, found, stop, progress)
        finally:
            self._unmatched = None

    async def _settle(self, in_flight: asyncio.Future[bool]) -> None:
        """Wait for a round in flight to end (its own timeouts bound it); a failure is logged."""
        try:
            await asyncio.wait({in_flight})
        except asyncio.CancelledError:
            in_flight.cancel()
            raise
        if not in_flight.cancelled() and in_flight.exception() is not None:
            logger.error("the round in flight failed", exc_info=in_flight.exception())

    async def _linger(self, book: ProgressBook, stop: asyncio.Event) -> None:
        """Done: serve our state a while longer to the live peers still on an earlier step
        (plan.peers_still_behind), at most max_wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.max_wait
        while not stop.is_set() and loop.time() < deadline:
            await book.refresh()
            behind = peers_still_behind(self._facts(book))
            if not behind:
                return
            logger.info("finished; serving our state to %d peer(s) still behind", len(behind))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), RESULT_POLL)

    async def _train_and_matchmake(
        self,
        averager: Averager,
        book: ProgressBook,
        step: int,
        target: int,
        stop: asyncio.Event,
        *,
        after: asyncio.Future[bool] | None = None,
    ) -> Matchmade | Unmatched | Replan | None:
        """Train `target` inner steps; start matchmaking while the last ones run (module
        docstring, 2). None when stopped; Unmatched with --overlap (the group may still be
        forming). `after`: the last step in flight (--overlap): matchmaking waits for it to land;
        REPLAN when it did not (a fetch replaced the state)."""
        self.inner.start_step(target)
        weight = float(target * self.config.batch_size * self.config.seq_len)  # tokens this step
        training = asyncio.ensure_future(self.inner.train(target))
        stopping = asyncio.ensure_future(stop.wait())
        matchmaking: asyncio.Future[Matchmade] | None = None
        timed, last_event, last_refresh = False, 0.0, 0.0
        try:
            # the permits first (train runs up to its first await): the record's store takes
            # round trips on a busy link, which the trainer must not wait for
            await asyncio.sleep(0)
            await self._publish(book)
            # a stop ends the step at once unless matchmaking has begun: then the group may count
            # on us, and we finish the inner steps and the round ("finishes the round under way")
            while not training.done() and not (stopping.done() and matchmaking is None):
                waits = {training} if stopping.done() else {training, stopping}
                if after is not None and not after.done():
                    waits.add(after)
                await asyncio.wait(waits, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                if after is not None and after.done():
                    if not after.result():  # raises what the round raised
                        return await self._replan(training, stop)
                    after = None  # landed: this is now the step we hold
                    await self._publish(book)
                now = time.time()
                if not timed and self.inner.snapshot().inner_done > 0:  # peers learn our pace at once
                    timed = True
                    await self._publish(book)
                left = self.inner.seconds_left()
                if (matchmaking is None and after is None and not stopping.done()
                        and left <= self.config.matchmaking_time + FINAL_STRETCH):  # fmt: skip
                    if now - last_refresh >= FINAL_REFRESH_SECONDS:  # a late peer's record must not be missed
                        last_refresh = now
                        await book.refresh()
                    start = matchmaking_start(self._facts(book), now + left, self.config.matchmaking_time,
                                              self.config.max_wait)  # fmt: skip
                    if now >= start:
                        matchmaking = asyncio.ensure_future(self._matchmake(averager, book, step, weight))
                if now - last_event >= 2.0:
                    last_event = now
                    self.events.progress(step, self.inner.snapshot(), self.config.inner_steps)
            if stopping.done() and matchmaking is None:
                self.inner.finish()  # the node closes the steps at exit, once a round in flight has landed
                await asyncio.gather(training, return_exceptions=True)
                return None
            training.result()  # raises NodeError on divergence
            if after is not None:  # trained before the last round landed: train on until it does
                await self._train_until_landed(after, stopping)
                if not after.done():
                    return None
                if not after.result():
                    return await self._replan(training, stop)
                after = None
            overlaps = self._overlaps(step)
            last_group = self._last_group or self._started_with  # before our first step: who started with us
            if overlaps and self.config.overlap_matchmaking and swarm_together(self._facts(book), last_group):
                await self._train_on_for_slower(book, stopping)
                # the matchmaking is the caller's now (not cancelled below); our record is
                # published as the next step trains
                handed, matchmaking = matchmaking, None
                return Unmatched(handed, weight)
            await self._publish(book)
            if matchmaking is None:  # nobody told us to start yet: wait for slower peers, bounded
                await self._wait_for_peers(book, stop)
                if stop.is_set():
                    return None
                matchmaking = asyncio.ensure_future(self._matchmake(averager, book, step, weight))
            found = await matchmaking
            if overlaps and found.group is not None:  # formed: its round runs while the next step trains
                return Unmatched(matchmaking, weight)
            return found
        except BaseException:  # the training failed (a divergence, a rank of the node lost): the node ends,
            # and our matchmaking must end with it, before the loop closes, not run on orphaned
            if matchmaking is not None and not matchmaking.done():
                matchmaking.cancel()
                await asyncio.wait({matchmaking})
                if not matchmaking.cancelled() and matchmaking.exception() is not None:
                    logger.debug("step %d: matchmaking ended with %r", step, matchmaking.exception())
            raise
        finally:
            stopping.cancel()
            if matchmaking is not None and not matchmaking.done() and stop.is_set():
                matchmaking.cancel()
            if after is not None and not after.done():
                await self._settle(after)

    async def _train_until_landed(self, after: asyncio.Future[bool], stopping: asyncio.Future[bool]) -> None:
        """The step's inner steps are done before the round in flight landed: a node faster than
        the slowest of its group (whose end the round waits for) would wait here at every step.
        It trains on instead, one inner step at a time, until the round lands (then, or at a
        stop, the wait ends; at most H more). The extra steps go into this step's Δ, weighted
        as its H steps (no member may announce more: AveragingConfig.max_weight); the records
        still say H (peers would not believe more). Each draws its own windows and keeps the
        step's last learning rate (DiLoCo.extra_room)."""
        diloco = self.diloco
        while not after.done() and not stopping.done() and diloco.extra_room < self.config.inner_steps:
            await self._extra_inner_steps(1, after, stopping)
        await asyncio.wait({after, stopping}, return_when=asyncio.FIRST_COMPLETED)

    async def _train_on_for_slower(self, book: ProgressBook, stopping: asyncio.Future[bool]) -> None:
        """--overlap-matchmaking, our H inner steps done: the inner steps that end before the
        slowest peer of our step should finish (plan.steps_for_slower) go into this step's Δ,
        as _train_until_landed's do (weighted as H, windows of their own, the step's last
        learning rate), in one grant (no gap between them); then the records, read meanwhile,
        are asked again. Starting the next step instead would only put our inner steps further
        ahead of the average's landing."""
        while not stopping.done():
            more = steps_for_slower(self._facts(book), self.diloco.extra_room, self.config.max_wait)
            if more <= 0:
                return
            reading = asyncio.ensure_future(book.refresh())  # the records, while the steps train
            try:
                await self._extra_inner_steps(more, stopping)
            finally:
                await reading

    async def _extra_inner_steps(self, count: int, *until: asyncio.Future[bool]) -> None:
        """`count` inner steps past H (DiLoCo.extra_room). When one of `until` ends first, the
        permits left are taken back, between steps (where a landing goes): a caller's loop may
        not be stepping (swarm.join)."""
        self.diloco.extra_room += count  # before the permits: the trainer checks it in its step
        steps = asyncio.ensure_future(self.inner.train(self.diloco.inner_done + count))
        await asyncio.wait({steps, *until}, return_when=asyncio.FIRST_COMPLETED)
        if not steps.done():
            await self.inner.revoke()
        await steps

    async def _replan(self, training: asyncio.Future[None], stop: asyncio.Event) -> Replan | None:
        """The round in flight ended in a fetch: the permits left are taken back and the step is
        planned afresh from the fetched state."""
        await self.inner.revoke()
        await asyncio.gather(training, return_exceptions=True)
        return None if stop.is_set() else REPLAN
