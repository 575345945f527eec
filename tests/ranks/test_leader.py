"""Rank 0's training thread against a recording group (no torch.distributed): it pings the ranks
while the node gives no permit, names a rank its watchdog saw exit, and ends with SYNC, STOP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.node.errors import NodeError
from swarm.node.inner_steps import InnerSteps
from swarm.p2p.identity import Identity
from swarm.ranks.commands import Command, Op

if TYPE_CHECKING:  # imported where used: it imports torch's FSDP (0.7 s), in every worker that collects this file
    from swarm.ranks.leader import LeaderTrainingThread


class RecordingGroup:
    """What LeaderTrainingThread calls of a RankGroup, recorded."""

    timeout = 10.0
    ddp = None

    def __init__(self) -> None:
        self.sent: list[Op] = []
        self.broadcasts = 0

    def send(self, command: Command) -> None:
        self.sent.append(command.op)

    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        self.broadcasts += 1


def _loop(watchdog: Any = lambda: None) -> tuple[LeaderTrainingThread, InnerSteps, RecordingGroup]:
    from swarm.ranks.leader import LeaderTrainingThread

    steps = InnerSteps(DiLoCo(nn.Linear(2, 2), DiLoCoConfig(inner_steps=2)))
    group = RecordingGroup()
    loop = LeaderTrainingThread(steps, None, Identity.generate().peer_id, batch_size=2, seq_len=4,  # type: ignore[arg-type]
                      group=group, watchdog=watchdog, ping_s=0.05)  # type: ignore[arg-type]  # fmt: skip
    return loop, steps, group


@pytest.mark.timeout(30)
def test_it_pings_while_the_node_is_busy_and_syncs_then_stops_at_the_end() -> None:
    loop, steps, group = _loop()
    loop.start()
    time.sleep(0.5)  # no permit: the node is in the swarm (matchmaking, a round, a fetch)
    steps.close()
    loop.join(10)
    assert group.sent[:3] == [Op.PING] * 3 and group.sent[-2:] == [Op.SYNC, Op.STOP], group.sent
    assert set(group.sent[:-2]) == {Op.PING} and group.broadcasts == 1


@pytest.mark.timeout(30)
def test_a_rank_the_watchdog_saw_exit_fails_the_node_with_one_line() -> None:
    dead = "rank 1 of this node (pid 4242) exited: killed by signal 9"
    loop, steps, group = _loop(watchdog=lambda: dead)
    loop.start()
    loop.join(10)  # it ends at its first ping
    with pytest.raises(NodeError) as e:
        asyncio.run(steps.train(2))
    assert str(e.value) == f"{dead}: this node leaves the swarm"
    assert Op.STOP not in group.sent  # a broken group gets no more collectives
    steps.close()
