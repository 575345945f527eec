"""Averager.step end to end: matchmaking through the DHT, then the all-reduce."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.averaging.averager import Averager
from swarm.averaging.config import AveragingConfig
from swarm.dht import DHTNode
from swarm.p2p import P2PConfig, P2PHost

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))


async def test_four_nodes_average_their_tensors_in_one_step() -> None:
    hosts, dhts, averagers = [], [], []
    try:
        for i in range(4):
            host = await P2PHost(config=LOCAL).start()
            initial = hosts[0].visible_maddrs[:1] if hosts else []
            dht = await DHTNode(initial_peers=initial, host=host).start()
            config = AveragingConfig(matchmaking_time=1.0, request_timeout=1.0, block_size=256, chunk_elements=1024,
                                     client_mode=i == 3)  # fmt: skip
            hosts.append(host)
            dhts.append(dht)
            averagers.append(Averager(dht, host, "run", config))
        gen = torch.Generator().manual_seed(0)
        tensors = [[torch.randn(30, 40, generator=gen), torch.randn(17, generator=gen).to(torch.bfloat16)]
                   for _ in range(4)]  # fmt: skip
        weights = [1.0, 2.0, 3.0, 4.0]
        outcomes = await asyncio.gather(
            *(a.step(t, w, step=0) for a, t, w in zip(averagers, tensors, weights, strict=True))
        )
        first, report = outcomes[0]
        assert report.group_id is not None and len(report.members) == 4
        for averaged, other in outcomes[1:]:
            assert other.group_id == report.group_id
            assert all(torch.equal(a, b) for a, b in zip(averaged, first, strict=True))
        assert first[0].shape == (30, 40) and first[1].dtype == torch.bfloat16
        exact = sum(w * t[0] for w, t in zip(weights, tensors, strict=True)) / sum(weights)
        assert torch.allclose(first[0], exact, atol=0.05)
        assert report.matchmaking_s > 0 and report.bytes_sent > 0

        with pytest.raises(ValueError, match="non-finite"):
            await averagers[0].step([torch.tensor([float("nan")])], 1.0, step=1)
        alone, report = await averagers[0].step(tensors[0], 1.0, step=2)  # nobody else is ready
        assert report.group_id is None and torch.equal(alone[0], tensors[0][0])
    finally:
        for averager in averagers:
            averager.close()
        for dht in dhts:
            await dht.close()
        for host in hosts:
            await host.close()
