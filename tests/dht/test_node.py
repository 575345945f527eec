"""DHTNode behaviours over real sockets on 127.0.0.1: expiry, subkeys from several owners,
caching on the lookup path, republishing, bucket refresh, client mode, the thread facade, and
the simulator's hop counts."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm.dht import DHT, BadSignature, DHTConfig, DHTNode, owner_subkey
from swarm.dht.ids import key_id
from swarm.dht.simulation import simulate
from swarm.dht.storage import RecordStorage
from tests.dht.conftest import LOCAL, MakeNode
from tests.waiting import until


async def test_expired_records_are_never_returned(make_node: MakeNode) -> None:
    a = await make_node()
    b = await make_node(a.visible_maddrs)
    expiration = time.time() + 1.0  # time enough to read it back on a loaded machine
    await a.store("short", "lived", expiration)
    found = await b.get("short")
    assert found is not None and found.value == "lived"
    await until(lambda: time.time() > expiration, 5, "the record's expiration")
    assert await b.get("short") is None
    assert await b.get("short", latest=True) is None


async def test_subkeys_of_several_owners_merge_and_nobody_writes_anothers(make_node: MakeNode) -> None:
    a = await make_node()
    nodes = [a] + [await make_node(a.visible_maddrs) for _ in range(3)]
    expiration = time.time() + 60
    for i, node in enumerate(nodes):
        assert await node.store("run/ready", {"i": i}, expiration, subkey=owner_subkey(node.peer_id))
    found = await nodes[2].get("run/ready", latest=True)
    assert found is not None
    assert {sub: v.value["i"] for sub, v in found.value.items()} == {
        owner_subkey(node.peer_id): i for i, node in enumerate(nodes)
    }
    with pytest.raises(BadSignature):
        await nodes[1].store("run/ready", {"i": 99}, expiration + 10, subkey=owner_subkey(a.peer_id))
    # a newer record by the owner replaces its older one everywhere it is asked
    await a.store("run/ready", {"i": 100}, expiration + 10, subkey=owner_subkey(a.peer_id))
    found = await nodes[3].get("run/ready", latest=True)
    assert found is not None and found.value[owner_subkey(a.peer_id)].value == {"i": 100}


async def test_a_get_caches_the_value_on_the_closest_node_without_it(make_node: MakeNode) -> None:
    config = DHTConfig(k=2, alpha=1, disjoint_paths=1)  # the paper's single lookup: k replicas
    first = await make_node(config=config)
    nodes = [first] + [await make_node(first.visible_maddrs, config=config) for _ in range(7)]
    for node in nodes:  # everyone knows everyone: lookups go straight to the two replicas
        await node.find_node(node.node_id)
    await nodes[0].store("cached", 42, time.time() + 60)
    holders = [n for n in nodes if n.storage.get("cached", time.time())]
    assert len(holders) == 2
    target = key_id("cached")
    others = sorted((n for n in nodes if n not in holders), key=lambda n: n.node_id ^ target)
    holder_ids = {h.peer_id for h in holders}
    by_peer = {n.peer_id: n for n in nodes}

    def first_hop_knows_a_holder(candidate: DHTNode) -> bool:
        # buckets of k = 2 do not hold everyone: the reader's first hop (its closest contact to
        # the key, holders aside) must know a holder, or the single path cannot reach one
        hops = [c for c in candidate.table.closest(target, len(nodes)) if c.peer_id not in holder_ids]
        return bool(hops) and any(h in by_peer[hops[0].peer_id].table for h in holder_ids)

    reader = next((n for n in reversed(others) if first_hop_knows_a_holder(n)), None)
    assert reader is not None, "no node's first hop knows a holder (buckets of 2)"
    for holder in holders:  # the reader must go through other nodes: the path that gets a copy
        reader.table.remove(holder.peer_id)
    result = await reader.lookup_value("cached")
    assert result.holders and result.records(time.time())[0].value
    caching = set(reader._tasks)  # the cache store is fire-and-forget: wait for it (a second was
    assert caching  # not always enough on a loaded CI machine)
    await asyncio.wait(caching, timeout=30)
    cached_on = [n for n in others if n.cache.get("cached", time.time())]
    assert cached_on and all(n is not reader for n in cached_on)


async def test_owners_republish_records_a_replica_lost(make_node: MakeNode) -> None:
    config = DHTConfig(republish_interval=0.3, maintenance_jitter=0.0)
    a = await make_node(config=config)
    b = await make_node(a.visible_maddrs, config=config)
    await a.store("kept", "alive", time.time() + 60)
    assert b.storage.get("kept", time.time())
    b.storage = RecordStorage(config.max_records, config.max_subkeys_per_key)  # b restarts empty
    await until(lambda: b.storage.get("kept", time.time()), 5, "a to republish its record")


async def test_stale_buckets_are_refreshed(make_node: MakeNode) -> None:
    config = DHTConfig(refresh_interval=0.3, maintenance_jitter=0.0)
    a = await make_node(config=config)
    b = await make_node(a.visible_maddrs, config=config)
    for bucket in b.table.buckets:
        bucket.last_updated = 0.0
    await until(lambda: all(bucket.last_updated > 0 for bucket in b.table.buckets), 5, "b to refresh its buckets")
    assert a.peer_id in b.table


async def test_a_client_mode_node_uses_the_dht_but_is_in_no_routing_table(make_node: MakeNode) -> None:
    a = await make_node()
    b = await make_node(a.visible_maddrs)
    client = await make_node(a.visible_maddrs, client_mode=True)
    assert await client.store("from-client", 1, time.time() + 60) == 2
    assert not client.storage.get("from-client", time.time())
    found = await client.get("from-client")
    assert found is not None and found.value == 1
    assert client.peer_id not in a.table and client.peer_id not in b.table


def test_the_thread_facade_serves_code_that_is_not_async() -> None:
    with DHT(p2p_config=LOCAL) as first, DHT(initial_peers=first.visible_maddrs, p2p_config=LOCAL) as second:
        assert second.store("sync", [1, 2], time.time() + 60) >= 1
        found = first.get("sync")
        assert found is not None and found.value == [1, 2]
        assert second.run_coroutine(lambda node: node.find_node(node.node_id))[0].peer_id == first.peer_id


async def test_simulated_lookups_take_few_rounds_and_always_succeed() -> None:
    # 300 nodes are enough to need a second round where 40 never do: over seeds 0-2 the large swarm's
    # mean was 1.04-1.15 rounds (600 nodes: 1.35) against 1.0, every get and churned get succeeding,
    # at half the CPU of 600 nodes (about 2.8 s against 5).
    small = await simulate(40, keys=20, gets=100)
    large = await simulate(300, keys=20, gets=100)
    assert small.get_success == large.get_success == 1.0
    assert large.churn_get_success >= 0.99
    assert 20 <= small.store_replicas_mean <= 3 * 20  # k on each of the 3 disjoint paths, at most
    assert 1 <= small.get_rounds_mean <= large.get_rounds_mean <= 4
