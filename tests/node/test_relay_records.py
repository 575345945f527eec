"""Relays learned from the DHT (swarm/node/relay_records.py, RelayKeeper's discovery): records are
checked and drawn one per source at random; a NATed node holds two relays found by measured RTT,
one of them learned from the DHT among a flood of fake records, and stays reachable through it
when its bootstrap relay dies. Real hosts and DHT nodes on 127.0.0.x in one event loop."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from swarm.dht import DHTConfig, DHTNode, Record, owner_subkey
from swarm.dht.id_proof import solve
from swarm.node.reachability import NodeReach
from swarm.node.relay_records import RELAYS_KEY, choose_relays, decode_relay, find_relays, relay_record
from swarm.p2p import CallContext, P2PConfig, P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import TcpAddress, parse_address
from swarm.p2p.relay import RelayConfig
from tests.averaging.test_ready import failing_nonce
from tests.waiting import until

BITS = DHTConfig().id_bits  # the tests' (conftest.py), as every node here uses
ONE = Identity.generate()
OWNER = ONE.peer_id
NONCE = solve(ONE.peer_id, BITS)
ID = [Identity.generate().peer_id for _ in range(6)]


def at(host: str, peer: int, port: int = 1) -> TcpAddress:
    return TcpAddress("ip4", host, port, ID[peer])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"], "proof": NONCE}, f"/ip4/1.2.3.4/tcp/5/p2p/{OWNER}"),
        ({"maddrs": [f"/ip4/1.2.3.4/tcp/5/p2p/{OWNER}"], "proof": NONCE}, f"/ip4/1.2.3.4/tcp/5/p2p/{OWNER}"),
        # a circuit is no relay (circuits do not chain); an address naming another peer is not the owner's
        ({"maddrs": [f"/ip4/1.2.3.4/tcp/5/p2p/{ID[0]}/p2p-circuit/p2p/{OWNER}"], "proof": NONCE}, None),
        (
            {"maddrs": [f"/ip4/1.2.3.4/tcp/5/p2p/{ID[0]}", "/ip4/5.6.7.8/tcp/9"], "proof": NONCE},
            f"/ip4/5.6.7.8/tcp/9/p2p/{OWNER}",
        ),
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"], "proof": failing_nonce(ONE.peer_id, BITS)}, None),  # no costly id
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"]}, None),
        ({"maddrs": "/ip4/1.2.3.4/tcp/5", "proof": NONCE}, None),
        ({"maddrs": [7, "nonsense", "x" * 5000], "proof": NONCE}, None),
        (["/ip4/1.2.3.4/tcp/5"], None),
        ({"maddrs": [], "proof": NONCE}, None),
    ],
    ids=[
        "plain",
        "named",
        "circuit",
        "skips-another-peers",
        "unproven",
        "no-proof",
        "not-a-list",
        "junk",
        "not-a-map",
        "empty",
    ],
)
def test_a_relay_record_names_a_direct_address_of_its_owner_with_a_costly_id(value: Any, expected: str | None) -> None:
    found = decode_relay(owner_subkey(ONE.peer_id), value, BITS)
    assert (found.to_maddr() if found is not None else None) == expected
    assert decode_relay("not-an-owner", value, BITS) is None


def test_our_record_lists_direct_addresses_only() -> None:
    circuit = f"/ip4/1.2.3.4/tcp/5/p2p/{ID[0]}/p2p-circuit/p2p/{OWNER}"
    record = relay_record([circuit, "/ip4/9.9.9.9/tcp/1", "nonsense"], NONCE)
    assert record == {"maddrs": ["/ip4/9.9.9.9/tcp/1"], "proof": NONCE}


@pytest.mark.parametrize(
    ("relays", "exclude", "limit", "expected_sources"),
    [
        # identities of one machine share one draw: 3 records at 10.0.0.1 count as one source
        ([at("10.0.0.1", 0), at("10.0.0.1", 1), at("10.0.0.1", 2), at("10.0.0.2", 3)], [], 8, 2),
        ([at("10.0.0.1", 0), at("10.0.0.2", 1), at("10.0.0.3", 2)], [ID[1]], 8, 2),  # the relays we hold
        ([at(f"10.0.0.{i}", i) for i in range(6)], [], 4, 4),  # at most `limit`
        ([at("2001:db8::1", 0), at("2001:db8::2", 1), at("2001:db9::1", 2)], [], 8, 2),  # an IPv6 /64 is one
        ([], [], 8, 0),
    ],
    ids=["one-per-source", "exclude", "limit", "ipv6-64", "none"],
)
def test_relays_are_drawn_one_per_source_at_random(
    relays: list[TcpAddress], exclude: list[Any], limit: int, expected_sources: int
) -> None:
    relays = [TcpAddress("ip6" if ":" in r.host else "ip4", r.host, r.port, r.peer_id) for r in relays]
    draws = [choose_relays(relays, exclude=exclude, limit=limit, rng=random.Random(seed)) for seed in range(30)]
    for drawn in draws:
        assert len(drawn) == expected_sources
        assert not {r.peer_id for r in drawn} & set(exclude)
        hosts = [r.host if r.host_protocol == "ip4" else r.host.rsplit(":", 2)[0] for r in drawn]
        assert len(set(hosts)) == len(hosts)
    if relays and expected_sources:  # random: across draws, every record of the first source comes up
        first = relays[0].host
        assert {r.peer_id for d in draws for r in d if r.host == first} == {
            r.peer_id for r in relays if r.host == first and r.peer_id not in exclude
        }


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"echo": args, "via": ctx.remote_address[0]}


class Relaying:
    """A reachable node at `address`: a host, a DHT node and a NodeReach that relays and lists itself."""

    def __init__(self, host: P2PHost, dht: DHTNode, reach: NodeReach) -> None:
        self.host, self.dht, self.reach = host, dht, reach

    @classmethod
    async def start(cls, address: str, initial_peers: list[str]) -> Relaying:
        host = await P2PHost(config=P2PConfig(host_maddrs=(f"/ip4/{address}/tcp/0",))).start()
        dht = await DHTNode(host=host, initial_peers=initial_peers).start()
        reach = await NodeReach(host, nated=False, relays=[], relay=RelayConfig()).start()
        reach.use_dht(dht)
        return cls(host, dht, reach)

    async def close(self) -> None:
        await self.reach.close()
        await self.dht.close()
        await self.host.close()


@pytest.fixture
async def closers() -> AsyncIterator[list[Any]]:
    items: list[Any] = []
    yield items
    for item in reversed(items):
        await item.close()


async def store_fakes(dht: DHTNode, count: int) -> None:
    """`count` relay records of fresh identities with valid proofs, each at its own address where
    nothing listens (127.0.1.k, a closed port): a flood only a ping or a reservation tells apart."""
    fakes = [Identity.generate() for _ in range(count)]
    records = [Record.create(RELAYS_KEY, owner_subkey(f.peer_id),
                             relay_record([f"/ip4/127.0.1.{k + 1}/tcp/9"], solve(f.peer_id, BITS)), time.time() + 60, f)
               for k, f in enumerate(fakes)]  # fmt: skip
    assert await dht.search.store_records(RELAYS_KEY, records) > 0


@pytest.mark.timeout(90)
async def test_a_natted_node_learns_a_relay_among_fakes_and_stays_reachable_when_its_bootstrap_dies(
    closers: list[Any],
) -> None:
    bootstrap = await Relaying.start("127.0.0.1", [])
    closers.append(bootstrap)
    entry = bootstrap.host.visible_maddrs[0]
    other = await Relaying.start("127.0.0.2", [entry])
    closers.append(other)
    flooder = await DHTNode(initial_peers=[entry], p2p_config=P2PConfig(host_maddrs=("/ip4/127.0.0.3/tcp/0",))).start()
    closers.append(flooder)
    await store_fakes(flooder, 15)  # one source may store at most 16 entries of a key (dht/quotas.py)

    async def all_records() -> list[str] | None:
        found = await find_relays(flooder, limit=64)
        return found if len(found) == 17 else None  # two real relays, 15 fakes: 17 sources

    await until(all_records, 30, "the relays' records and the fakes in the DHT", poll=0.2)

    host = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), reuse_port=True)).start()
    closers.append(host)
    host.add_handler("demo.echo", echo)
    reach = await NodeReach(host, nated=True, relays=[entry], relay=RelayConfig()).start()
    closers.append(reach)
    assert await reach.reserve(within=10)
    assert reach.keeper is not None and list(reach.keeper.held) == [bootstrap.host.peer_id]  # its initial peer
    dht = await DHTNode(host=host, initial_peers=[entry], client_mode=True).start()
    closers.insert(closers.index(reach), dht)  # closed after the NodeReach that uses it
    reach.use_dht(dht)
    # the second relay is learned from the DHT: 8 of 16 sources drawn per pass, and the fakes
    # that did not answer are not drawn again, so it is found within two passes
    await until(lambda: len(reach.keeper.held) == 2, 30, "a reservation on the relay learned from the DHT")
    assert set(reach.keeper.held) == {bootstrap.host.peer_id, other.host.peer_id}
    assert len([m for m in host.visible_maddrs if "/p2p-circuit/" in m]) == 2

    await bootstrap.close()  # the bootstrap relay dies
    closers.remove(bootstrap)
    await until(lambda: list(reach.keeper.held) == [other.host.peer_id], 10, "the dead relay's reservation dropped")
    [relayed] = host.visible_maddrs
    assert relayed.startswith(other.host.visible_maddrs[0] + "/p2p-circuit/")
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.4/tcp/0",))) as dialer:
        reply = await dialer.call(relayed, "demo.echo", 7, timeout=10)
    assert reply == {"echo": 7, "via": f"{other.host.peer_id}/p2p-circuit"}
    assert parse_address(relayed).peer_id == host.peer_id


@pytest.mark.timeout(60)
async def test_a_natted_node_whose_initial_peer_does_not_relay_reserves_on_a_relay_the_dht_names(
    closers: list[Any],
) -> None:
    """The bootstrap is a plain DHT node (swarm-dht serve --relay off): it refuses reservations.
    Once the NATed node has the DHT, its reservation waits for the relays the records name
    instead of giving up on the bootstrap's refusal (and the node running in client mode)."""
    host = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    bootstrap = await DHTNode(host=host).start()
    closers.extend([host, bootstrap])
    entry = host.visible_maddrs[0]
    relay = await Relaying.start("127.0.0.2", [entry])
    closers.append(relay)
    await until(lambda: find_relays(bootstrap), 30, "the relay's record in the DHT", poll=0.2)

    nated_host = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.3/tcp/0",), reuse_port=True)).start()
    closers.append(nated_host)
    reach = await NodeReach(nated_host, nated=True, relays=[entry], relay=RelayConfig()).start()
    closers.append(reach)
    assert not await reach.reserve(within=10)  # its only initial peer refused, and it has no DHT yet
    dht = await DHTNode(host=nated_host, initial_peers=[entry], client_mode=True).start()
    closers.insert(closers.index(reach), dht)  # closed after the NodeReach that uses it
    reach.use_dht(dht)
    assert await reach.reserve(within=10)
    assert reach.keeper is not None and list(reach.keeper.held) == [relay.host.peer_id]
    [relayed] = nated_host.visible_maddrs
    assert relayed.startswith(relay.host.visible_maddrs[0] + "/p2p-circuit/")
