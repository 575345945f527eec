"""Nodes that start a run together: --start-with's wait, and swarm.join's wait_for_peers.

Both publish this node's progress record and read the run's until enough nodes are live with our
settings; the counting rules are plan.py's (pure, with the facts passed in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from swarm.node.plan import nodes_to_start_with, starting_together
from swarm.node.view import SwarmView

logger = logging.getLogger(__name__)

START_WAIT_S = 600.0  # --start-with: the longest a node waits for the others of a new run
START_POLL_S = 0.5  # seconds between readings of the run's records while it waits


async def wait_for_live(view: SwarmView, nodes: int, deadline: float) -> int:
    """Publish and read until `nodes` nodes (us included) are live or the loop's clock reaches
    `deadline`; how many are live then."""
    loop = asyncio.get_running_loop()
    while True:
        await view.publish()
        await view.ctx.book.refresh()
        live = 1 + len(view.read().live())
        if live >= nodes or loop.time() >= deadline:
            return live
        await asyncio.sleep(START_POLL_S)


async def wait_to_start(view: SwarmView, start_with: int, stop: asyncio.Event) -> int:
    """--start-with N: at a new run's first step, wait until N nodes (us included) are live
    (plan.nodes_to_start_with), publishing our record meanwhile, at most START_WAIT_S.
    Returns the nodes the run began with (plan.starting_together; 0: it did not wait, or had
    begun): the loop's "last group" before its first step."""
    if start_with <= 1:
        return 0
    loop = asyncio.get_running_loop()
    deadline, said = loop.time() + START_WAIT_S, None
    while not stop.is_set():
        await view.publish()
        await view.ctx.book.refresh()
        facts = view.read()
        missing = nodes_to_start_with(facts, start_with)
        if missing == 0:
            return starting_together(facts)  # together from the first step (swarm_together)
        if loop.time() >= deadline:
            logger.warning("--start-with %d: %d node(s) still missing after %.0f s: training without them",
                           start_with, missing, START_WAIT_S)  # fmt: skip
            return 0
        if missing != said:
            logger.info("--start-with %d: waiting for %d more node(s)", start_with, missing)
            said = missing
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), START_POLL_S)
    return 0
