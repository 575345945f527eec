"""Which announced peers are alive: matchmaking counts only peers that answered us.

An announcement or a FORMED marker in the DHT says nothing about whether its owner is there: an
attacker who paid for a few costly ids (dht/id_proof.py, ~1 s each) can store announcements it
never follows. Unchecked, 16 of them of another state outvote the swarm (every honest node looks
for a state nobody serves), 16 of our state never join yet count as announced (no leader may
finalize), lead groups nobody can reach, and one FORMED marker of our state makes every node
"late", waiting for a result that never comes.

So matchmaking asks each server it sees once (`avg.alive`, one small RPC over the encrypted
connection that proves the key holder is there) and counts a peer's announcement or marker
only if it answered (ready.ReadyView.unverified: the others may still join a group, but they
neither vote, nor lead, nor count for a leader's majority, nor make anyone late). Answers are
remembered for `REMEMBER` seconds, failures for `FORGET_FAILURE` (an honest peer that was slow
once is asked again soon), and at most `MAX_PINGS` new peers are asked per step, the peers the
node expects (from their progress records) first: a flood of announcements costs each honest
node a bounded number of pings. Clients accept no connections: they cannot be asked, and never
count (they cannot lead or serve a state anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Set
from typing import Any

from swarm.averaging.messages import MemberInfo
from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

ALIVE = "avg.alive"
REMEMBER = 120.0  # seconds an answer counts
FORGET_FAILURE = 10.0  # seconds a failed ping counts (then the peer is asked again)
MAX_PINGS = 64  # new peers asked per step
MAX_ENTRIES = 4096  # peers remembered (the oldest answers are forgotten first)


class Liveness:
    """Asks announced peers whether they are alive and remembers the answers. Owns the
    `avg.alive` handler (servers only) and one ping task per peer being asked. `ask` starts
    pings (non-blocking), `settle` waits for them until a deadline, `alive` reads what is
    known; `close` cancels what is in flight."""

    def __init__(self, host: P2PHost, run_id: str, timeout: float, *, serve: bool = True) -> None:
        self.host, self.run_id, self.timeout = host, run_id, timeout
        self._answered: dict[PeerID, float] = {}  # peer -> loop time its answer stops counting
        self._failed: dict[PeerID, float] = {}  # peer -> loop time it may be asked again
        self._pending: dict[PeerID, asyncio.Task[None]] = {}
        self._asked_in_step: dict[int, int] = {}
        self._serving = serve
        if serve:
            host.add_handler(ALIVE, self._rpc_alive)

    def close(self) -> None:
        if self._serving:
            self.host.remove_handler(ALIVE)
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()

    def alive(self, peers: Iterable[PeerID]) -> frozenset[PeerID]:
        """The peers among `peers` whose answer still counts (we count ourselves)."""
        now = asyncio.get_running_loop().time()
        me = self.host.peer_id
        return frozenset(p for p in peers if p == me or self._answered.get(p, 0.0) > now)

    def ask(self, step: int, members: Iterable[MemberInfo], first: Set[PeerID] = frozenset()) -> None:
        """Start pinging the servers among `members` that we know nothing current of: every one
        in `first` (the peers we expect), at most MAX_PINGS others per step."""
        now = asyncio.get_running_loop().time()
        todo = [m for m in members
                if not m.client and m.peer_id != self.host.peer_id and m.peer_id not in self._pending
                and self._answered.get(m.peer_id, 0.0) <= now and self._failed.get(m.peer_id, 0.0) <= now]  # fmt: skip
        if len(self._asked_in_step) > 16:  # keep the last steps only
            del self._asked_in_step[min(self._asked_in_step)]
        for member in todo:
            # the peers we expect are always asked: a flood that came first must not spend their turn
            if member.peer_id not in first:
                if self._asked_in_step.get(step, 0) >= MAX_PINGS:
                    continue
                self._asked_in_step[step] = self._asked_in_step.get(step, 0) + 1
            task = asyncio.ensure_future(self._ping(member))
            self._pending[member.peer_id] = task
            task.add_done_callback(lambda _t, peer=member.peer_id: self._pending.pop(peer, None))

    def ask_again(self, peers: Set[PeerID]) -> None:
        """Forget the failed checks of `peers` (they are asked at the next `ask`): a leader about
        to finalize gives the peers of its state a second chance, since a check of ours that ran
        out during a stall of our own loop says nothing about them."""
        for peer in peers:
            self._failed.pop(peer, None)

    def failed(self) -> frozenset[PeerID]:
        """The peers whose last check failed (and is still remembered)."""
        now = asyncio.get_running_loop().time()
        return frozenset(p for p, until in self._failed.items() if until > now)

    async def settle(self, peers: Iterable[PeerID], deadline: float) -> frozenset[PeerID]:
        """Wait (until the loop time `deadline` at most) for the pings in flight to any of
        `peers`, then return those of them that are alive."""
        peers = list(peers)
        pending = [self._pending[p] for p in peers if p in self._pending]
        timeout = deadline - asyncio.get_running_loop().time()
        if pending and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(asyncio.shield(t) for t in pending)), timeout)
        return self.alive(peers)

    async def _ping(self, member: MemberInfo) -> None:
        loop = asyncio.get_running_loop()
        try:
            reply = await self.host.call(member.address(), ALIVE, {"run": self.run_id}, timeout=self.timeout)
            ok = isinstance(reply, dict) and reply.get("run") == self.run_id
        except P2PError as e:
            logger.debug("%s did not answer a liveness check: %s", member.peer_id, e)
            ok = False
        now = loop.time()
        if ok:
            self._answered[member.peer_id] = now + REMEMBER
            self._failed.pop(member.peer_id, None)
            if len(self._answered) > MAX_ENTRIES:
                del self._answered[min(self._answered, key=self._answered.__getitem__)]
        else:
            self._failed[member.peer_id] = now + FORGET_FAILURE
            if len(self._failed) > MAX_ENTRIES:
                del self._failed[min(self._failed, key=self._failed.__getitem__)]

    async def _rpc_alive(self, ctx: CallContext, args: Any) -> dict[str, str]:
        if not isinstance(args, dict) or args.get("run") != self.run_id:
            raise BadRequest("alive: wrong or missing run id")
        return {"run": self.run_id}
