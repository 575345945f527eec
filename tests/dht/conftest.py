"""Fixtures of the DHT tests: real nodes on 127.0.0.1, closed after each test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from swarm.dht import DHTNode
from swarm.p2p import P2PConfig

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
MakeNode = Callable[..., Awaitable[DHTNode]]


@pytest.fixture
async def make_node() -> AsyncIterator[MakeNode]:
    """make_node(initial_peers=(), **DHTNode kwargs): a started node; all are closed afterwards."""
    nodes: list[DHTNode] = []

    async def make(initial_peers: list[str] = (), **kwargs: object) -> DHTNode:  # type: ignore[assignment]
        node = await DHTNode(initial_peers=initial_peers, p2p_config=LOCAL, **kwargs).start()  # type: ignore[arg-type]
        nodes.append(node)
        return node

    yield make
    await asyncio.gather(*(node.close() for node in nodes))
