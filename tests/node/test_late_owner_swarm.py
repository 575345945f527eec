"""A node stalled between its group's formation and its round (a SIGSTOPped process) ends the
step with its group's state, never one of its own (rounds/confirm.py).

Three SwarmNodes in one event loop. At step STEP one node's process "stops" once its group has
formed: every frame that reaches it waits (tests/averaging/stall.py) until the other two have
ended the step; they gave up on its answer for its part two part timeouts in and took the part
from its backup. Then it runs its round, reading the held frames as it goes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from swarm.averaging.averager import Averager, GroupReport
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import timeouts
from tests.averaging.stall import Stall
from tests.node import inprocess
from tests.node.inprocess import LocalSwarm, Running

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

STEP = 3  # the rounds of steps 0-2 are measured (2 besides the slowest): step 3's part timeout is the derived one
MIB = 1 << 20
FLOOR_S, CEILING_S = 5.0, 30.0  # the derived part timeout's floor, and the flag
WAIT_S = 120.0  # the longest the stalled node waits for the others to end the step


def stall_at(monkeypatch: pytest.MonkeyPatch, stalled: Running, others_ended: asyncio.Event) -> None:
    """Patch the stalled node's round of STEP: it begins once `others_ended` is set."""
    run_round = Averager.run_round

    async def stalled_round(
        self: Averager, group: GroupInfo | None, tensors: Sequence[torch.Tensor], matchmaking_s: float = 0.0
    ) -> tuple[list[torch.Tensor], GroupReport]:
        if self.host.peer_id != stalled.node.peer_id or group is None or group.step != STEP:
            return await run_round(self, group, tensors, matchmaking_s)
        stall = Stall(self.host)
        await asyncio.wait_for(others_ended.wait(), WAIT_S)
        joined = asyncio.Event()
        add = self.registry.add

        def joining(round_: Any) -> None:
            add(round_)
            joined.set()

        monkeypatch.setattr(self.registry, "add", joining)
        late = asyncio.ensure_future(run_round(self, group, tensors, matchmaking_s))
        await asyncio.wait_for(joined.wait(), WAIT_S)  # the round joins its registry before a frame is read
        await stall.wake()
        return await late

    monkeypatch.setattr(Averager, "run_round", stalled_round)


async def test_a_node_stalled_before_its_round_ends_the_step_with_its_groups_state(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a part of a group of 3 fits the initial window of its stream, as a part of the soak's groups
    # of 6 did: the senders' slices wait whole in the stalled node's buffers
    monkeypatch.setattr(inprocess, "LOCAL", dataclasses.replace(inprocess.LOCAL, stream_initial_window_bytes=4 * MIB))
    # with one member stalled each part has two contributions at most, the minimum: a floor of 2 s
    # lets a busy machine's slow slice fail the others' round too, and the step has no late owner
    monkeypatch.setattr(timeouts, "FLOOR_S", FLOOR_S)
    bootstrap = await local.start_bootstrap()
    others_ended = asyncio.Event()
    others: list[Running] = []

    def ended(event: dict[str, Any]) -> None:
        if event["event"] == "outer_step" and all(STEP in o.steps() for o in others):
            others_ended.set()

    nodes = [local.start((bootstrap,), max_outer_steps=STEP + 2, start_with=3, on_event=ended, part_timeout=CEILING_S)
             for _ in range(3)]  # fmt: skip
    stalled, others[:] = nodes[1], [nodes[0], nodes[2]]
    stall_at(monkeypatch, stalled, others_ended)
    await local.finish(timeout=200)
    used = [o.steps()[STEP]["part_timeout_s"] for o in others]
    assert max(used) < CEILING_S, f"step {STEP} ran with the flag's timeout, not a derived one: {used}"
    hashes = local.by_step()
    assert STEP in stalled.steps(), "the stalled node did not complete the step"
    groups = {o.steps()[STEP]["group_size"] for o in others}
    assert groups == {3}, f"the stalled node was not in its group at step {STEP}: {groups}"
    forks: dict[int, Any] = {step: states for step, states in hashes.items() if len(states) != 1}
    assert not forks, f"steps with more than one state among the nodes that completed them: {forks}"
