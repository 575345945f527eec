"""The training thread: where a node's inner steps run, spending the permits InnerSteps hands out
(DESIGN invariant 6). swarm-node's is DataTrainingThread, on its own data:

    steps = InnerSteps(diloco)                          # swarm/node/inner_steps.py: what the node drives
    thread = DataTrainingThread(steps, data, peer_id, batch_size=8, seq_len=256)
    thread.start()                                      # a permit, a batch, forward, backward, step
    ...
    steps.close(); thread.join(timeout)

A swarm.join caller's own thread spends the same permits; swarm-node's thread is this one, over the
built-in data: batches come from node_generator(PeerID, global inner step), so every node trains
on its own windows of the same corpus, and a node that repeats a step draws the same windows.
Training runs in this thread, outside the event loop, which keeps serving meanwhile.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Protocol

import torch

from swarm.data.cursor import ChunkCursor, CursorClosed, DataStall, NoChunkFree
from swarm.model.data import TokenData, node_generator, sample_batch
from swarm.model.diloco import NonFiniteLossError
from swarm.model.tokens import TokensError
from swarm.node.errors import NodeError
from swarm.node.inner_steps import InnerSteps, SessionClosed
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)
# seconds an inner step waits for a data chunk: the claimer renews every 20 s, and at an epoch's
# end the last chunks (a peer's, or a dead peer's until its claims lapse) come first
CHUNK_WAIT_S = 600.0


class TrainingThread:
    """The thread that runs a node's inner steps, spending its InnerSteps permits: `start`, then
    `join`. A subclass's `_run` is the loop: swarm-node's DataTrainingThread, or rank 0's
    LeaderTrainingThread in a node of several ranks (in swarm.join the caller's own thread)."""

    def __init__(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread (it ends once the steps are closed, after the step under way)."""
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the training thread %s did not end within %.0fs", self._thread.name, timeout)

    def _run(self) -> None:
        raise NotImplementedError


class TrainingThreadFactory(Protocol):
    def __call__(self, steps: InnerSteps, data: TokenData, peer_id: PeerID, *, batch_size: int,
                 seq_len: int) -> TrainingThread: ...  # fmt: skip


class DataTrainingThread(TrainingThread):
    """swarm-node's training thread: inner steps on its data (built-in or prepared) whenever the
    node allows them (InnerSteps permits). A divergence (a NaN or inf loss or gradient) fails the
    node (InnerSteps.fail) with what to do."""

    def __init__(self, steps: InnerSteps, data: TokenData, peer_id: PeerID, *, batch_size: int, seq_len: int,
                 cursor: ChunkCursor | None = None) -> None:  # fmt: skip
        super().__init__("swarm-train")
        self.steps, self.data = steps, data
        self.cursor = cursor  # prepared data: the chunks this node claimed, read in order
        self.peer = peer_id.to_bytes()
        self.batch_size, self.seq_len = batch_size, seq_len

    def _run(self) -> None:
        steps, diloco = self.steps, self.steps.diloco
        try:
            while steps.wait_for_permit():
                try:
                    inputs, targets = self._batch()
                except NoChunkFree:  # at an epoch's end: the chunk we wait for may be a waiting peer's
                    p = steps.snapshot()
                    logger.info("no data chunk is free and peers of our outer step wait for us: ending its inner "
                                "steps at %d of %d", p.inner_done, p.target)  # fmt: skip
                    steps.end_step()
                    continue
                loss, tokens = diloco.forward_backward(inputs, targets)
                steps.step(tokens, loss=loss)
        except (SessionClosed, CursorClosed):
            return
        except DataStall as e:
            steps.fail(NodeError(f"{e}: is the DHT reachable?"))
        except TokensError as e:  # a remote shard that could not be fetched or did not verify: never trained on
            steps.fail(NodeError(f"data: {e}"))
        except NonFiniteLossError as e:
            steps.fail(NodeError(f"training diverged ({e}): lower --lr or --outer-lr"))
        except BaseException as e:  # a bug, or out of memory: the node must end, not wait forever
            logger.error("the training thread failed", exc_info=True)
            steps.fail(NodeError(f"training failed: {type(e).__name__}: {e}"))

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor is not None:
            # no chunk free while our peers wait: the rows read so far make a short last batch
            return self.cursor.next_batch(self.batch_size, CHUNK_WAIT_S, give_up=lambda: self.steps.waited_on)
        diloco = self.steps.diloco
        # a step past H (DiLoCo.extra_room) draws windows of its own
        generator = node_generator(self.peer, diloco.global_inner_step, extra=diloco.ready_for_outer)
        return sample_batch(self.data.train, self.batch_size, self.seq_len, generator)


def __getattr__(name: str) -> object:
    """The names this module's classes had until this release, with a DeprecationWarning."""
    renamed = {"DataLoop": DataTrainingThread, "TrainLoopFactory": TrainingThreadFactory, "TrainLoop": TrainingThread}
    if name in renamed:
        warnings.warn(f"{__name__}.{name} is now {renamed[name].__name__}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return renamed[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
