"""LeaderTrainingThread: rank 0's training thread, the DataTrainingThread of a node of several ranks.

    thread = LeaderTrainingThread(steps, data, peer_id, batch_size=8, seq_len=256, group=group,
                                  watchdog=ranks.dead)  # a functools.partial of it is SwarmNode's training_thread
    thread.start(); ...; steps.close(); thread.join(timeout)

It spends the node's permits like DataTrainingThread, but each inner step is one STEP command to the
other ranks and one DDP step on all of them (commands.py). Every collective rank 0 makes runs
in this thread: the event loop never waits on a rank. Between permits (the node is in the
swarm: matchmaking, a round, a fetch) it PINGs the ranks every `ping_s`, which also finds a dead
rank early; a rank that died or timed out fails the node (InnerSteps.fail) with one line, and the
node leaves the swarm as any node does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from swarm.model.data import TokenData
from swarm.model.diloco import NonFiniteLossError
from swarm.model.state_hash import tensors_sha256
from swarm.node.errors import NodeError
from swarm.node.inner_steps import InnerSteps, SessionClosed
from swarm.node.training_thread import TrainingThread
from swarm.p2p.peer_id import PeerID
from swarm.ranks.commands import Command, Op
from swarm.ranks.group import RankGroup, describe
from swarm.ranks.shard import ShardedInner, gather, scatter
from swarm.ranks.step import rank_step

logger = logging.getLogger(__name__)

__all__ = ["LeaderTrainingThread"]

PING_S = 5.0
DEATH_GRACE_S = 3.0  # how long a failed collective waits for the watchdog to see which rank exited


class LeaderTrainingThread(TrainingThread):
    """Owns rank 0's training thread (see the module docstring). `watchdog()` names a rank
    process that exited (spawn.py), or None; under torchrun there is none to ask."""

    def __init__(
        self, steps: InnerSteps, data: TokenData, peer_id: PeerID, *, batch_size: int, seq_len: int,
        group: RankGroup, watchdog: Callable[[], str | None] = lambda: None,
        ping_s: float = PING_S, sharded: ShardedInner | None = None,
    ) -> None:  # fmt: skip
        self.steps, self.data, self.group = steps, data, group  # group.ddp: the wrapped model
        self.peer = peer_id.to_bytes()
        self.batch_size, self.seq_len = batch_size, seq_len
        self.watchdog, self.ping_s = watchdog, min(ping_s, group.timeout / 4)
        # --shard: the inner step runs on the shards; steps.diloco wraps rank 0's full mirror (shard.py)
        self.sharded = sharded
        self._synced = -1  # the DiLoCo.revision the other ranks hold
        super().__init__("swarm-train-rank0")

    def _run(self) -> None:
        steps = self.steps
        try:
            while self._wait_for_permit():
                self._step()
        except SessionClosed:  # closed between our permit and our step: the ranks stop next, unharmed
            pass
        except NonFiniteLossError as e:  # every rank saw the same mean loss and skipped the step
            steps.fail(NodeError(f"training diverged ({e}): lower --lr or --outer-lr"))
        except BaseException as e:  # a rank died or timed out, or a bug: the node must end, and a
            steps.fail(NodeError(self._why(e)))  # broken group gets no more collectives (the CLI stops it)
            return
        self._stop()  # the group answered our last collective: tell the ranks

    def _wait_for_permit(self) -> bool:
        while True:
            try:
                return self.steps.wait_for_permit(self.ping_s)
            except TimeoutError:
                if (dead := self.watchdog()) is not None:
                    raise RuntimeError(dead) from None
                self.group.send(Command(Op.PING))

    def _step(self) -> None:
        diloco = self.steps.diloco
        self._sync()
        self.group.send(Command(Op.STEP, diloco.outer_step, diloco.inner_done))
        loss, tokens = rank_step(self.group, self.data, self.peer, diloco.global_inner_step,
                                 batch_size=self.batch_size, seq_len=self.seq_len)  # fmt: skip
        if self.sharded is not None and self.group.ddp is not None:  # step the shards; θ_inner whole into the mirror
            self.sharded.step(loss, diloco.global_inner_step)
            gather(self.group.ddp, diloco.params)
        self.steps.step(tokens, loss=loss)

    def _sync(self) -> None:
        """θ_inner to every rank if it changed outside an inner step (we hold a permit, or the
        session is over: the node is not writing it)."""
        diloco = self.steps.diloco
        if diloco.revision == self._synced:
            return
        self.group.send(Command(Op.SYNC, diloco.outer_step, diloco.inner_done))
        if self.sharded is not None and self.group.ddp is not None:
            scatter(self.group.ddp, diloco.params)
        else:
            self.group.broadcast_params(diloco.params)
        self._synced = diloco.revision
        if logger.isEnabledFor(logging.DEBUG):  # hashing a big model takes seconds
            logger.debug("rank 0: θ sha256 %s at outer step %d", tensors_sha256(diloco.params), diloco.outer_step)

    def _stop(self) -> None:
        try:
            self._sync()  # the last outer step's θ, so that every rank ends where rank 0 does
            self.group.send(Command(Op.STOP))
        except BaseException as e:  # the node is leaving anyway; the CLI stops the ranks
            logger.warning("could not tell the other ranks to stop: %s", self._why(e))

    def _why(self, error: BaseException) -> str:
        dead = self.watchdog()
        deadline = time.monotonic() + DEATH_GRACE_S
        while dead is None and time.monotonic() < deadline:  # a rank's exit reaches us after its socket's
            time.sleep(0.1)
            dead = self.watchdog()
        if dead is not None:
            return f"{dead}: this node leaves the swarm"
        return f"a rank of this node failed or timed out ({describe(error)}): this node leaves the swarm"
