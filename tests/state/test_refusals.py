"""Refusals: what a StateKeeper does not choose again, and for how long (pure, no I/O)."""

from __future__ import annotations

import pytest

from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID
from swarm.state import refusals
from swarm.state.holders import Holder
from swarm.state.refusals import MAX_REFUSED, UNDELIVERED_S, Refusals

PEERS = [Identity.generate().peer_id for _ in range(4)]


def holder(peer: PeerID, manifest: str) -> Holder:
    return Holder(peer, 3, manifest, ("/ip4/127.0.0.1/tcp/1",), 10)


def test_a_refused_manifests_holders_are_left_out_whatever_they_advertise_next() -> None:
    memory = Refusals()
    memory.refuse("bad", [PEERS[1]])
    assert memory.manifests == {"bad"}
    found = [holder(PEERS[0], "own"), holder(PEERS[1], "new"), holder(PEERS[2], "good")]
    assert memory.keep(found, own=PEERS[0]) == [found[2]]


def test_a_holder_that_did_not_deliver_is_left_out_for_that_state_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(refusals.time, "monotonic", lambda: now[0])
    memory = Refusals()
    memory.not_delivered(frozenset({PEERS[1]}), "s")
    found = [holder(PEERS[1], "s"), holder(PEERS[1], "t"), holder(PEERS[2], "s")]
    assert not memory.delivered(found[0], "s") and memory.delivered(found[0], "t")
    assert memory.keep(found, own=PEERS[0]) == found[1:]
    now[0] += UNDELIVERED_S
    assert memory.keep(found, own=PEERS[0]) == found


def test_the_memory_of_refusals_is_bounded() -> None:
    memory = Refusals()
    for i in range(MAX_REFUSED):
        memory.refuse(f"m{i}", [])
    memory.refuse("last", [])
    assert memory.manifests == {"last"}
