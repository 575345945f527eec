"""Matchmaking: the nodes ready for outer step N of a run form groups through the DHT.

1. Announce: each node stores its MemberInfo under `<run>/ready/<N>`, in a subkey owned (signed)
   by its PeerID, then gathers for `matchmaking_time`.
2. Split: each node reads the ready set and splits it with `split_into_groups` (a hash of step
   and PeerID orders it, so nodes that see the same set compute the same groups, and groups mix
   across steps). A group's leader is its first member that accepts inbound connections.
3. Join: every member calls `avg.join` on its leader. The leader holds each call open until it
   has heard from every member it expects (or `request_timeout` passed), then answers all of
   them with the same GroupInfo: members, their order and the group id. A node joins one leader
   at a time and leads only when it joined nobody, so no node ends up in two groups.
4. Failures: a node whose view differs is redirected to the leader its callee joined; a dead or
   silent leader is left out and the group is split again without it, until the matchmaking
   window closes. A node that finds no group (too late, too few) gets None and goes on alone;
   nothing waits on any particular peer (DESIGN invariant 1).
5. Done: a node whose group is formed (or that went alone) overwrites its announcement with
   FORMED, so that a node arriving later at that step neither counts it nor waits for its join.

Client-mode nodes take part the same way; they only never lead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.partition import split_into_groups
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_of, owner_subkey
from swarm.dht.run_keys import ready_key
from swarm.p2p.connection import CallContext
from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

JOIN = "avg.join"
MAX_JOINERS = 256
FORMED = "formed"  # replaces a ready announcement once its node is done with matchmaking


@dataclass
class _StepState:
    me: MemberInfo
    leading: bool = False
    leader: MemberInfo | None = None  # whom we joined, when not leading
    joiners: dict[PeerID, MemberInfo] = field(default_factory=dict)
    expected: set[PeerID] = field(default_factory=set)
    result: asyncio.Future[GroupInfo | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    role_known: asyncio.Event = field(default_factory=asyncio.Event)  # leading, or joined a leader
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # a joiner arrived (the leader waits on it)


class Matchmaker:
    def __init__(self, dht: DHTNode, host: P2PHost, run_id: str, config: AveragingConfig) -> None:
        self.dht, self.host, self.run_id, self.config = dht, host, run_id, config
        self.peer_id = host.peer_id
        self._steps: dict[int, _StepState] = {}
        self._withdrawals: set[asyncio.Task[None]] = set()
        if not config.client_mode:
            host.add_handler(JOIN, self._rpc_join)

    def close(self) -> None:
        if not self.config.client_mode:
            self.host.remove_handler(JOIN)
        for state in self._steps.values():
            if not state.result.done():
                state.result.set_result(None)
        for task in self._withdrawals:
            task.cancel()

    async def form_group(self, step: int, me: MemberInfo, gather: float | None = None) -> GroupInfo | None:
        """Announce, gather, and return the agreed group for this step, or None. `gather`
        (default matchmaking_time) is shorter for a node joining peers already gathering."""
        config = self.config
        loop = asyncio.get_running_loop()
        state = self._steps[step] = _StepState(me)
        announced: float | None = None
        try:
            gather_until = loop.time() + (config.matchmaking_time if gather is None else gather)
            give_up_at = gather_until + 3 * config.request_timeout
            expiration = time.time() + config.matchmaking_time + 4 * config.request_timeout
            try:
                await self.dht.store(ready_key(self.run_id, step), me.encode(), expiration, owner_subkey(me.peer_id))
                announced = expiration
            except (P2PError, DHTError, TimeoutError) as e:  # unseen by others; we may still join them
                logger.warning("could not announce readiness for step %d: %s", step, e)
            await asyncio.sleep(max(0.0, gather_until - loop.time()))
            dead: set[PeerID] = set()
            while loop.time() < give_up_at:
                ready = await self._ready_set(step)
                ready[me.peer_id] = me
                for peer in dead:
                    ready.pop(peer, None)
                group = self._my_group(ready, step)
                leader = next((m for m in group if not m.client), None)
                if leader is None:
                    return None
                if leader.peer_id == self.peer_id:
                    return await self._lead(state, group, step, give_up_at)
                outcome = await self._join(state, leader, step, give_up_at)
                if isinstance(outcome, GroupInfo) or outcome is None:
                    return outcome
                dead.add(outcome)  # the leader failed: split again without it
                state.leader = None
                state.role_known.clear()
            return None
        finally:
            if not state.result.done():
                state.result.set_result(None)
            state.role_known.set()
            self._steps.pop(step, None)
            if announced is not None:
                task = asyncio.ensure_future(self._withdraw(step, announced))
                self._withdrawals.add(task)
                task.add_done_callback(self._withdrawals.discard)

    async def _withdraw(self, step: int, announced: float) -> None:
        """Replace our ready announcement with FORMED (a later expiration wins in the DHT)."""
        try:
            await self.dht.store(ready_key(self.run_id, step), FORMED, announced + 0.001, owner_subkey(self.peer_id))
        except (P2PError, DHTError, TimeoutError) as e:  # late nodes wait for us once, as before
            logger.info("could not withdraw our ready announcement for step %d: %s", step, e)

    async def _ready_set(self, step: int) -> dict[PeerID, MemberInfo]:
        ready: dict[PeerID, MemberInfo] = {}
        try:
            found = await self.dht.get(ready_key(self.run_id, step), latest=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("could not read who is ready for step %d: %s", step, e)
            return ready
        if found is None or not isinstance(found.value, dict):
            return ready
        for subkey, entry in found.value.items():
            if entry.value == FORMED:
                continue
            try:
                member = MemberInfo.decode(entry.value)
                if owner_of(subkey) != member.peer_id:
                    raise BadRequest("announcement not under its owner's subkey")
            except (BadRequest, ValueError) as e:
                logger.info("ignoring a bad ready announcement for step %d: %s", step, e)
                continue
            ready[member.peer_id] = member
        return ready

    def _my_group(self, ready: dict[PeerID, MemberInfo], step: int) -> list[MemberInfo]:
        for group in split_into_groups(list(ready), self.config.target_group_size, step):
            if self.peer_id in group:
                return [ready[p] for p in group]
        raise AssertionError("a node is always in its own ready set")

    async def _lead(self, state: _StepState, group: list[MemberInfo], step: int, give_up_at: float) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        state.leading, state.leader = True, None
        state.expected = {m.peer_id for m in group if m.peer_id != self.peer_id}
        state.role_known.set()
        deadline = min(give_up_at, loop.time() + self.config.request_timeout)
        while not state.expected <= set(state.joiners) and loop.time() < deadline:
            state.joined.clear()
            try:
                await asyncio.wait_for(state.joined.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        members = [state.me, *state.joiners.values()]
        order = {m.peer_id: i for i, m in enumerate(group)}
        members.sort(key=lambda m: (order.get(m.peer_id, len(order)), m.peer_id.to_bytes()))
        result = None
        if len(members) >= self.config.min_group_size:
            result = GroupInfo.create(self.run_id, step, tuple(members))
        state.result.set_result(result)
        return result

    async def _join(
        self, state: _StepState, leader: MemberInfo, step: int, give_up_at: float
    ) -> GroupInfo | PeerID | None:
        """Join `leader` (following one redirect). Returns the group, None for "no group this
        step", or the PeerID of a leader that failed."""
        loop = asyncio.get_running_loop()
        state.leading, state.leader = False, leader
        state.role_known.set()
        for _ in range(2):
            timeout = max(0.1, give_up_at - loop.time())
            args = {"run": self.run_id, "step": step, "member": state.me.encode()}
            try:
                reply = await self.host.call(leader.address(), JOIN, args, timeout=timeout)
            except P2PError as e:
                logger.info("matchmaking leader %s failed: %s", leader.peer_id, e)
                return leader.peer_id
            if not isinstance(reply, dict):
                return leader.peer_id
            if "group" in reply:
                try:
                    group = GroupInfo.decode(reply["group"])
                    group.index_of(self.peer_id)
                except (BadRequest, KeyError) as e:
                    logger.warning("leader %s sent a group we cannot use: %s", leader.peer_id, e)
                    return leader.peer_id
                if group.run_id != self.run_id or group.step != step:
                    return leader.peer_id
                return group
            if "redirect" in reply:
                try:
                    leader = MemberInfo.decode(reply["redirect"])
                except BadRequest:
                    return leader.peer_id
                state.leader = leader
                continue
            return None
        return None

    async def _rpc_join(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict) or args.get("run") != self.run_id:
            raise BadRequest("join: wrong or missing run id")
        step = args.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise BadRequest("join: step must be an int")
        member = MemberInfo.decode(args.get("member"))
        if member.peer_id != ctx.peer_id:
            raise BadRequest("join: a node can only join for itself")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.matchmaking_time + 2 * self.config.request_timeout
        while (state := self._steps.get(step)) is not None and not state.result.done():
            if state.leading:
                if len(state.joiners) >= MAX_JOINERS:
                    return {"none": "group is full"}
                state.joiners[member.peer_id] = member
                state.joined.set()
                try:
                    group = await asyncio.wait_for(asyncio.shield(state.result), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
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
