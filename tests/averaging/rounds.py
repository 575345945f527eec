"""What the all-reduce tests share: a group member on 127.0.0.1, inputs, the exact mean, bounds.
The make_group fixture that builds members lives in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import torch

from swarm.averaging.averager import Averager
from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds.registry import RoundRegistry
from swarm.dht import DHTNode
from swarm.p2p import P2PConfig, P2PHost

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
# Tests of the all-reduce's arithmetic compare with the exact weighted mean: their inputs (norms
# 1x..nx, independent directions) are outliers to the robust rule, which would clip them.
EXACT = {"aggregator": "mean"}


@dataclass
class Member:
    host: P2PHost
    registry: RoundRegistry
    config: AveragingConfig


MakeGroup = Callable[..., Awaitable[tuple[GroupInfo, list[Member]]]]


def inputs(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * (i + 1) for i in range(n)]


def exact_mean(vectors: list[torch.Tensor], group: GroupInfo, included: list[int] | None = None) -> torch.Tensor:
    idx = included if included is not None else range(len(vectors))
    weights = torch.tensor([group.members[i].weight for i in idx], dtype=torch.float64)
    stacked = torch.stack([vectors[i].double() for i in idx])
    return (stacked * weights[:, None]).sum(0) / weights.sum()


def int8_bound(vectors: list[torch.Tensor], mean: torch.Tensor) -> float:
    """Each sender's codes are off by at most half a scale (absmax/127), and so is the average's."""
    return max(v.abs().max().item() for v in vectors) / 127 / 2 + mean.abs().max().item() / 127 / 2 + 1e-6


@contextlib.asynccontextmanager
async def averagers(
    n: int, config: AveragingConfig, run_id: str = "run", *, joined: bool = False
) -> AsyncIterator[list[Averager]]:
    """n Averagers of one run, each on its own host and DHT node on 127.0.0.1; closed after.
    `joined`: their DHT nodes join the first one's, so that they can matchmake (form_group)."""
    hosts = [await P2PHost(config=LOCAL).start() for _ in range(n)]
    dhts: list[DHTNode] = []
    for h in hosts:
        initial = hosts[0].visible_maddrs[:1] if joined and dhts else []
        dhts.append(await DHTNode(initial_peers=initial, host=h).start())
    made = [Averager(d, h, run_id, config) for d, h in zip(dhts, hosts, strict=True)]
    try:
        yield made
    finally:
        for a in made:
            a.close()
        await asyncio.gather(*(d.close() for d in dhts))
        await asyncio.gather(*(h.close() for h in hosts))
