"""A peer that sends a poisoned pseudo-gradient cannot stop or fork the swarm: SwarmNodes
in one event loop (tests/node/inprocess.py), one of them sending its delta times 1e30; a node
handed a non-finite average refuses it and trains on."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from swarm.averaging.averager import Averager
from swarm.averaging.messages import GroupInfo
from tests.node.inprocess import LocalSwarm, Running
from tests.node.test_attacks_bounds import assert_fetched_only_swarm_states

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


async def test_a_1e30_delta_is_dropped_and_the_honest_nodes_train_on_in_agreement(local: LocalSwarm) -> None:
    """Before the robust reduction, the group's mean carried 1e30/5 into every θ_outer and the
    next inner step ended every node with "training diverged"."""
    bootstrap = await local.start_bootstrap()
    nodes = [local.start((bootstrap,), max_outer_steps=3) for _ in range(5)]
    attacker = nodes[4].node
    honest_deltas = attacker.diloco.pseudo_gradients
    attacker.diloco.pseudo_gradients = lambda: [d.fill_(1e30) for d in honest_deltas()]  # type: ignore[method-assign]
    honest = nodes[:4]
    reasons = await asyncio.wait_for(asyncio.gather(*(n.task for n in honest)), 200)
    assert reasons == ["finished"] * 4
    # the attacker may be left behind waiting for peers that are gone: its fate is not the test's,
    # only that it ends cleanly
    nodes[4].stop.set()
    assert await asyncio.wait_for(nodes[4].task, 60) in ("stopped", "finished")
    for step in (0, 1, 2):  # a node that started late may have fetched past a step
        events = [n.steps()[step] for n in honest if step in n.steps()]
        assert len({e["state_sha256"] for e in events}) == 1, f"honest nodes disagree at step {step}"

    # each honest node ends with the last step's state: computed in the group, or (a node late for
    # the last group, under a loaded suite) fetched from it, its update or the whole state
    def end(n: Running) -> str | None:
        if 2 in n.steps():
            return n.steps()[2]["state_sha256"]
        fetched = [e["state_sha256"] for e in n.events if e["event"] == "fetch" and e["outer_step"] == 3]
        return fetched[-1] if fetched else None

    ends = [end(n) for n in honest]
    assert len(set(ends)) == 1 and sum(2 in n.steps() for n in honest) >= 3, ends
    assert_fetched_only_swarm_states(honest)
    grouped = [e for n in honest for e in n.events if e["event"] == "outer_step" and e["group_size"] == 5]
    assert grouped, "the attacker was never in a group: nothing was tested"
    assert sum(e["clipped"] for e in grouped) > 0  # the owners dropped it, and said so
    last = [n.steps()[2]["eval_loss"] for n in honest if 2 in n.steps()]
    assert all(loss is not None and loss < 10 for loss in last)


async def test_a_node_refuses_a_non_finite_average_and_trains_on(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group average with NaN (a robust round never gives one; a bug or a future codec might)
    is refused like a failed round: θ_outer stays finite and the node does not exit (before, the
    ValueError of apply_outer ended it)."""
    bootstrap = await local.start_bootstrap()
    nodes = [local.start((bootstrap,), max_outer_steps=2) for _ in range(3)]
    victim = nodes[0].node.peer_id
    run_round = Averager.run_round
    poisoned: list[int] = []

    async def poison(self: Averager, group: GroupInfo | None, *args: Any) -> Any:
        averaged, report = await run_round(self, group, *args)
        if group is not None and self.host.peer_id == victim and not poisoned:
            poisoned.append(group.step)
            averaged = [torch.full_like(t, math.nan) for t in averaged]
        return averaged, report

    monkeypatch.setattr(Averager, "run_round", poison)
    others = [n.task for n in nodes[1:]]
    assert await asyncio.wait_for(asyncio.gather(*others), 200) == ["finished"] * 2
    assert poisoned, "the victim never averaged in a group: nothing was tested"
    nodes[0].stop.set()  # the others are gone: it may still be looking for them
    assert await asyncio.wait_for(nodes[0].task, 30) in ("stopped", "finished")  # no exception
    assert all(bool(torch.isfinite(p).all()) for p in nodes[0].node.diloco.outer_params)
