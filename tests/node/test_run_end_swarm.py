"""The run's end is a run setting (swarm/node/settings.py), in one event loop over real sockets: a
node that joins without it takes the run's and stops there, and one that arrives after the run
ended trains nothing and says so ("run ended", not "finished")."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.node.inprocess import LocalSwarm
from tests.node.test_run_settings_swarm import published_settings

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


async def test_a_joiner_stops_at_the_runs_end_and_a_late_one_is_told_the_run_ended(
    local: LocalSwarm, caplog: pytest.LogCaptureFixture
) -> None:
    bootstrap = await local.start_bootstrap()
    first = local.start((bootstrap,), max_outer_steps=3)
    await asyncio.wait_for(published_settings(local), 30)
    joiner = local.start((bootstrap,))  # not given the run's end
    assert await asyncio.wait_for(joiner.task, 150) == "finished"
    assert await asyncio.wait_for(first.task, 60) == "finished"
    assert joiner.node.config.max_outer_steps == 3  # adopted from the run's records
    assert max(joiner.steps()) == 2  # the run's last step (0-based): never past it
    exits = [e for e in joiner.events if e["event"] == "exit"]
    assert exits[-1]["outer_step"] == 3
    with caplog.at_level(logging.WARNING, logger="swarm.node.loop"):
        late = local.start((bootstrap,))  # the run's records still say it ended at step 3
        assert await asyncio.wait_for(late.task, 60) == "run ended"
    assert not late.steps()
    assert any("the run ended at step 3" in r.getMessage() for r in caplog.records)
