"""Matchmaking over real DHT nodes on 127.0.0.1: agreement, splitting, late nodes, a leader that
dies mid-matchmaking, client-mode members."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from swarm.averaging.config import AveragingConfig
from swarm.averaging.matchmaking import Matchmaker
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.dht import DHTNode
from swarm.p2p import P2PConfig, P2PHost

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
FAST = {"matchmaking_time": 1.5, "request_timeout": 2.0}


@dataclass
class Peer:
    host: P2PHost
    dht: DHTNode
    matchmaker: Matchmaker
    client: bool

    def me(self) -> MemberInfo:
        maddrs = () if self.client else tuple(self.host.visible_maddrs)
        return MemberInfo(self.host.peer_id, maddrs, 1.0, 0.0 if self.client else 100.0, self.client)

    async def close(self) -> None:
        self.matchmaker.close()
        await self.dht.close()
        await self.host.close()


MakePeers = Callable[..., Awaitable[list[Peer]]]


@pytest.fixture
async def make_peers() -> AsyncIterator[MakePeers]:
    peers: list[Peer] = []

    async def make(count: int, *, clients: int = 0, **overrides: object) -> list[Peer]:
        made = []
        for i in range(count + clients):
            client = i >= count
            host = await P2PHost(config=LOCAL).start()
            initial = peers[0].host.visible_maddrs[:1] if peers else []
            dht = await DHTNode(initial_peers=initial, host=host, client_mode=client).start()
            config = AveragingConfig(client_mode=client, **{**FAST, **overrides})  # type: ignore[arg-type]
            peer = Peer(host, dht, Matchmaker(dht, host, "run", config), client)
            peers.append(peer)
            made.append(peer)
        return made

    yield make
    await asyncio.gather(*(peer.close() for peer in peers), return_exceptions=True)


def check_agreement(groups: list[GroupInfo | None], peers: list[Peer]) -> list[GroupInfo]:
    """Every member of a group got the very same group; nobody is in two groups."""
    distinct = {g.group_id: g for g in groups if g is not None}
    seen: set[object] = set()
    for group in distinct.values():
        for member in group.members:
            assert member.peer_id not in seen, "a node is in two groups"
            seen.add(member.peer_id)
            index = [p.host.peer_id for p in peers].index(member.peer_id)
            assert groups[index] == group, "members disagree about their group"
    return list(distinct.values())


async def test_eight_nodes_with_target_four_form_two_agreed_groups(make_peers: MakePeers) -> None:
    peers = await make_peers(8, target_group_size=4)
    groups = await asyncio.gather(*(p.matchmaker.form_group(0, p.me()) for p in peers))
    distinct = check_agreement(list(groups), peers)
    assert sorted(len(g.members) for g in distinct) == [4, 4]
    # groups mix across steps
    groups = await asyncio.gather(*(p.matchmaker.form_group(1, p.me()) for p in peers))
    assert len(check_agreement(list(groups), peers)) == 2


async def test_a_late_node_goes_to_the_next_step(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    on_time = [asyncio.ensure_future(p.matchmaker.form_group(5, p.me())) for p in peers[:3]]
    await asyncio.sleep(2.5)  # past the others' gathering window and the leader's wait
    late = await peers[3].matchmaker.form_group(5, peers[3].me())
    groups = await asyncio.gather(*on_time)
    formed = check_agreement([*groups, late], peers)
    assert len(formed) == 1 and len(formed[0].members) == 3
    assert late is None


async def test_nodes_done_with_a_step_do_not_hold_a_later_node(make_peers: MakePeers) -> None:
    """Their announcements are withdrawn (FORMED): the later node neither counts them nor
    waits request_timeout for their joins; it goes alone right after its own window."""
    peers = await make_peers(3, min_group_size=1)
    first = await asyncio.gather(*(p.matchmaker.form_group(9, p.me()) for p in peers[:2]))
    assert len(check_agreement(list(first), peers[:2])[0].members) == 2
    await asyncio.sleep(0.5)  # the withdrawals are stored in the background
    assert set(await peers[2].matchmaker._ready_set(9)) == set()
    started = asyncio.get_running_loop().time()
    late = await peers[2].matchmaker.form_group(9, peers[2].me())
    took = asyncio.get_running_loop().time() - started
    assert late is not None and [m.peer_id for m in late.members] == [peers[2].host.peer_id]
    assert took < FAST["matchmaking_time"] + 0.5 * FAST["request_timeout"], took


async def test_a_node_that_arrives_while_the_others_gather_joins_their_group(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    on_time = [asyncio.ensure_future(p.matchmaker.form_group(6, p.me())) for p in peers[:3]]
    await asyncio.sleep(0.7)  # well inside their 1.5 s window: a short gather lands in their view
    as_client = dataclasses.replace(peers[3].me(), maddrs=(), bandwidth=0.0, client=True)  # as swarm-node joins
    late = await peers[3].matchmaker.form_group(6, as_client, gather=0.2)
    groups = await asyncio.gather(*on_time)
    formed = check_agreement([*groups, late], peers)
    assert len(formed) == 1 and len(formed[0].members) == 4


async def test_a_leader_that_dies_mid_matchmaking_is_replaced(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    tasks = [asyncio.ensure_future(p.matchmaker.form_group(3, p.me())) for p in peers]
    await asyncio.sleep(0.6)  # all announced; nobody has split yet
    ready = await peers[0].matchmaker._ready_set(3)
    leader = peers[0].matchmaker._my_group(ready, 3)[0].peer_id
    dying = next(p for p in peers if p.host.peer_id == leader)
    tasks[peers.index(dying)].cancel()
    await dying.close()
    survivors = [p for p in peers if p is not dying]
    groups = await asyncio.gather(*(tasks[peers.index(p)] for p in survivors))
    formed = check_agreement(list(groups), survivors)
    assert len(formed) == 1 and {m.peer_id for m in formed[0].members} == {p.host.peer_id for p in survivors}


async def test_client_mode_nodes_join_but_never_lead(make_peers: MakePeers) -> None:
    peers = await make_peers(2, clients=2)
    groups = await asyncio.gather(*(p.matchmaker.form_group(0, p.me()) for p in peers))
    formed = check_agreement(list(groups), peers)
    assert len(formed) == 1 and len(formed[0].members) == 4
    assert sum(m.client for m in formed[0].members) == 2
