"""Simulated DHTs: the real DHTNode code over MemoryNetwork (no sockets), for thousands of
nodes in one process. Used by scripts/bench/dht.py --simulate and by the tests.

Each node joins through one random earlier node, exactly as over TCP; then random nodes store
and get random keys, and we count lookup rounds (hops) and successes; then a fraction of the
nodes stops at once and the survivors get everything again. Unless a config says otherwise, ids
carry no proof of work (id_bits=0): 10,000 seconds of hashing would measure nothing here.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import time
from dataclasses import dataclass

from swarm.dht.config import DHTConfig
from swarm.dht.node import DHTNode
from swarm.dht.transport import MemoryNetwork
from swarm.p2p.peer_id import PeerID


@dataclass(frozen=True, slots=True)
class SimulationReport:
    n: int
    join_s: float  # wall time for all nodes to join, one after another
    get_rounds_mean: float
    get_rounds_p99: float
    get_success: float
    store_replicas_mean: float
    churn_get_success: float
    messages_per_get: float
    wall_s: float


def _p99(values: list[int]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else float(values[0])


async def simulate(
    n: int, *, keys: int = 200, gets: int = 1000, churn: float = 0.25, seed: int = 0, config: DHTConfig | None = None
) -> SimulationReport:
    rng = random.Random(seed)
    start = time.perf_counter()
    network = MemoryNetwork()
    config = config or DHTConfig(id_bits=0)  # ids need no proof of work among simulated nodes
    nodes: list[DHTNode] = []
    gc.disable()  # tens of millions of small objects: the cyclic collector would dominate the run
    try:
        for _ in range(n):
            peer_id = PeerID.from_public_key(rng.randbytes(32) if hasattr(rng, "randbytes") else os.urandom(32))
            initial = [rng.choice(nodes).visible_maddrs[0]] if nodes else []
            node = DHTNode(initial_peers=initial, transport=network.transport(peer_id), config=config)
            nodes.append(await node.start())
        joined = time.perf_counter()

        expiration = time.time() + 3600
        stored: dict[str, int] = {}
        replicas = []
        for i in range(keys):
            key = f"sim/{i}"
            replicas.append(await rng.choice(nodes).store(key, i, expiration))
            stored[key] = i

        async def get_phase(alive: list[DHTNode], count: int) -> tuple[float, list[int], float]:
            found, rounds = 0, []
            calls_before = network.calls
            for _ in range(count):
                key = rng.choice(list(stored))
                result = await rng.choice(alive).lookup_value(key)
                records = result.records(time.time())
                found += bool(records) and records[0].value == _packed(stored[key])
                rounds.append(result.rounds)
            return found / count, rounds, (network.calls - calls_before) / count

        get_success, rounds, messages = await get_phase(nodes, gets)
        dead = rng.sample(range(n), int(n * churn))
        for index in dead:
            network.stop(nodes[index].peer_id)
        dead_set = set(dead)
        survivors = [node for i, node in enumerate(nodes) if i not in dead_set]
        churn_success, _, _ = await get_phase(survivors, gets)
    finally:
        await asyncio.gather(*(node.close() for node in nodes))
        gc.enable()
    return SimulationReport(
        n=n,
        join_s=joined - start,
        get_rounds_mean=statistics.fmean(rounds),
        get_rounds_p99=_p99(rounds),
        get_success=get_success,
        store_replicas_mean=statistics.fmean(replicas),
        churn_get_success=churn_success,
        messages_per_get=messages,
        wall_s=time.perf_counter() - start,
    )


def _packed(value: int) -> bytes:
    from swarm.dht.records import pack_value

    return pack_value(value)
