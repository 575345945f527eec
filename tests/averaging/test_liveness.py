"""Liveness checks (swarm/averaging/matchmaking/liveness.py) over real hosts on 127.0.0.1: a peer counts only
once it answered; a closed port, another run, or a client never counts; the pings per step are
bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from swarm.averaging.matchmaking import liveness
from swarm.averaging.matchmaking.liveness import Liveness
from swarm.averaging.messages import MemberInfo
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.identity import Identity

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))


@pytest.fixture
async def hosts() -> AsyncIterator[list[P2PHost]]:
    made = [await P2PHost(config=LOCAL).start() for _ in range(3)]
    yield made
    await asyncio.gather(*(h.close() for h in made))


def member_of(host: P2PHost) -> MemberInfo:
    return MemberInfo(host.peer_id, tuple(host.visible_maddrs), 1.0, 100.0, False)


def fake() -> MemberInfo:
    """An identity that announces an address where nobody answers."""
    return MemberInfo(Identity.generate().peer_id, ("/ip4/127.0.0.1/tcp/9",), 1.0, 100.0, False)


async def test_only_peers_that_answer_count(hosts: list[P2PHost]) -> None:
    me, honest, other_run = hosts
    checks = [Liveness(me, "run", 2.0), Liveness(honest, "run", 2.0), Liveness(other_run, "another", 2.0)]
    try:
        nobody, client = fake(), MemberInfo(Identity.generate().peer_id, (), 1.0, 0.0, True)
        everyone = [member_of(honest), member_of(other_run), nobody, client]
        ids = [m.peer_id for m in everyone]
        assert checks[0].alive(ids) == frozenset()  # nobody asked yet: nobody counts
        checks[0].ask(0, everyone)
        loop = asyncio.get_running_loop()
        alive = await checks[0].settle(ids, loop.time() + 5)
        assert alive == {honest.peer_id}
        assert checks[0].failed() == {other_run.peer_id, nobody.peer_id}  # the client was never asked
        assert checks[0].alive([me.peer_id]) == {me.peer_id}  # we count ourselves
    finally:
        for check in checks:
            check.close()


async def test_pings_per_step_are_bounded_and_expected_peers_are_always_asked(
    hosts: list[P2PHost], monkeypatch: pytest.MonkeyPatch
) -> None:
    me, honest, other = hosts
    monkeypatch.setattr(liveness, "MAX_PINGS", 4)
    checks = [Liveness(me, "run", 2.0), Liveness(honest, "run", 2.0), Liveness(other, "run", 2.0)]
    try:
        flood = [fake() for _ in range(10)]
        good, late = member_of(honest), member_of(other)
        checks[0].ask(7, [*flood, good], first={good.peer_id})
        loop = asyncio.get_running_loop()
        ids = [m.peer_id for m in [*flood, good]]
        assert await checks[0].settle(ids, loop.time() + 5) == {good.peer_id}
        assert len(checks[0].failed()) == 4  # 4 of the flood; the expected peer on top of them
        checks[0].ask(7, [late], first={late.peer_id})  # budget spent by the flood: an expected peer still is asked
        assert await checks[0].settle([late.peer_id], loop.time() + 5) == {late.peer_id}
        checks[0].ask(7, flood)  # the budget of step 7 is spent
        assert len(checks[0].failed()) == 4 and not checks[0]._pending
        checks[0].ask(8, flood)  # a new step, a new budget (the failed ones are remembered)
        assert len(checks[0]._pending) == 4
    finally:
        for check in checks:
            check.close()
