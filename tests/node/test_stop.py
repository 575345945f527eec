"""A node asked to stop once its group has formed finishes that round (in one event loop over real
sockets): before, it left at once and its peers waited part_timeout (60 s by default) for its part."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from swarm.averaging.matchmaking.matchmaker import Matchmade
from tests.node.inprocess import LocalSwarm
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


async def test_a_node_stopped_after_its_group_formed_finishes_the_round(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    # inner steps slow enough that the group forms while they run (matchmaking_time before the end)
    settings: dict[str, Any] = dict(max_outer_steps=20, part_timeout=60.0, inner_steps=30, matchmaking_time=2.0)
    a = local.start((bootstrap,), **settings)
    b = local.start((bootstrap,), **settings)
    await until(lambda: 0 in a.steps() and 0 in b.steps(), 120, "a step of each", poll=0.1)  # paces known
    stopped_at: list[tuple[int, float]] = []
    assert b.node.outer_loop is not None
    groups = b.node.outer_loop.groups  # the matchmaking of b's steps and of their ends
    matchmake = groups.matchmake

    async def matchmake_then_stop(*args: Any, **kwargs: Any) -> Matchmade:
        found = await matchmake(*args, **kwargs)
        if found.group is not None and not stopped_at:  # the group counts on b now: ask b to stop
            stopped_at.append((b.node.diloco.outer_step, time.monotonic()))
            b.stop.set()
        return found

    groups.matchmake = matchmake_then_stop  # type: ignore[method-assign]
    assert await asyncio.wait_for(b.task, 90) == "stopped"
    step, when = stopped_at[0]
    assert step in b.steps() and b.steps()[step]["group_size"] == 2  # b finished its round
    await until(lambda: step in a.steps(), 30, f"a to finish step {step}", poll=0.1)
    assert a.steps()[step]["group_size"] == 2 and a.steps()[step]["state_sha256"] == b.steps()[step]["state_sha256"]
    assert time.monotonic() - when < 30, "a waited for a part b never sent (part_timeout is 60 s)"
