"""How members are reached (averaging/messages.py's `reach`): announced, bounded and validated,
bound into the group id, and a member reached only through a relay owns no part."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from swarm.averaging.averager import Averager
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.rounds.partition import capped_bandwidths, part_bounds
from swarm.dht.node import DHTNode
from swarm.p2p.errors import BadRequest
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import CircuitAddress, TcpAddress
from swarm.p2p.reach import DIRECT, PUNCHED, RELAYED

IDS = [Identity.generate().peer_id for _ in range(3)]
RELAY = f"/ip4/10.77.0.2/tcp/4001/p2p/{IDS[2]}"


def encoded(**changes: Any) -> list[Any]:
    fields = {"peer_id": IDS[0].to_bytes(), "maddrs": [f"{RELAY}/p2p-circuit/p2p/{IDS[0]}"], "weight": 1.0,
              "bandwidth": 100.0, "client": False, "state": bytes(32), "reach": PUNCHED}  # fmt: skip
    fields.update(changes)
    return list(fields.values())


def test_a_punched_member_round_trips_and_is_dialed_through_its_relay() -> None:
    member = MemberInfo.decode(encoded())
    assert member.reach == PUNCHED and MemberInfo.decode(member.encode()) == member
    address = member.address()
    assert isinstance(address, CircuitAddress) and address.peer_id == IDS[0] and address.relay.peer_id == IDS[2]
    direct = MemberInfo.decode(encoded(maddrs=["/ip4/10.77.0.5/tcp/4001"], reach=DIRECT)).address()
    assert isinstance(direct, TcpAddress) and direct.peer_id == IDS[0]


@pytest.mark.parametrize(
    ("item", "why"),
    [
        (encoded()[:6], "a member is"),  # a member without its reach (an older peer)
        (encoded(reach="upnp"), "reach must be one of"),
        (encoded(reach=1), "reach must be one of"),
        (encoded(reach="x" * 10_000), "reach must be one of"),
        (encoded(reach=None), "reach must be one of"),
        (encoded(maddrs=["/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/x" * 10]), "short strings"),
    ],
)
def test_a_member_with_a_bad_or_unbounded_reach_is_refused(item: list[Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        MemberInfo.decode(item)


def test_a_relayed_member_is_accepted_and_an_unreachable_address_is_skipped() -> None:
    member = MemberInfo.decode(encoded(client=True, bandwidth=0.0, maddrs=["/ip4/1.2.3.4/tcp/1/p2p-circuit"],
                                       reach=RELAYED))  # fmt: skip
    assert member.client and member.address() == IDS[0]  # the malformed circuit is skipped: by PeerID


@pytest.mark.parametrize("rewrite", [{"reach": DIRECT}, {"reach": RELAYED, "client": True}])
def test_the_group_id_binds_how_each_member_said_it_is_reached(rewrite: dict[str, object]) -> None:
    members = (MemberInfo.decode(encoded()), MemberInfo(IDS[1], ("/ip4/10.77.0.9/tcp/1",), 1.0, 100.0, False))
    group = GroupInfo.create("run", 3, members)
    rewritten = (dataclasses.replace(members[0], **rewrite), members[1])  # type: ignore[arg-type]
    assert GroupInfo.make_id("run", 3, rewritten) != group.group_id
    assert GroupInfo.decode(group.encode()) == group


def test_a_relayed_member_owns_an_empty_part() -> None:
    members = [MemberInfo(IDS[0], (), 1.0, 0.0, True, reach=RELAYED),
               MemberInfo(IDS[1], ("/ip4/10.77.0.9/tcp/1",), 1.0, 100.0, False, reach=PUNCHED)]  # fmt: skip
    parts = part_bounds(1000, capped_bandwidths([0.0 if m.client else m.bandwidth for m in members]), 8)
    assert parts[0][0] == parts[0][1] and parts[1] == (0, 1000)
    with pytest.raises(ValueError, match="reach is one of"):
        MemberInfo(IDS[0], (), 1.0, 0.0, True, reach="upnp")


@pytest.mark.parametrize(
    ("reach", "alone", "client"),
    [(DIRECT, False, False), (PUNCHED, False, False), (RELAYED, False, True), (RELAYED, True, False)],
)
async def test_the_averager_announces_what_its_node_says_of_its_reach(reach: str, alone: bool, client: bool) -> None:
    """`alone`: no live peer could own parts, so a relayed node owns them (p2p/reach.py)."""
    host = P2PHost(config=None)
    averager = Averager(DHTNode(host=host), host, "run", reach=lambda: reach, relayed_may_own=lambda: alone)
    try:
        me = averager.member_info(10.0, bytes(32))
        assert (me.reach, me.client, me.bandwidth == 0.0) == (reach, client, client)
    finally:
        averager.close()
