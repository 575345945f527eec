"""Many SwarmNodes in one event loop over real sockets on 127.0.0.1 (hivemind's test swarms do
the same): a bootstrap DHT node, then nodes that share one corpus and record their events."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarm.dht import DHTConfig, DHTNode
from swarm.model.data import TokenData
from swarm.node import SwarmNode
from swarm.node.config import NodeConfig
from swarm.node.training_thread import DataTrainingThread, TrainingThreadFactory
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.identity import Identity

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
# the debug model and quick: short windows, a few inner steps, prompt progress records
QUICK = dict(model="debug", batch_size=2, seq_len=32, inner_steps=4, warmup_steps=2, eval_windows=2,
             matchmaking_time=3.0, publish_interval=0.5, max_wait=10.0, part_timeout=8.0)  # fmt: skip


@dataclass
class Running:
    node: SwarmNode
    stop: asyncio.Event
    task: asyncio.Task[str]
    events: list[dict[str, Any]] = field(default_factory=list)

    def steps(self) -> dict[int, dict[str, Any]]:
        return {e["outer_step"]: e for e in self.events if e["event"] == "outer_step"}


class LocalSwarm:
    """The nodes of one test; `close` stops every one of them, pass or fail."""

    def __init__(self, data: TokenData) -> None:
        self.data = data
        self.nodes: list[Running] = []
        self.bootstrap: tuple[P2PHost, DHTNode] | None = None

    async def start_bootstrap(self) -> str:
        host = await P2PHost(config=LOCAL).start()
        dht = await DHTNode(host=host).start()
        self.bootstrap = (host, dht)
        return host.visible_maddrs[0]

    def start(self, initial: tuple[str, ...], *, identity: Identity | None = None,
              on_event: Callable[[dict[str, Any]], None] | None = None,
              training_thread: TrainingThreadFactory = DataTrainingThread,
              dht_config: DHTConfig | None = None, **settings: Any) -> Running:  # fmt: skip
        """A node; its events are recorded, and also handed to `on_event` (a metrics subscriber).
        `training_thread`: its training thread (swarm-node's DataTrainingThread by default)."""
        config = NodeConfig(**{"run_id": "inproc", **QUICK, **settings})
        running: Running
        events: list[dict[str, Any]] = []

        def record(event: dict[str, Any]) -> None:
            events.append(event)
            if on_event is not None:
                on_event(event)

        node = SwarmNode(config, identity=identity, initial_peers=initial, p2p_config=LOCAL, on_event=record,
                         data=self.data, training_thread=training_thread, dht_config=dht_config)  # fmt: skip
        stop = asyncio.Event()
        running = Running(node, stop, asyncio.ensure_future(node.run(stop)), events)
        self.nodes.append(running)
        return running

    async def finish(self, timeout: float) -> list[str]:
        return list(await asyncio.wait_for(asyncio.gather(*(n.task for n in self.nodes)), timeout))

    def by_step(self) -> dict[int, set[str]]:
        """outer step -> the state hashes the nodes that completed it reported."""
        hashes: dict[int, set[str]] = defaultdict(set)
        for n in self.nodes:
            for step, event in n.steps().items():
                hashes[step].add(event["state_sha256"])
        return dict(hashes)

    def timeline(self) -> list[tuple[str, list[tuple[float, str, int, str, int | None]]]]:
        """Each node's rounds, steps and fetches, for a failure's message: (seconds since the
        first event, event, outer step, state or group id, group size)."""
        began = min((e["time"] for n in self.nodes for e in n.events), default=0.0)
        return [(str(n.node.peer_id)[-6:], [(round(e["time"] - began, 1), e["event"], e["outer_step"],
                                             str(e.get("state_sha256") or e.get("group_id") or "")[:6],
                                             e.get("group_size"))
                                            for e in n.events if e["event"] in ("round", "outer_step", "fetch")])
                for n in self.nodes]  # fmt: skip

    async def close(self) -> None:
        for n in self.nodes:
            n.stop.set()
        for n in self.nodes:
            if not n.task.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(n.task), 20)
            if not n.task.done():
                n.task.cancel()
        await asyncio.gather(*(n.task for n in self.nodes), return_exceptions=True)
        if self.bootstrap is not None:
            await self.bootstrap[1].close()
            await self.bootstrap[0].close()
