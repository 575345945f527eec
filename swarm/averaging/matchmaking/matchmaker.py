"""Matchmaking: every node ready for outer step N of a run forms one group through the DHT.

1. Announce: each node stores its MemberInfo (with the hash of the state it starts from) under
   `<run>/ready/<N>`, in a subkey owned (signed) by its PeerID: nobody can announce for another
   node or fake its state.
2. Gather until everyone is in: the node reads the ready set every `POLL` seconds until every
   peer it expects at this step (the live peers of its step, from their progress records) has
   announced, or the window (`matchmaking_time`) closes: the window only bounds the wait for
   the missing ones.
3. Decide (matchmaking/ready.py, pure): late (a group of our state already formed), of another state (fetch
   the swarm's first), or one group of every ready member of the swarm's state, led by its first
   member in hash order that accepts connections.
4. Join: every member calls `avg.join` on the leader. The leader holds each call open until every
   member it saw has joined (or `request_timeout` passed), reads the ready set once more, and
   answers all of them with the same GroupInfo, unless a group of its state formed meanwhile or
   it gathered fewer than half of that state's announced members (then it is the late one:
   nobody gets a group). A node whose view differs is redirected to the leader its callee
   joined; a leader we cannot reach is left out and the decision is taken again without it, and
   so is a leader whose group misstates our announcement (ready.group_problem). A leader that took
   our join and did not answer in time may still hold us as a member: we are late for its group. A leader
   refuses a join whose weight exceeds the run's max_weight. A leader still missing members
   reads the ready set again every POLL: when a member that announced after it decided ranks
   first, it steps down, sends its joiners there and joins that leader too.
5. Done: a node in a group overwrites its announcement with a FORMED marker naming its state
   (a node arriving later at this step is late), a node without one with DONE (not counted).
   A node whose round then fails overwrites FORMED with DONE, so that the step can be retried.

Only peers that proved they are alive count (matchmaking/liveness.py): during the gather the node asks
each server it sees (`avg.alive`), and announcements or FORMED markers of owners that did not
answer neither vote, nor lead, nor make anyone late, nor count for a leader's majority; the
leader does not wait for members whose check failed.

Client-mode nodes take part the same way; they only never lead. A node finds no group when it
is alone, late, of another state, or the leader gave up: the caller decides what follows (the
training node fetches the swarm's state; swarm/node/plan.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Set
from typing import Any

from swarm.averaging.config import AveragingConfig
from swarm.averaging.matchmaking.joining import JOIN, JoinTimedOut, join_leader
from swarm.averaging.matchmaking.ready import (
    DONE,
    ReadyView,
    announcement,
    decide,
    formed_by,
    formed_marker,
    group_sizes,
    left_behind,
    may_finalize,
    other_groups,
    outvoted,
)
from swarm.averaging.matchmaking.ready_board import ReadyBoard
from swarm.averaging.matchmaking.step_state import Matchmade, StepState
from swarm.averaging.messages import MAX_MEMBERS, GroupInfo, MemberInfo
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import ready_key
from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)

POLL = 0.15  # seconds between reads of the ready set while peers are still missing
# seconds a DONE marker does not count as arrived: longer than a retrying node's pause between
# rounds (swarm/node/step_end.py RESULT_POLL), so that retrying nodes' windows overlap
DONE_GRACE = 1.5


class Matchmaker:
    """Forms the groups of one run's outer steps (module docstring): owns the `avg.join` handler
    (not in client mode), this node's ready announcements and markers per step, and the state of
    the step it is matchmaking. `form_group` once per step; `round_failed` when the group's round
    could not average; `close` when done."""

    def __init__(
        self, dht: DHTNode, host: P2PHost, run_id: str, config: AveragingConfig, *, excluded: Set[PeerID] = frozenset()
    ) -> None:
        self.dht, self.host, self.run_id, self.config = dht, host, run_id, config
        self.excluded = excluded  # peers the owner audit caught (the Averager's set, shared)
        self.peer_id = host.peer_id
        self._steps: dict[int, StepState] = {}
        self._stored: dict[int, float] = {}  # step -> expiration of our last record (later wins)
        self._markers: set[asyncio.Task[None]] = set()
        self._outvoted_told: set[tuple[int, bytes]] = set()  # (step, our group) found outvoted: logged once
        self._bad_input = OncePerPeer(logger)
        self.board = ReadyBoard(dht, host, run_id, config, excluded, self._bad_input)
        if not config.client_mode:
            host.add_handler(JOIN, self._rpc_join)

    def close(self) -> None:
        self.board.close()
        if not self.config.client_mode:
            self.host.remove_handler(JOIN)
        for state in self._steps.values():
            if not state.result.done():
                state.result.set_result(None)
        for task in self._markers:
            task.cancel()

    async def form_group(
        self,
        step: int,
        me: MemberInfo,
        gather: float | None = None,
        expected: frozenset[PeerID] | None = None,
        voters: frozenset[PeerID] | None = None,
        parent_round: Mapping[PeerID, float] | None = None,
        live: frozenset[PeerID] = frozenset(),
    ) -> Matchmade:
        """Announce, gather until every `expected` peer is in (at most `gather`, default
        matchmaking_time, seconds; None: not known, gather the whole window), and return what
        this step's matchmaking found. `voters`: whose vote on the swarm's state counts
        (ready.decide; None: everyone's). `parent_round`: the round that made our state (member
        -> weight), whose `live` members a group we lead must not leave behind (ready.left_behind)."""
        config = self.config
        loop = asyncio.get_running_loop()
        started = loop.time()
        state = self._steps[step] = StepState(me, voters=voters, parent_round=parent_round, live=live)
        outcome: Matchmade | None = None
        try:
            gather_until = started + (config.matchmaking_time if gather is None else gather)
            give_up_at = gather_until + 3 * config.request_timeout
            ttl = config.matchmaking_time + 4 * config.request_timeout
            announced = await self._store(step, announcement(me, self.dht.id_nonce, self.config.settings), ttl)
            if not announced:  # unseen by others; we may still join them
                logger.warning("could not announce readiness for step %d", step)
            others = None if expected is None else expected - {me.peer_id}
            view = await self._gather(step, others, gather_until, me.state, voters)
            view = await self.board.settled(step, view, expected or frozenset())
            dead: set[PeerID] = set()
            peers = 0  # the most other members of our state a decision of ours counted
            while loop.time() < give_up_at:
                for peer in dead:
                    view.ready.pop(peer, None)
                decision = decide(view, me, step, voters)
                if decision.kind in ("late", "other_state", "alone"):
                    logger.info("step %d: no group: %s", step, decision.kind.replace("_", " "))
                    late = decision.kind == "late"
                    outcome = Matchmade(None, loop.time() - started, late,
                                        decision.swarm_state if decision.kind == "other_state" else None,
                                        formed_by(view, me.state) if late else frozenset())  # fmt: skip
                    return outcome
                leader, peers = decision.leader, max(peers, len(decision.members) - 1)
                if decision.kind == "lead":
                    led = await self._lead(state, list(decision.members), step, give_up_at)
                    if not isinstance(led, MemberInfo):
                        group, late = led
                        outcome = Matchmade(group, loop.time() - started, late=late, late_by=state.late_by,
                                            peers=peers)  # fmt: skip
                        return outcome
                    leader = led  # a leader we had not seen ranks before us: we joined it instead
                assert leader is not None
                joined = await join_leader(self.host, self.run_id, self.config, self.excluded, self._bad_input,
                                           state, leader, step, give_up_at)  # fmt: skip
                if isinstance(joined, JoinTimedOut) and joined.leader not in self.board.distrusted:
                    # the leader may have made us a member of a group that goes on without our
                    # part; a second group of our state with us in it would fork the model (a
                    # member under load gave up its join after 13 s and formed a group of 3
                    # beside the leader's 14, who held it as a member): we are late for that
                    # group, and take its result (or, when none comes, matchmake again). Once:
                    # a leader whose result did not come in max_wait is distrusted, and a leader
                    # that swallows joins on purpose costs us one max_wait, not one each step
                    outcome = Matchmade(None, loop.time() - started, late=True, late_by=frozenset({joined.leader}),
                                        peers=peers)  # fmt: skip
                    return outcome
                if isinstance(joined, JoinTimedOut):  # a distrusted leader: failed, as one we cannot reach
                    joined = joined.leader
                if not isinstance(joined, PeerID):  # a group, or None: no group this step
                    outcome = Matchmade(joined, loop.time() - started, peers=peers)
                    return outcome
                dead.add(joined)  # the leader failed: decide again without it
                state.leader = None
                state.role_known.clear()
                view = await self.board.settled(step, await self.board.read(step), expected or frozenset())
            outcome = Matchmade(None, loop.time() - started, peers=peers)
            return outcome
        finally:
            if not state.result.done():
                state.result.set_result(None)
            state.role_known.set()
            self._steps.pop(step, None)
            group = outcome.group if outcome is not None else None
            marker = (
                formed_marker(me.state, group.group_id, self.dht.id_nonce, self.config.settings, me)
                if group is not None
                else DONE
            )
            self._mark(step, marker)

    async def outvoted(self, step: int, group_id: bytes, state: bytes, voters: frozenset[PeerID] | None = None) -> bool:
        """Did a larger group form at `step` than ours (`group_id`, from `state`), weighed by
        `voters` (the members of the round before it), which makes ours a fork's smaller lineage
        (ready.outvoted)? One read of the step's ready set; only when it names another group are
        its owners' liveness checks asked and waited for (a few seconds at most,
        ready_board.SETTLE): owners that do not answer do not count, as in every vote (a check
        that ran out delays the healing by a step; it never makes a fork)."""
        view = await self.board.read(step)
        if not other_groups(view, group_id):
            return False
        view = await self.board.settled(step, view, frozenset())
        larger = outvoted(view, group_id, self.peer_id, state, voters)
        if larger is not None and (step, group_id) not in self._outvoted_told:  # asked again until it heals
            if len(self._outvoted_told) > 16:
                self._outvoted_told.clear()
            self._outvoted_told.add((step, group_id))
            sizes = group_sizes(view, group_id, self.peer_id)
            logger.warning("step %d: a group of %d formed beside ours (%d): ours is the smaller lineage of a fork; "
                           "taking the swarm's state", step, sizes[larger], sizes[group_id])  # fmt: skip
        return larger is not None

    def round_failed(self, step: int) -> None:
        """Our group of `step` could not average: withdraw its FORMED marker, so that the step
        can be tried again (by us and by the nodes that waited for its result)."""
        self._mark(step, DONE)

    def _mark(self, step: int, marker: Any) -> None:
        """Replace our announcement for `step` in the background (a later expiration wins). A
        FORMED marker lives as long as its round may last: while it is there, nodes arriving
        at the step know they are late (were it to expire mid-round, two of them could form a
        second group of the same state and fork the model)."""
        if step not in self._stored:
            return
        config = self.config
        ttl = config.matchmaking_time + 4 * config.request_timeout
        if marker != DONE:
            ttl += 4 * config.part_timeout  # the longest a round waits (rounds/flat.py: each wait is bounded)

        async def store() -> None:
            if not await self._store(step, marker, ttl):
                logger.info("could not withdraw our ready announcement for step %d", step)

        task = asyncio.ensure_future(store())
        self._markers.add(task)
        task.add_done_callback(self._markers.discard)

    async def _store(self, step: int, value: Any, ttl: float) -> bool:
        expiration = max(time.time() + ttl, self._stored.get(step, 0.0) + 0.001)
        self._stored[step] = expiration
        if len(self._stored) > 16:  # keep the last steps only
            del self._stored[min(self._stored)]
        try:
            accepted = await self.dht.store(ready_key(self.run_id, step), value, expiration, owner_subkey(self.peer_id))
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("could not store our matchmaking record for step %d: %s", step, e)
            return False
        return accepted > 0

    async def _gather(self, step: int, expected: frozenset[PeerID] | None, until: float, state: bytes,
                      voters: frozenset[PeerID] | None) -> ReadyView:  # fmt: skip
        """Read the ready set until it holds every expected peer (or a group formed already that
        decides our step: one of our `state`, which makes us late, or one whose owners' vote
        counts, `voters`), or `until` passes; returns the last view. A peer marked DONE counts as
        in only after DONE_GRACE: it may be about to announce again (nodes that found no group
        retry, each on its own cadence; taking each other's DONE for "in" kept 3 nodes apart
        for minutes). A group of another state whose owners do not vote for us (the other
        lineage of a split that just healed) decides nothing here: stopping at its markers,
        the three nodes of a healed half each announced, read the other two's DONE markers of a
        moment before, and gave up alone, in turn, until those markers expired."""
        loop = asyncio.get_running_loop()
        done_counts_at = loop.time() + DONE_GRACE
        while True:
            view = await self.board.read(step)
            self.board.ask(step, view, expected or frozenset())
            arrived = view.seen() if loop.time() >= done_counts_at else view.seen() - view.done
            deciding = {p for p, s in view.formed.items() if s == state or voters is None or p in voters}
            if self.board.liveness.alive(deciding) or (expected is not None and expected <= arrived):
                return view
            if loop.time() >= until:
                return view
            await asyncio.sleep(min(POLL, max(0.0, until - loop.time())))

    async def _lead(
        self, state: StepState, group: list[MemberInfo], step: int, give_up_at: float
    ) -> tuple[GroupInfo | None, bool] | MemberInfo:
        """The group we lead (None: too few joined, or we may not finalize) and whether we found
        ourselves late (a group of our state formed elsewhere, or most of it is not with us);
        or the leader we stepped down for (_better_leader), whom our joiners are sent to."""
        loop = asyncio.get_running_loop()
        state.leading, state.leader = True, None
        # not waiting for members whose liveness check failed (they may still join in time)
        state.expected = {m.peer_id for m in group if m.peer_id != self.peer_id} - self.board.liveness.failed()
        state.role_known.set()
        deadline = min(give_up_at, loop.time() + self.config.request_timeout)
        while not state.expected <= set(state.joiners) and loop.time() < deadline:
            state.joined.clear()
            try:
                await asyncio.wait_for(state.joined.wait(), min(POLL, deadline - loop.time()))
                continue
            except asyncio.TimeoutError:
                pass
            better = await self._better_leader(step, state.me)
            if better is not None:  # step down: the joiners waiting on us are redirected to it
                logger.info("step %d: stepping down for leader %s, announced after we decided", step, better.peer_id)
                state.leading, state.leader = False, better
                waiting, state.result = state.result, loop.create_future()
                waiting.set_result(None)
                return better
        members = [state.me, *state.joiners.values()]
        order = {m.peer_id: i for i, m in enumerate(group)}
        members.sort(key=lambda m: (order.get(m.peer_id, len(order)), m.peer_id.to_bytes()))
        result, late = None, False
        if len(members) >= self.config.min_group_size:
            final_view = (await self._final_view(step, state.me, give_up_at)).with_member(state.me)
            behind = left_behind({m.peer_id for m in members}, state.parent_round, state.live | final_view.seen())
            if not may_finalize(len(members), final_view, state.me.state):
                late, state.late_by = True, formed_by(final_view, state.me.state)
                logger.info("step %d: not leading a group of %d: another formed, or we are late", step, len(members))
            elif behind:
                assert state.parent_round is not None
                logger.info("step %d: not leading a group of %d: it holds less than half of the %d members of the "
                            "round that made our state, and %d others of that round are live: waiting for them",
                            step, len(members), len(state.parent_round), len(behind))  # fmt: skip
            else:
                result = GroupInfo.create(self.run_id, step, tuple(members))
        state.result.set_result(result)
        return result, late

    async def _final_view(self, step: int, me: MemberInfo, give_up_at: float) -> ReadyView:
        """The ready set a leader finalizes on, with the liveness checks of every owner of our
        state settled first, and those that failed asked once more. An owner not (yet) proven
        alive does not count as announced (a flood that never answers must block nobody), so
        under load a leader of 3 of 8 counted a majority of the 4 it had verified while another
        leader formed a group of the other 5, and the model forked (test_matchmaking.py,
        "checks that ran out")."""
        view = await self.board.read(step)
        ours = {p for p, m in view.ready.items() if m.state == me.state}
        ours |= {p for p, s in view.formed.items() if s == me.state}
        self.board.liveness.ask_again(ours - self.board.liveness.alive(ours))
        # joiners wait for our answer until give_up_at: keep a margin for it to reach them
        until = give_up_at - min(1.0, self.config.request_timeout / 4)
        return await self.board.settled(step, view, ours, until)

    async def _better_leader(self, step: int, me: MemberInfo) -> MemberInfo | None:
        """The leader the ready set names now, when it is not us. Announcements that were not in
        our view when we decided (stored a moment after our read) can put another member first:
        it then waits for us while we wait for members that joined it (seen with 3 nodes done
        within 10 ms: two groups of one waited request_timeout, then a group of 2 formed)."""
        view = await self.board.read(step)
        self.board.ask(step, view, frozenset())
        state = self._steps.get(step)
        decision = decide(self.board.marked(view), me, step, state.voters if state is not None else None)
        return decision.leader if decision.kind == "join" else None

    async def _rpc_join(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict) or args.get("run") != self.run_id:
            raise BadRequest("join: wrong or missing run id")
        step = args.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise BadRequest("join: step must be an int")
        member = MemberInfo.decode(args.get("member"))
        if member.peer_id != ctx.peer_id:
            raise BadRequest("join: a node can only join for itself")
        if member.peer_id in self.excluded:
            return {"none": "excluded"}
        if member.weight > self.config.max_weight:
            self._bad_input.log(member.peer_id, "join", "refusing its join: weight %.4g above the run's %.4g",
                                member.weight, self.config.max_weight)  # fmt: skip
            raise BadRequest("join: weight above what the run allows one step")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.matchmaking_time + 2 * self.config.request_timeout
        while (state := self._steps.get(step)) is not None and not state.result.done():
            if state.leading:
                if member.state != state.me.state:
                    return {"none": "of another state"}
                if len(state.joiners) >= MAX_MEMBERS - 1:
                    return {"none": "group is full"}
                state.joiners[member.peer_id] = member
                state.joined.set()
                try:
                    group = await asyncio.wait_for(asyncio.shield(state.result), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                if group is None and state.leader is not None:  # we stepped down for another leader
                    return {"redirect": state.leader.encode()}
                return {"group": group.encode()} if group is not None and _has(group, member) else {"none": "no group"}
            if state.leader is not None:
                return {"redirect": state.leader.encode()}
            try:  # still gathering: wait until this node knows its role
                await asyncio.wait_for(state.role_known.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
        return {"none": "not matchmaking for this step"}


def _has(group: GroupInfo, member: MemberInfo) -> bool:
    return any(m.peer_id == member.peer_id for m in group.members)
