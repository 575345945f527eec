"""Holders behind NAT advertise relayed multiaddrs: accepted like direct ones, and a fetch takes
its shards from holders with an address of their own when there are any."""

from __future__ import annotations

import pytest

from swarm.dht import owner_subkey
from swarm.p2p.identity import Identity
from swarm.state.holders import Holder, decode_holder, direct_donors

IDS = [Identity.generate().peer_id for _ in range(4)]
RELAY = f"/ip4/10.77.0.2/tcp/4001/p2p/{IDS[3]}"
SHA = "ab" * 32


def record(*maddrs: str) -> dict[str, object]:
    return {"step": 3, "manifest": SHA, "maddrs": list(maddrs), "bytes": 100}


def test_a_relayed_holder_is_a_holder_and_its_addresses_name_it() -> None:
    relayed = f"{RELAY}/p2p-circuit/p2p/{IDS[0]}"
    holder = decode_holder(owner_subkey(IDS[0]), record(relayed))
    assert holder is not None and holder.maddrs == (relayed,)
    # a circuit that names another peer at its end is rewritten to the record's owner: the
    # handshake then checks that whoever answers is the owner
    other = decode_holder(owner_subkey(IDS[0]), record(f"{RELAY}/p2p-circuit/p2p/{IDS[1]}"))
    assert other is not None and other.maddrs == (relayed,)


@pytest.mark.parametrize(
    "bad",
    [
        f"{RELAY}/p2p-circuit",  # no peer after the circuit
        f"{RELAY}/p2p-circuit/p2p/{IDS[0]}/p2p-circuit/p2p/{IDS[1]}",  # a circuit of circuits
        "/ip4/10.77.0.2/tcp/4001/p2p-circuit/p2p/" + str(IDS[0]),  # a relay not named by its PeerID
        f"{RELAY}/p2p-circuit/p2p/notapeerid",
        f"{RELAY}/p2p-circuit/p2p/{IDS[0]}" + "/x" * 300,  # longer than any multiaddr we read
    ],
    ids=["no-peer", "circuit-of-circuits", "anonymous-relay", "bad-peer-id", "too-long"],
)
def test_a_holder_whose_only_address_is_a_bad_circuit_is_no_holder(bad: str) -> None:
    assert decode_holder(owner_subkey(IDS[0]), record(bad)) is None


def holder(i: int, *maddrs: str) -> Holder:
    return Holder(IDS[i], 3, SHA, maddrs, 100)


@pytest.mark.parametrize(
    ("holders", "donors"),
    [
        ([holder(0, f"{RELAY}/p2p-circuit/p2p/{IDS[0]}"), holder(1, "/ip4/10.77.0.5/tcp/1")], [1]),
        ([holder(0, f"{RELAY}/p2p-circuit/p2p/{IDS[0]}"), holder(1, f"{RELAY}/p2p-circuit/p2p/{IDS[1]}")], [0, 1]),
        (
            [holder(0, "/ip4/10.77.0.5/tcp/1", f"{RELAY}/p2p-circuit/p2p/{IDS[0]}"), holder(1, "/ip4/10.77.0.6/tcp/1")],
            [0, 1],
        ),
        ([], []),
    ],
)
def test_a_fetch_takes_shards_from_holders_reached_directly_when_there_are_any(
    holders: list[Holder], donors: list[int]
) -> None:
    assert [IDS.index(h.peer_id) for h in direct_donors(holders)] == donors
