"""A member's side of `avg.join`: call the leader, follow one redirect, check the group it answers.

The leader's side (holding the calls open until its group is final) is Matchmaker._rpc_join.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Set
from typing import NamedTuple

from swarm.averaging.config import AveragingConfig
from swarm.averaging.matchmaking.ready import group_problem
from swarm.averaging.matchmaking.step_state import StepState
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.p2p.errors import BadRequest, P2PError, RPCTimeout
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)

JOIN = "avg.join"

__all__ = ["JOIN", "JoinTimedOut", "join_leader"]


class JoinTimedOut(NamedTuple):
    """The leader took our join and did not answer in time: it may still make us a member of its
    group. Unlike a leader we could not reach, this one is not known to have failed."""

    leader: PeerID


async def join_leader(
    host: P2PHost,
    run_id: str,
    config: AveragingConfig,
    excluded: Set[PeerID],
    bad_input: OncePerPeer,
    state: StepState,
    leader: MemberInfo,
    step: int,
    give_up_at: float,
) -> GroupInfo | PeerID | JoinTimedOut | None:
    """Join `leader` (following one redirect). Returns the group, None for "no group this
    step", the PeerID of a leader that failed, or JoinTimedOut when it may have made us a member."""
    loop = asyncio.get_running_loop()
    state.leading, state.leader = False, leader
    state.role_known.set()
    for _ in range(2):
        timeout = max(0.1, give_up_at - loop.time())
        args = {"run": run_id, "step": step, "member": state.me.encode()}
        try:
            reply = await host.call(leader.address(), JOIN, args, timeout=timeout)
        except RPCTimeout as e:
            logger.info("matchmaking leader %s did not answer our join in time: %s", leader.peer_id, e)
            return JoinTimedOut(leader.peer_id)
        except P2PError as e:
            logger.info("matchmaking leader %s failed: %s", leader.peer_id, e)
            return leader.peer_id
        if not isinstance(reply, dict):
            return leader.peer_id
        if "group" in reply:
            try:
                group = GroupInfo.decode(reply["group"])
            except BadRequest as e:
                logger.warning("leader %s sent a group we cannot use: %s", leader.peer_id, e)
                return leader.peer_id
            problem = group_problem(group, state.me, run_id, step, config.max_weight)
            if problem is not None:
                bad_input.log(leader.peer_id, "group", "refusing the group it leads: %s", problem)
                return leader.peer_id
            if any(m.peer_id in excluded for m in group.members):
                logger.warning("step %d: refusing a group that holds a peer our audits excluded", step)
                return None
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
