"""One swarm at any size: after outer step N every node that completed N holds the same state
(θ_outer, momentum, step). Many SwarmNodes in one event loop (tests/node/inprocess.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from swarm.model.data import TokenData, load_data
from tests.node.inprocess import LocalSwarm

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def data() -> TokenData:
    return load_data("stdlib")


@pytest.fixture
async def local(data: TokenData) -> AsyncIterator[LocalSwarm]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many trainer threads on 2 cores
    swarm = LocalSwarm(data)
    try:
        yield swarm
    finally:
        await swarm.close()
        torch.set_num_threads(threads)


def assert_one_state(local: LocalSwarm) -> dict[int, set[str]]:
    by_step = local.by_step()
    forks = {step: len(hashes) for step, hashes in by_step.items() if len(hashes) != 1}
    assert not forks, f"outer steps with more than one state (step: states): {forks}"
    return by_step


async def test_sixteen_nodes_hold_one_state_after_every_step(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    for _ in range(16):
        local.start((bootstrap,), max_outer_steps=3)
    reasons = await local.finish(200)
    assert reasons == ["finished"] * 16
    by_step = assert_one_state(local)
    assert set(by_step) >= {1, 2}
    last = [n.steps()[2] for n in local.nodes]
    assert all(e["group_size"] == 16 for e in last), [e["group_size"] for e in last]
