"""ISSUE 12, safe state choice for a newcomer: 3 honest SwarmNodes in one event loop over real
sockets, then 4 fresh identities that advertise a correctly hashed all-zero state one step ahead
of the swarm (a plausible step: a newcomer knows no pace), then a newcomer that joins through the
bootstrap alone (which advertises no state). Best-backed, the newcomer took the attackers' state
(4 backers against 3) and trained from zeros. It now prefers states backed by identities its
--initial-peers have known for a while (trust.SEASONED_S; 20 s here, 5 minutes by default)."""

from __future__ import annotations

import contextlib

import pytest

from swarm.model.data import TokenData
from swarm.state import trust
from tests.node.inprocess import LocalSwarm, Running
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
SEASONED_S = 20.0  # how long the bootstrap must have known a holder (5 minutes by default)
FRESH_FOR = 15.0  # the attack stops by then: the attackers never become seasoned


async def test_attack_h_a_newcomer_prefers_long_known_holders_over_a_fresh_majority(
    local: LocalSwarm, data: TokenData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack lasts until the newcomer has taken a state (at most FRESH_FOR seconds): past
    SEASONED_S the attackers are seasoned too, and 4 seasoned identities against 3 honest ones are
    a majority, which no rule of a minority's defence covers (a node in sync follows them too)."""
    monkeypatch.setattr(trust, "SEASONED_S", SEASONED_S)
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap)
    await until_stepped(honest)
    await until_known_for(local, honest, SEASONED_S)
    fake = fake_snapshot(honest[0], max(honest[0].steps()) + 2)  # one step ahead of the swarm's state
    async with contextlib.AsyncExitStack() as stack:
        advertising = []
        for _ in range(ATTACKERS):
            host, dht = await stack.enter_async_context(outsider(bootstrap))
            advertising.append(await serve_fake_state(host, dht, fake))
        try:
            newcomer = local.start((bootstrap,), max_outer_steps=LONG)  # right away: the attackers are 0 s old
            await until(
                lambda: fetches(newcomer), FRESH_FOR, "the newcomer's first fetch while the attackers are fresh"
            )
        finally:
            for task in advertising:
                task.cancel()
    await finish(honest, (newcomer,))
    assert_fetched_only_swarm_states([*honest, newcomer])  # never the attackers' (nobody computed it)
    assert_agree(honest, (newcomer,))


async def until_known_for(local: LocalSwarm, nodes: list[Running], seconds: float) -> None:
    """Until the bootstrap has known every node for `seconds` (its routing table's first sight)."""
    assert local.bootstrap is not None
    table = local.bootstrap[1].table

    def known() -> bool:
        return all((age := table.age(n.node.peer_id)) is not None and age >= seconds for n in nodes)

    await until(known, seconds + 60, f"the bootstrap to have known the honest nodes for {seconds:g} s")
