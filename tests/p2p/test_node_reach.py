"""A node's reachability for a run (swarm/node/reachability.py) on 127.0.0.1: a reachable node
relays, a NATed one reserves on its initial peers, announces its relayed address only and is
called through it (by the DHT's transport too), and one that no relay takes says it is relayed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from swarm.dht.transport import P2PTransport
from swarm.node.reachability import NodeReach, relay_candidates
from swarm.p2p import CallContext, P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.reach import DIRECT, PUNCHED, RELAYED
from swarm.p2p.relay import RelayConfig
from swarm.p2p.relay_wire import PING, VERSION

Factory = Callable[..., Any]
IDS = [Identity.generate().peer_id for _ in range(2)]


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"echo": args, "via": ctx.remote_address[0]}


@pytest.mark.parametrize(
    ("peers", "relays"),
    [
        ([f"/ip4/1.2.3.4/tcp/1/p2p/{IDS[0]}"], [0]),
        (["/ip4/1.2.3.4/tcp/1"], []),  # a relay must be named by its PeerID: its answer is checked
        ([f"/ip4/1.2.3.4/tcp/1/p2p/{IDS[0]}/p2p-circuit/p2p/{IDS[1]}"], []),  # circuits do not chain
        (["nonsense", f"/dns4/relay.example/tcp/1/p2p/{IDS[1]}"], [1]),
        ([], []),
    ],
    ids=["named", "anonymous", "relayed", "nonsense-then-dns", "none"],
)
def test_a_node_reserves_on_the_initial_peers_that_can_be_relays(peers: list[str], relays: list[int]) -> None:
    assert relay_candidates(peers) == [peers[i] for i in relays]


@pytest.mark.timeout(30)
async def test_a_reachable_node_relays_and_a_natted_one_is_called_through_it(make_host: Factory) -> None:
    relay, target, dialer = await make_host(), await make_host(reuse_port=True), await make_host()
    target.add_handler("demo.echo", echo)
    async with NodeReach(relay, nated=False, relays=[], relay=RelayConfig()) as serving:
        assert serving.reach() == DIRECT and await serving.reserve()
        assert (await dialer.call(relay.visible_maddrs[0], PING, {"v": VERSION}, timeout=5))["v"] == VERSION
        async with NodeReach(target, nated=True, relays=[relay.visible_maddrs[0]], relay=RelayConfig()) as nated:
            assert nated.service is None  # a NATed node relays for nobody
            assert await nated.reserve(within=10)
            [relayed] = target.visible_maddrs  # only the relayed address: nobody can dial the others
            assert relayed.endswith(f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{target.peer_id}")
            # loopback keeps the listening port, as a cone NAT does: punches would work
            assert nated.reach() == PUNCHED
            reply = await P2PTransport(dialer).call(target.peer_id, (relayed,), "demo.echo", 7, 10)
            assert reply == {"echo": 7, "via": f"{relay.peer_id}/p2p-circuit"}
        assert target.visible_maddrs == []  # its reservation ended with it


@pytest.mark.timeout(30)
async def test_a_natted_node_that_no_relay_takes_is_relayed_and_reserves_nothing(make_host: Factory) -> None:
    plain, target = await make_host(), await make_host(reuse_port=True)
    async with NodeReach(target, nated=True, relays=[], relay=RelayConfig()) as alone:
        assert not await alone.reserve(within=0.1) and alone.reach() == RELAYED
    # a peer that serves no relay refuses every reservation: the node gives up after `within`
    async with NodeReach(target, nated=True, relays=[plain.visible_maddrs[0]], relay=None) as refused:
        assert not await refused.reserve(within=1.0) and refused.reach() == RELAYED


async def test_hole_punching_needs_a_host_that_dials_from_its_listening_port(make_host: Factory) -> None:
    host: P2PHost = await make_host()
    with pytest.raises(ValueError, match="reuse_port"):
        NodeReach(host, nated=True, relays=[], relay=None)
