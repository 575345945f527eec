"""Safe state choice for a newcomer: 3 honest SwarmNodes in one event loop over real sockets,
then 4 proven identities (each paid for its DHT id) that advertise a correctly hashed all-zero
state one step ahead of the swarm (a plausible step: a newcomer knows no pace), then a newcomer
that joins through the bootstrap alone (which advertises no state and vouches for nothing).
Best-backed, the newcomer chooses the attackers' state (4 backers against 3): no seniority saves
it, since it has averaged with nobody. What stops it is the lineage: the attackers' state has
no rounds signed by anyone that lead to it, and the newcomer adopts only what a lineage it can
check leads to, so it takes the honest state. (Attackers who also make up a lineage from the
run's start, signed by their own identities, are not told apart by such a newcomer: the docs'
security page says so; a newcomer that joins through a holder of the honest state is safe.)"""

from __future__ import annotations

import contextlib

import pytest

from swarm.model.data import TokenData
from tests.node.inprocess import LocalSwarm
from tests.node.test_attacks_bounds import (
    LONG,
    assert_agree,
    assert_fetched_only_swarm_states,
    fake_snapshot,
    fetches,
    finish,
    outsider,
    serve_fake_state,
    start_honest,
    until_stepped,
)
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]
ATTACKERS = 4  # more identities than the 3 honest nodes


async def test_attack_h_a_newcomer_takes_no_state_that_no_lineage_leads_to(local: LocalSwarm, data: TokenData) -> None:
    """The attackers advertise for the whole run, before and after the newcomer's first fetch."""
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap)
    await until_stepped(honest)
    fake = fake_snapshot(honest[0], max(honest[0].steps()) + 2)  # one step ahead of the swarm's state
    async with contextlib.AsyncExitStack() as stack:
        advertising = []
        for _ in range(ATTACKERS):
            host, dht = await stack.enter_async_context(outsider(bootstrap))
            advertising.append(await serve_fake_state(host, dht, fake))
        try:
            newcomer = local.start((bootstrap,), max_outer_steps=LONG)
            await until(lambda: fetches(newcomer), 60, "the newcomer's first fetch")
            await finish(honest, (newcomer,))
        finally:
            for task in advertising:
                task.cancel()
    assert_fetched_only_swarm_states([*honest, newcomer])  # never the attackers' (nobody computed it)
    assert_agree(honest, (newcomer,))
