"""Nodes of one run agree on its settings (swarm/node/settings.py), in one event loop over
real sockets: a node given another schedule than the run's refuses to start and says which
flags differ; nodes of other settings that start unseen by each other never average together."""

from __future__ import annotations

import asyncio

import pytest

import swarm.node.node
from swarm.dht.run_keys import nodes_key
from swarm.node import NodeError
from tests.node.inprocess import LocalSwarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


async def published_settings(local: LocalSwarm, run_id: str = "inproc") -> None:
    """Until the run's first progress record (with its settings) is in the DHT."""
    assert local.bootstrap is not None
    dht = local.bootstrap[1]
    while True:
        found = await dht.get(nodes_key(run_id), latest=True)
        entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
        if any("settings" in getattr(e, "value", {}) for e in entries):
            return
        await asyncio.sleep(0.1)


async def test_a_node_with_another_schedule_refuses_to_start_naming_both_values(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    first = local.start((bootstrap,), max_outer_steps=50, lr_schedule="cosine", total_steps=200)
    await asyncio.wait_for(published_settings(local), 30)
    other = local.start((bootstrap,), leave_after_steps=2)  # swarm-node's default: constant
    with pytest.raises(NodeError) as caught:
        await asyncio.wait_for(other.task, 30)
    message = str(caught.value)
    assert "--lr-schedule 'cosine' (this node: 'constant')" in message
    assert "--total-steps 200 (this node: None)" in message
    assert not other.steps() and not first.task.done()
    same = local.start((bootstrap,), leave_after_steps=2, lr_schedule="cosine", total_steps=200, max_outer_steps=50)
    assert await asyncio.wait_for(same.task, 150) == "left"  # the run's own settings are welcome
    assert any(e.get("group_size", 0) >= 2 for e in same.steps().values())


async def test_nodes_of_other_settings_that_did_not_see_each_other_never_group(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes that start at once may not see each other's records before they train (here: the
    start-up check is switched off): their ready records carry the settings' digest, so each pair
    groups only with itself and never takes the other pair's state for the swarm's."""
    monkeypatch.setattr(swarm.node.node, "disagreement", lambda *args: None)
    bootstrap = await local.start_bootstrap()
    a = [local.start((bootstrap,), max_outer_steps=2) for _ in range(2)]
    b = [local.start((bootstrap,), max_outer_steps=2, inner_steps=5) for _ in range(2)]
    reasons = await local.finish(100)
    assert reasons == ["finished"] * 4
    for pair in (a, b):
        assert [e["group_size"] for n in pair for e in n.steps().values()] == [2] * 4
        assert not [e for n in pair for e in n.events if e["event"] == "fetch"]
    assert a[0].steps()[1]["state_sha256"] != b[0].steps()[1]["state_sha256"]
