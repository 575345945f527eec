"""StepEnd: the end of an outer step (a SwarmNode's, outer_step.py): average and apply with the
group, or take the swarm's result, matchmake again, or apply our own Δ; then eval, hash, event
and publish. Also what the loop knows of the swarm (`_facts`), matchmaking and fetching the
swarm's state. With --overlap the end of step t runs here while step t+1 trains (outer_step.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from swarm.averaging.averager import Averager, GroupReport
from swarm.averaging.errors import AllReduceError
from swarm.averaging.matchmaking.matchmaker import Matchmade
from swarm.dht.errors import DHTError
from swarm.model.checkpoint import CheckpointError
from swarm.model.compression import outgoing
from swarm.node.errors import NodeError
from swarm.node.plan import (
    APPLY_OWN,
    AWAIT_RESULT,
    END,
    FETCH,
    RECHECK,
    Facts,
    expected_peers,
    matchmaking_start,
    median_pace,
    plan_without_group,
    servers_behind,
)  # fmt: skip
from swarm.node.progress import ProgressBook, implausible
from swarm.p2p.errors import P2PError
from swarm.p2p.peer_id import PeerID
from swarm.state.fetcher import FetchError
from swarm.state.keeper import StateKeeper
from swarm.state.trust import step_horizon
from swarm.utils.process_memory import resident_bytes

if TYPE_CHECKING:
    from swarm.model.compression_spec import CompressionSpec
    from swarm.model.diloco import DiLoCo
    from swarm.model.error_feedback import ErrorFeedback
    from swarm.node.config import NodeConfig
    from swarm.node.events import EventSink
    from swarm.node.permits import InnerProgress, UserSteps
    from swarm.state.lineage_book import LineageBook
    from swarm.utils.log_once import OncePerPeer, RateLimitedLog

logger = logging.getLogger(__name__)

RESULT_POLL = 0.5  # seconds between looks for a step's result while waiting for it
# a group of our step formed without us: its result is seconds away, and the sooner we hold it
# the more of the next step we train with the others (bounded by max_wait: a few lookups a second)
AWAIT_POLL = 0.15
WAIT_RECHECK_S = 1.0  # seconds between readings of the peers' records while waiting for slower ones
# our last rounds whose steps' ready sets we check for a larger group beside ours (a fork) before
# each matchmaking: a faster smaller lineage is a step or two ahead of the larger one's markers
LINEAGE_STEPS = 3


class StepEnd:
    """How an outer step ends (the module docstring): `_finish_step`, `_average`, `_stepped`,
    `_fetch`, and the facts and matchmaking they share with the loop (OuterStepLoop, a subclass).

    A mixin of SwarmNode, which owns the state below: its model and permits, its config and
    events, and what it knows of the swarm (the state it holds, when it last knew the swarm's
    step, its last group); the node also publishes its progress record (`_publish`)."""

    # SwarmNode's state, read and written here (set in SwarmNode.__init__)
    config: NodeConfig
    diloco: DiLoCo
    inner: UserSteps
    events: EventSink
    client_mode: bool
    _settings_digest: bytes
    _evaluate: Callable[[], float] | None
    _state_sha: bytes  # of the state we hold: what we announce in matchmaking
    _late: bool  # the first step after joining or fetching
    # --overlap: (step, inner steps, target) of a step whose group is still forming while the
    # next trains: what our record says meanwhile (outer_step.py)
    _unmatched: tuple[int, int, int] | None
    _tokens: int
    _last_eval: float | None
    _eval_s: float  # seconds spent in evals (the eval loss), all steps
    _last_group: int  # size of our last group; 0: no outer step done here yet
    _rounds: deque[tuple[int, bytes]]  # (step, group id) of our last rounds since our state's lineage began
    _outvoted_since: float | None  # loop time our lineage was first found outvoted (no fetch since)
    _run_over: bool  # the run's last step was taken without us and its result is gone (plan.END)
    # --start-with: the nodes that started the run with us, our "last group" before our first
    # step (0: none, or a fetch since: the run went on without that start)
    _started_with: int
    _started: float
    _known_at: tuple[int, float] | None  # (the swarm's step, when we knew it)
    _bad_records: OncePerPeer
    _fetch_failures: RateLimitedLog
    _publish: Callable[[ProgressBook], Awaitable[None]]  # our progress record (node.py)
    _pace_seen: float
    _feedback: ErrorFeedback | None  # --error-feedback: the codec's residual (model/error_feedback.py)
    _compression: CompressionSpec  # --compression CODEC[:DENSITY] (model/compression.py)
    _block_size: int
    _lineage: LineageBook | None  # our lineage while the node runs (node.py)

    def _facts(self, book: ProgressBook) -> Facts:
        pace, now = self.inner.snapshot().sec_per_step, time.time()
        horizon = self._horizon(book)
        peers = []
        for p in book.peers:  # records the run cannot produce are not believed (progress.implausible)
            why = implausible(p, now=now, inner_steps=self.config.inner_steps, max_step=horizon)
            if why is None and p.settings_digest not in (None, self._settings_digest):
                why = "it trains with other run settings (never grouped with: not waited for)"
            if why is None:
                peers.append(p)
            else:
                self._bad_records.log(p.peer_id, "progress", "ignoring its progress record: %s", why)
        return Facts(step=self.diloco.outer_step, inner_steps=self.config.inner_steps, own_sec=pace,
                     client=self.client_mode, peers=tuple(peers), now=now, fresh_for=book.fresh_for,
                     late=self._late, watched_for=now - book.first_read, sees_peers=book.read_ok)  # fmt: skip

    def _horizon(self, book: ProgressBook) -> int | None:
        """The highest outer step the run can have reached by now (trust.step_horizon), from the
        swarm's step we last knew (a fetch, a step with a group), at our pace or the peers'
        median, whichever is faster (a slow node among fast ones must still follow them). None
        before we know any."""
        own = self.inner.snapshot().sec_per_step
        paces = [s for s in (own, median_pace(list(book.peers))) if s > 0]
        if paces:  # remembered: a newcomer whose peers all left still knows how fast the run went
            self._pace_seen = min(paces)
        if self._known_at is None:
            return None
        step, since = self._known_at
        return step_horizon(step, time.time() - since, self._pace_seen, self.config.inner_steps)

    async def _wait_for_peers(self, book: ProgressBook, stop: asyncio.Event) -> None:
        """Until the slowest live peer of our step should be done (bounded by max_wait from when
        we started waiting), or stop. The peers' records are read again every WAIT_RECHECK_S: a
        pace first measured slow (a caller's loop that started late) predicts a finish that its
        next record moves earlier, and peers that finished early must not form their group
        while we sleep out the first prediction."""
        started, logged = time.time(), False
        while not stop.is_set():
            await book.refresh()
            now = time.time()
            start = matchmaking_start(self._facts(book), now, self.config.matchmaking_time, self.config.max_wait)
            delay = min(start, started + self.config.max_wait) - now
            if delay <= 0:
                return
            if not logged:
                logger.info("waiting up to %.1fs for slower peers of step %d", delay, self.diloco.outer_step)
                logged = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(delay, WAIT_RECHECK_S))

    async def _matchmake_after_peers(self, averager: Averager, book: ProgressBook, step: int, weight: float,
                                     stop: asyncio.Event) -> Matchmade | None:  # fmt: skip
        """_wait_for_peers, then _matchmake; None when stopped meanwhile."""
        await self._wait_for_peers(book, stop)
        return None if stop.is_set() else await self._matchmake(averager, book, step, weight)

    async def _matchmake(self, averager: Averager, book: ProgressBook, step: int, weight: float, *,
                         gather: float | None = None, joining: bool = False) -> Matchmade:  # fmt: skip
        facts = self._facts(book)
        expected = frozenset() if joining else expected_peers(facts, time.time(), self.config.max_wait)
        try:
            if not joining and await self._outvoted(averager, step):
                return Matchmade(None, 0.0, outvoted=True)
            voters = self._lineage.lineage.voters() if self._lineage is not None else None
            return await averager.form_group(weight, step, self._state_sha, gather=gather, expected=expected,
                                             as_client=joining, voters=voters)  # fmt: skip
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("matchmaking for step %d failed: %s", step, e)
            return Matchmade(None, 0.0)

    async def _outvoted(self, averager: Averager, step: int) -> bool:
        """Is our state a fork's smaller lineage? A larger group formed beside one of our last
        rounds (ready.outvoted): then we fetch the swarm's state instead of matchmaking with ours,
        waiting for the larger lineage to reach our step when it is behind. Not for longer than
        max_wait: live identities that renew FORMED markers of a fake larger group, and serve no
        state, must not stop us for good (as distrust_formed bounds a fake marker of our state)."""
        for earlier, group_id in reversed(self._rounds):
            if earlier < step and await averager.outvoted(earlier, group_id):
                now = asyncio.get_running_loop().time()
                if self._outvoted_since is None:
                    self._outvoted_since = now
                if now - self._outvoted_since < self.config.max_wait:
                    return True
                logger.warning("step %d: the larger lineage's state did not come in %.0fs: going on with ours",
                               step, self.config.max_wait)  # fmt: skip
                self._rounds.clear()
                break
        self._outvoted_since = None
        return False

    async def _finish_step(
        self,
        averager: Averager,
        keeper: StateKeeper,
        book: ProgressBook,
        step: int,
        found: Matchmade,
        stop: asyncio.Event,
        progress: InnerProgress | None = None,
    ) -> bool:
        """The end of outer step `step`, whatever happened: average and apply with the group, or
        (plan_without_group) take the swarm's result, matchmake again, or apply our own Δ. True
        when the step was applied to what we hold, False after a fetch or a stop. `progress`: the
        step's inner steps, when the next step's already run (--overlap)."""
        diloco, loop = self.diloco, asyncio.get_running_loop()
        without_group_since: float | None = None
        late = False  # a group of our state formed without us at this step: its result exists
        late_by: frozenset[PeerID] = frozenset()  # whose FORMED markers said so
        groupless_since: float | None = None  # our first matchmaking of this step that found no group
        late_confirmed = False  # the last step: a RECHECK found the group that formed without us standing
        while diloco.outer_step == step:
            if found.group is not None:  # stopping or not: the group counts on our part
                if self._unmatched is not None:  # the round is under way: our record says the next step
                    self._unmatched = None  # at once: peers there expect us (we train it already)
                    # stored beside the round: the round must not wait for the DHT's round trips
                    # (every member's late start is the whole group's, and the landing's)
                    report, _ = await asyncio.gather(self._average(averager, keeper, found), self._publish(book))
                else:
                    report = await self._average(averager, keeper, found)
                if report is not None:
                    await self._stepped(keeper, step, report, progress)
                    return True
                averager.round_failed(step)
                found = Matchmade(None, found.seconds)
                if progress is not None and self._unmatched is None:
                    # overlapped: our record has said the next step since the group formed. Its
                    # members' rounds failed too, and they must find us at this step again (done
                    # training it), or each would read the others as past it and step alone
                    self._unmatched = (step, progress.inner_done, progress.target)
                    await self._publish(book)
            if stop.is_set():
                return False
            if without_group_since is None:
                without_group_since = loop.time()
            late, late_by = late or found.late, late_by | found.late_by
            if groupless_since is None:
                groupless_since = without_group_since
            await book.refresh()
            waited, groupless_for = loop.time() - without_group_since, loop.time() - groupless_since
            plan = plan_without_group(self._facts(book), late=late, other_state=found.other_state, waited=waited,
                                      max_wait=self.config.max_wait, ready_peers=found.peers,
                                      groupless_for=groupless_for, last=self._last_step(step),
                                      late_confirmed=late_confirmed)  # fmt: skip
            if plan.action == END:
                logger.warning("step %d: %s", step, plan.why)
                self._run_over = True
                return False
            if plan.action == APPLY_OWN:
                await self.inner.call(diloco.apply_own)
                await self._stepped(keeper, step, GroupReport(None, matchmaking_s=found.seconds), progress)
                return True
            if plan.action == FETCH:
                logger.info("step %d: %s: fetching the swarm's state", step, plan.why)
                if await self._fetch(keeper, book, alone=False, other_state=found.other_state, missed=late):
                    self._late = True  # the peers are already training on it
                    return False
                found = Matchmade(None, found.seconds)  # nothing to fetch yet: look again
                await asyncio.sleep(RESULT_POLL)
            elif plan.action == AWAIT_RESULT:  # the holders may show the result before the records do
                if await self._fetch(keeper, book, alone=False, missed=late):
                    self._late = True
                    return False
                await asyncio.sleep(AWAIT_POLL)
            else:  # RETRY, RECHECK
                if plan.action == RECHECK:  # trusting the markers still (plan_without_group)
                    logger.info("step %d: %s", step, plan.why)
                    again = await self._matchmake(averager, book, step, float(diloco.round_tokens))
                    late, late_by, late_confirmed = again.late, again.late_by, again.late
                    found = again
                    without_group_since = None if found.group is not None else loop.time()
                    continue
                if late and late_by and loop.time() - without_group_since >= self.config.max_wait:
                    # we waited max_wait for the result of their group: none came. Believing
                    # their markers again would keep us (and anyone they fool) waiting forever
                    averager.distrust_formed(late_by)
                    late, late_by = False, frozenset()
                logger.info(
                    "step %d: %s%s",
                    step,
                    plan.why,
                    " (the step's result was computed without us; its holders may have left)" if late else "",
                )
                await asyncio.sleep(RESULT_POLL)
                again = await self._matchmake_after_peers(averager, book, step, float(diloco.round_tokens), stop)
                if again is None:
                    return False
                found = again
                without_group_since = None if found.group is not None else loop.time()

    def _last_step(self, step: int) -> bool:
        """Is `step` the run's last (--max-outer-steps)?"""
        return self.config.max_outer_steps is not None and step + 1 >= self.config.max_outer_steps

    async def _average(self, averager: Averager, keeper: StateKeeper, found: Matchmade) -> GroupReport | None:
        diloco, feedback = self.diloco, self._feedback
        step, base = diloco.outer_step, self._state_sha.hex()  # the state the group averaged from
        # an overlapped step's Δ is set aside (begin_overlap) and read as it is; otherwise the
        # inner steps must be between two steps (the round would wait for the one under way)
        deltas = diloco.round_deltas() if diloco.pending is not None else await self.inner.call(diloco.round_deltas)
        # what this step sends: the residual of earlier steps with it (error feedback), only the
        # step's chosen blocks with a density below 1 (beside: the inner steps go on meanwhile)
        payload = await self.inner.beside(outgoing, deltas, self._compression, feedback, self.config.run_id,
                                        diloco.outer_step, self._block_size)  # fmt: skip
        try:
            averaged, report = await averager.run_round(found.group, payload.tensors, found.seconds)
        except AllReduceError as e:
            logger.warning("all-reduce of step %d failed: %s", diloco.outer_step, e)
            return None
        update = await self.inner.beside(payload.unpack, averaged)  # tensor work, off the loop: reads no θ_inner
        try:
            await self.inner.call(diloco.apply_outer, update)
        except ValueError as e:  # a non-finite average (never from a robust round): θ_outer stays
            logger.error("step %d: refusing the group's average, as if the round failed: %s", diloco.outer_step, e)
            return None
        # a node that missed this group can take the step from it (state/update.py) before we advertise it
        keeper.record_update(step, base, update, self._compression.codec, self._block_size)
        if feedback is not None and payload.compensated is not None:
            feedback.commit(payload.compensated)
        return report

    async def _stepped(self, keeper: StateKeeper, step: int, report: GroupReport,
                       progress: InnerProgress | None = None) -> None:  # fmt: skip
        """After the outer step is applied: eval (of θ_outer), hash, event, publish."""
        diloco, config = self.diloco, self.config
        last = config.max_outer_steps is not None and diloco.outer_step >= config.max_outer_steps
        evaluate = last or diloco.outer_step % config.eval_every == 0
        if evaluate and self._evaluate is not None:
            began = time.perf_counter()
            self._last_eval = float(await self.inner.call(diloco.on_outer_weights, self._evaluate))
            self._eval_s += time.perf_counter() - began
        sha = await self.inner.beside(diloco.state_sha256)
        parent, self._state_sha = self._state_sha, bytes.fromhex(sha)
        overlapped = progress is not None  # the next step's inner steps ran while this one's round did
        progress = progress or self.inner.snapshot()
        if self._lineage is not None:  # the receipt of the round (or of our Δ alone) that made this state
            group = report.group
            if group is not None:
                members = [(m.peer_id, m.weight) for m in group.members]
                self._lineage.record_round(step, group.group_id, members, parent, self._state_sha)
            else:
                weight = float(progress.inner_done * config.batch_size * config.seq_len)
                self._lineage.record_alone(step, weight, parent, self._state_sha)
        self._tokens += progress.inner_done * config.batch_size * config.seq_len
        self._last_group = len(report.members) if report.group_id is not None else 1
        if report.group_id is not None:  # in sync with a group: the swarm was at this step now
            self._rounds.append((step, bytes.fromhex(report.group_id)))
            self._known_at = (diloco.outer_step, time.time())
        wall_s = asyncio.get_running_loop().time() - self._started
        self.events.emit("outer_step", outer_step=step,
                         train_loss=sum(progress.losses) / len(progress.losses) if progress.losses else None,
                         eval_loss=self._last_eval if evaluate else None, state_sha256=sha,
                         group_size=self._last_group, group_id=report.group_id, bytes_sent=report.bytes_sent,
                         bytes_received=report.bytes_received, matchmaking_s=round(report.matchmaking_s, 4),
                         round_s=round(report.reduce_s + report.gather_s, 4), inner_done=progress.inner_done,
                         clipped=sum(len(members) for members in report.clipped.values()),
                         inner_s=round(progress.inner_s, 4), wall_s=round(wall_s, 4), eval_s=round(self._eval_s, 4),
                         tokens=self._tokens,
                         inner_ahead=diloco.inner_done if overlapped else 0,
                         tokens_per_s=round(self._tokens / wall_s, 1) if wall_s > 0 else 0.0,
                         rss_bytes=resident_bytes())  # fmt: skip
        await keeper.publish(diloco, local=self._feedback.state_dict if self._feedback is not None else None)

    async def _fetch(
        self, keeper: StateKeeper, book: ProgressBook, *, alone: bool, other_state: bool = False, missed: bool = False
    ) -> bool:
        """Fetch the swarm's state when we should (swarm/state/keeper.py); True after a fetch.
        `missed`: a group of our state formed at this step without us (trust.Known.missed)."""
        diloco = self.diloco
        try:
            fetched = await keeper.catch_up(diloco, alone_last_step=alone, servers_behind=servers_behind(
                self._facts(book)), other_state=other_state, horizon=self._horizon(book), missed=missed)  # fmt: skip
        except CheckpointError as e:  # IncompatibleState: the run's state is not for this node
            raise NodeError(f"cannot use the run's state: {e}") from None
        except FetchError as e:
            self._fetch_failures.log("fetch", "could not fetch the swarm's state: %s", e)
            return False
        if fetched is None:
            return False
        if self._feedback is not None:  # its residual is of a state we no longer hold
            self._feedback.reset()
        self._rounds.clear()  # another lineage's state: our rounds no longer say where it comes from
        self._outvoted_since = None
        self._late, self._started_with = True, 0
        self._known_at = (diloco.outer_step, time.time())
        sha = await self.inner.beside(diloco.state_sha256)
        self._state_sha = bytes.fromhex(sha)
        self.events.fetched(diloco.outer_step, *fetched, sha)
        return True
