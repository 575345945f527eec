"""One swarm at any size: after outer step N every node that completed N holds the same state
(θ_outer, momentum, step). Many SwarmNodes in one event loop (tests/node/inprocess.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.averaging.rounds.grid import GridRound
from tests.node.inprocess import LocalSwarm
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def assert_one_state(local: LocalSwarm) -> dict[int, set[str]]:
    by_step = local.by_step()
    forks = {step: len(hashes) for step, hashes in by_step.items() if len(hashes) != 1}
    assert not forks, f"outer steps with more than one state (step: states): {forks}; nodes: {local.timeline()}"
    return by_step


async def test_sixteen_nodes_hold_one_state_after_every_step(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    # --start-with 16: under CI's load 7 of the 16 (built one after another in this one loop)
    # missed step 0's group. A node behind catches up from the step's update in about 4 s here,
    # and 4 inner steps of the tiny model take well under one: the others' next group formed
    # before it held their result at every step, and at the last it ended without it. In the
    # field an inner phase lasts minutes, and the same node joins the next group.
    for _ in range(16):
        local.start((bootstrap,), max_outer_steps=3, start_with=16)
    reasons = await local.finish(200)
    assert reasons == ["finished"] * 16
    by_step = assert_one_state(local)
    assert set(by_step) >= {1, 2}
    # the last step: one group of everyone that completed it (a node the group formed without,
    # whose result did not reach it, ends without it: plan.END)
    last = [n.steps()[2] for n in local.nodes if 2 in n.steps()]
    assert len(last) >= 12 and all(e["group_size"] == len(last) for e in last), local.timeline()


async def test_past_the_cap_one_state_through_the_grid_even_when_a_member_dies_mid_round(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 nodes with max_group_size 4: the grid butterfly. One member dies 50 ms into the round
    of step 1 (its host closes, its node stops at once, as under SIGKILL): the survivors of that
    step still hold one state, and train on."""
    bootstrap = await local.start_bootstrap()
    # --start-with 12: under CI's load a node that started a moment late missed step 0's group
    # and fetched its result (one node of 12 in one event loop); the grid must see all twelve
    nodes = [local.start((bootstrap,), max_outer_steps=3, max_group_size=4, start_with=12) for _ in range(12)]
    victim = nodes[5].node.peer_id
    run = GridRound.run
    killed = asyncio.Event()
    killing: list[asyncio.Future[None]] = []

    async def run_or_die(self: GridRound) -> object:
        if self.host.peer_id == victim and self.group.step == 1 and not killed.is_set():
            killed.set()
            host = self.host

            def die() -> None:
                killing.append(asyncio.ensure_future(host.close()))
                nodes[5].task.cancel()

            asyncio.get_running_loop().call_later(0.05, die)
        return await run(self)

    monkeypatch.setattr(GridRound, "run", run_or_die)
    survivors = [n for n in nodes if n is not nodes[5]]
    await asyncio.wait_for(asyncio.gather(*(n.task for n in survivors)), 200)
    assert killed.is_set()
    assert [n.task.result() for n in survivors] == ["finished"] * 11
    by_step = assert_one_state(local)
    assert set(by_step) == {0, 1, 2}
    # step 0 went through the grid (past the cap of 4) for most survivors. Even with --start-with
    # 12 a node whose inner steps ran late on a loaded machine (12 training threads on 2 cores,
    # beside the tier's other workers) missed that group and fetched its result, as designed: the
    # group does not wait past its window for a member that is not ready
    sizes = [n.steps()[0]["group_size"] for n in survivors if 0 in n.steps()]
    assert len(sizes) >= 8 and all(size > 4 for size in sizes), local.timeline()


async def test_a_node_of_another_state_is_not_mixed_in_it_fetches_the_swarms_and_agrees(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    # the honest nodes train a step longer (the run's end): the odd one leaves before it, and
    # must find their state still served
    honest = [local.start((bootstrap,), max_outer_steps=3) for _ in range(3)]
    odd = local.start((bootstrap,), max_outer_steps=3, leave_after_steps=2)
    with torch.no_grad():  # the same step, another θ_outer: as after a partition that applied its own Δ
        for theta in odd.node.diloco.outer_params:
            theta.add_(0.01)
    assert await local.finish(150) == ["finished"] * 3 + ["left"]
    by_step = assert_one_state(local)
    assert set(by_step) == {0, 1, 2}
    fetches = [e for e in odd.events if e["event"] == "fetch"]
    assert fetches and fetches[0]["reason"] in ("not the swarm's state", "behind"), fetches
    assert all(not [e for e in n.events if e["event"] == "fetch"] for n in honest)


async def test_nodes_told_to_start_with_three_wait_for_the_third_and_average_with_it_from_the_first_step(
    local: LocalSwarm,
) -> None:
    """--start-with 3: two nodes up early do not pair up and leave the third to fetch their
    state; the run begins when the third is live, in one group of three."""
    bootstrap = await local.start_bootstrap()
    early = [local.start((bootstrap,), max_outer_steps=3, start_with=3) for _ in range(2)]
    await until(lambda: all(any(e["event"] == "start" for e in n.events) for n in early), 60, "the first two's start")
    await asyncio.sleep(2.0)  # a pair would have averaged its first step by now (4 tiny inner steps)
    assert not any(n.steps() for n in early), "a node trained before the third was there"
    local.start((bootstrap,), max_outer_steps=3, start_with=3)
    assert await local.finish(150) == ["finished"] * 3
    by_step = local.by_step()
    assert all(len(by_step[step]) == 1 for step in (0, 1)), by_step
    assert [n.steps()[0]["group_size"] for n in local.nodes] == [3, 3, 3]
    assert not [e for n in local.nodes for e in n.events if e["event"] == "fetch"]
