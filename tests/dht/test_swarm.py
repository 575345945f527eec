"""Many real DHT nodes in one process on 127.0.0.1: one swarm (not islands) from a single
bootstrap node, and gets that survive a quarter of the nodes dying."""

from __future__ import annotations

import asyncio
import random
import time

from swarm.dht import DHTConfig, DHTNode
from tests.dht.conftest import MakeNode


async def get_all(nodes: list[DHTNode], keys: dict[str, int]) -> tuple[int, int]:
    """(found, asked) over every node getting every key; a wrong value counts as not found."""
    found = asked = 0
    for node in nodes:
        results = await asyncio.gather(*(node.get(key) for key in keys))
        for (_key, expected), result in zip(keys.items(), results, strict=True):
            asked += 1
            found += result is not None and result.value == expected
    return found, asked


async def test_one_swarm_from_a_single_bootstrap_node_even_after_it_leaves(make_node: MakeNode) -> None:
    bootstrap = await make_node()
    nodes = [await make_node(bootstrap.visible_maddrs) for _ in range(15)]
    expiration = time.time() + 120
    keys = {f"before/{i}": i for i in range(len(nodes))}
    for node, (key, value) in zip(nodes, keys.items(), strict=True):
        assert await node.store(key, value, expiration) > 0
    for node in nodes:
        assert len(node.table) >= len(nodes) - 1, "every node should know every other one"
    found, asked = await get_all(nodes, keys)
    assert found == asked

    await bootstrap.close()
    later = {f"after/{i}": -i for i in range(len(nodes))}
    for node, (key, value) in zip(nodes, later.items(), strict=True):
        assert await node.store(key, value, expiration) > 0
    found, asked = await get_all(nodes, {**keys, **later})
    assert found == asked
    # a newcomer that knows only one of the survivors reaches everything too
    newcomer = await make_node(nodes[-1].visible_maddrs)
    found, asked = await get_all([newcomer], {**keys, **later})
    assert found == asked


async def test_gets_survive_a_quarter_of_the_nodes_dying(make_node: MakeNode) -> None:
    rng = random.Random(7)
    config = DHTConfig(rpc_timeout=1.0)
    nodes = [await make_node(config=config)]
    for _ in range(31):
        nodes.append(await make_node(rng.choice(nodes).visible_maddrs, config=config))
    expiration = time.time() + 120
    keys = {f"value/{i}": i for i in range(len(nodes))}
    for node, (key, value) in zip(nodes, keys.items(), strict=True):
        assert await node.store(key, value, expiration) > 0
    # before the churn, each key is read back by a node that did not store it (the test above has
    # every node read every key): the gets after it then fail only for the churn's sake
    readers = nodes[1:] + nodes[:1]
    results = await asyncio.gather(*(reader.get(key) for reader, key in zip(readers, keys, strict=True)))
    assert [r.value if r is not None else None for r in results] == list(keys.values())

    dead = rng.sample(nodes, len(nodes) // 4)
    await asyncio.gather(*(node.close() for node in dead))
    survivors = [node for node in nodes if node not in dead]
    start = time.perf_counter()
    found, asked = await get_all(survivors, keys)  # records of the dead live on in their replicas
    assert found / asked >= 0.99, f"{found}/{asked} gets succeeded after 25% churn"
    assert time.perf_counter() - start < 30
