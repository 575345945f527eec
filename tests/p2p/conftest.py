"""Fixtures of the p2p tests (which run on both event loops: see tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from swarm.p2p import P2PConfig, P2PHost

LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def local_config(**overrides: object) -> P2PConfig:
    return P2PConfig(host_maddrs=LOCAL, **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def make_host() -> AsyncIterator[Callable[..., object]]:
    """Factory of started hosts on 127.0.0.1; all are closed after the test, then the test
    fails if any task is left behind."""
    hosts: list[P2PHost] = []
    before = asyncio.all_tasks()

    async def make(**overrides: object) -> P2PHost:
        host = await P2PHost(config=local_config(**overrides)).start()
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        await host.close()
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    assert not leaked, f"tasks leaked: {leaked}"
