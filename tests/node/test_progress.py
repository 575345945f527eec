"""Progress records of peers (swarm/progress.py): strict decoding, and when a step's group should
be ready."""

from __future__ import annotations

import pytest

from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity
from swarm.progress import (
    PeerProgress,
    decode_progress,
    latest_finish,
    median_pace,
    plan_late_round,
    servers_behind,
)

PEER = Identity.from_seed(b"\x01" * 32).peer_id
GOOD = {"step": 3, "inner": 40, "H": 50, "sec_per_step": 0.5, "time": 1000.0, "client": False, "maddrs": []}


def test_a_good_record_decodes_and_predicts_its_finish() -> None:
    p = decode_progress(owner_subkey(PEER), GOOD)
    assert p == PeerProgress(PEER, 3, 40, 50, 0.5, 1000.0, False)
    assert p.finish_time() == 1005.0
    assert decode_progress(owner_subkey(PEER), {**GOOD, "inner": 60}).finish_time() == 1000.0  # done: in the past


@pytest.mark.parametrize(
    "change",
    [
        {"step": -1}, {"step": "3"}, {"step": True}, {"inner": 1.5}, {"H": 0}, {"H": None},
        {"sec_per_step": float("nan")}, {"sec_per_step": -1.0}, {"sec_per_step": 1e9}, {"time": float("inf")},
        {"time": "now"}, {"step": 1 << 50},
    ],
)  # fmt: skip
def test_malformed_records_are_ignored(change: dict) -> None:
    assert decode_progress(owner_subkey(PEER), {**GOOD, **change}) is None


def test_records_not_under_an_owner_or_not_maps_are_ignored() -> None:
    assert decode_progress("plain-subkey", GOOD) is None
    assert decode_progress(owner_subkey(PEER), [1, 2]) is None


def _peer(step: int, inner: int, when: float, sec: float = 1.0, client: bool = False) -> PeerProgress:
    return PeerProgress(PEER, step, inner, 10, sec, when, client)


def test_latest_finish_waits_for_the_slowest_live_peer_of_the_step_bounded() -> None:
    now = 100.0
    peers = [_peer(5, 4, now), _peer(5, 8, now - 1), _peer(6, 0, now), _peer(5, 0, now - 60)]
    # the first peer needs 6 more seconds; the step-6 peer and the stale one do not count
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 2, max_wait=30) == now + 6
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 2, max_wait=3) == now + 5  # capped
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 9, max_wait=30) == now + 9  # we are slowest
    assert latest_finish([], 5, now, fresh_for=10, own_finish=now, max_wait=30) == now


def _plan(peers: list[PeerProgress], own_sec: float = 0.0) -> int | None:
    return plan_late_round(peers, 5, 100.0, fresh_for=10, h=10, own_sec=own_sec, margin=0.3)


def test_a_late_node_trains_just_enough_to_finish_with_its_peers() -> None:
    assert _plan([]) == 10  # nobody to catch up with: a whole round
    assert _plan([_peer(5, 0, 100.0)]) == 10  # they have not started either
    assert _plan([_peer(5, 4, 100.0)]) == 5  # 6 s left at their 1 s per step, 0.3 s to announce
    assert _plan([_peer(5, 4, 100.0)], own_sec=2.0) == 2  # we are slower: fewer steps
    assert _plan([_peer(5, 4, 100.0), _peer(5, 8, 100.0)]) == 5  # the slowest sets the end
    assert _plan([_peer(5, 9, 100.0, sec=0.5)]) == 0  # they finish in 0.5 s: announce at once
    assert _plan([_peer(5, 9, 100.0, sec=0.2)]) is None  # they finish before we could announce
    assert _plan([_peer(6, 4, 100.0), _peer(5, 4, 80.0)]) == 10  # another step, a stale record: ignored


def test_a_forming_group_is_too_late_unless_only_clients_are_in_it() -> None:
    assert _plan([_peer(5, 10, 100.0)]) is None  # a server is done and averaging: wait for its result
    assert _plan([_peer(5, 10, 100.0, client=True)]) == 10  # clients cannot lead: they wait for us
    assert _plan([_peer(5, 10, 100.0, client=True), _peer(5, 4, 100.0)]) == 5
    assert _plan([_peer(5, 10, 100.0, client=True), _peer(5, 10, 100.0)]) is None


def test_median_pace_ignores_peers_without_timing() -> None:
    assert median_pace([]) == 0.0
    assert median_pace([_peer(5, 0, 100.0, sec=0.0)]) == 0.0
    assert median_pace([_peer(5, 1, 100.0, sec=s) for s in (0.0, 3.0, 1.0, 2.0)]) == 2.0


def test_servers_behind_only_when_every_live_server_is_at_an_earlier_step() -> None:
    now = 100.0

    def behind(*peers: PeerProgress) -> bool:
        return servers_behind(list(peers), 5, now, fresh_for=10)

    assert behind(_peer(2, 4, now)) and behind(_peer(2, 4, now), _peer(3, 10, now))
    assert not behind()  # no server at all: nobody whose state we could take
    assert not behind(_peer(2, 4, now), _peer(5, 0, now))  # one server is with us
    assert not behind(_peer(4, 10, now))  # done with step 4: it publishes step 5 in a moment
    assert behind(_peer(4, 9, now))  # still training step 4
    assert not behind(_peer(2, 4, now - 60))  # a stale record: that server is gone
    assert not behind(_peer(2, 4, now, client=True))  # clients do not count
    assert behind(_peer(2, 4, now), _peer(7, 4, now, client=True))
