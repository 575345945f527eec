"""`dht.ages` (dht/serving.py, dht/ages.py) over real sockets: a DHT node says how long it has
known each asked peer (its routing table's first sight), nothing for a stranger, and refuses
malformed or oversized questions; a contact that is dropped and comes back starts again."""

from __future__ import annotations

import asyncio

import pytest

from swarm.dht import DHTNode
from swarm.dht import protocol as proto
from swarm.dht.ages import ages_known_by
from swarm.dht.routing import RoutingTable
from swarm.p2p import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))


async def test_a_node_tells_how_long_it_has_known_its_contacts() -> None:
    elder = await DHTNode(p2p_config=LOCAL).start()
    nodes = [await DHTNode(initial_peers=elder.visible_maddrs[:1], p2p_config=LOCAL).start() for _ in range(2)]
    asker = nodes[1]
    try:
        stranger = Identity.generate().peer_id
        first = await ages_known_by(asker, elder.visible_maddrs[0], [nodes[0].peer_id, stranger], 5)
        assert set(first) == {nodes[0].peer_id} and first[nodes[0].peer_id] >= 0  # a stranger: no answer
        await asyncio.sleep(0.3)  # the age is the point: it must grow with time
        later = await ages_known_by(asker, elder.visible_maddrs[0], [nodes[0].peer_id], 5)
        assert later[nodes[0].peer_id] >= first[nodes[0].peer_id] + 0.25
        assert await ages_known_by(asker, elder.visible_maddrs[0], [], 5) == {}
        # more than one question's worth: the known peer listed last after a crowd is still answered
        crowd = [Identity.generate().peer_id for _ in range(proto.MAX_AGE_QUERY + 5)]
        assert set(await ages_known_by(asker, elder.visible_maddrs[0], [*crowd, nodes[0].peer_id], 5)) == {
            nodes[0].peer_id
        }
        maddr = elder.visible_maddrs[0]
        for bad in (
            {"peers": [b"x"] * (proto.MAX_AGE_QUERY + 1)},
            {"peers": ["text"]},
            {"peers": [b"not a peer"]},
            [1],
        ):
            with pytest.raises(P2PError):
                await asker.transport.call_maddr(maddr, proto.AGES, bad, 5)
    finally:
        await asyncio.gather(*(n.close() for n in [*nodes, elder]))


def test_a_dropped_contact_starts_its_seniority_again() -> None:
    me, peer = Identity.generate().peer_id, Identity.generate().peer_id
    table = RoutingTable(me.dht_id, k=4)
    table.add(peer, ("/ip4/127.0.0.1/tcp/1",), now=10.0)
    table.add(peer, ("/ip4/127.0.0.1/tcp/1",), now=50.0)  # seen again: still known since 10
    assert table.age(peer, now=60.0) == 50.0
    table.remove(peer)
    assert table.age(peer, now=60.0) is None
    table.add(peer, ("/ip4/127.0.0.1/tcp/1",), now=70.0)
    assert table.age(peer, now=75.0) == 5.0
