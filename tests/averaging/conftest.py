"""The make_group fixture: n members of one group, each a P2PHost on 127.0.0.1 (port 0) with
its RoundRegistry, closed after the test."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.rounds.registry import RoundRegistry
from swarm.p2p import P2PHost
from tests.averaging.rounds import LOCAL, MakeGroup, Member


@pytest.fixture
async def make_group() -> AsyncIterator[MakeGroup]:
    members: list[Member] = []

    async def make(
        n: int,
        *,
        clients: int = 0,
        weights: list[float] | None = None,
        bandwidths: list[float] | None = None,
        **overrides: object,
    ) -> tuple[GroupInfo, list[Member]]:
        """The last `clients` members are in client mode; weights and bandwidths are drawn
        (seeded by n) unless given."""
        made, infos = [], []
        rng = random.Random(n)
        for i in range(n):
            client = i >= n - clients
            settings = {"part_timeout": 10.0, "request_timeout": 2.0, **overrides}
            config = AveragingConfig(client_mode=client, **settings)  # type: ignore[arg-type]
            host = await P2PHost(config=LOCAL).start()
            member = Member(host, RoundRegistry(host, config), config)
            members.append(member)
            made.append(member)
            weight = weights[i] if weights else rng.uniform(0.5, 2.0)
            bandwidth = 0.0 if client else bandwidths[i] if bandwidths else rng.uniform(50, 150)
            maddrs = () if client else tuple(host.visible_maddrs)
            infos.append(MemberInfo(host.peer_id, maddrs, weight, bandwidth, client))
        return GroupInfo.create("run", 0, tuple(infos)), made

    yield make
    for member in members:
        member.registry.close()
    await asyncio.gather(*(m.host.close() for m in members))
