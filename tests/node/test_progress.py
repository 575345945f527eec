"""Progress records of peers (swarm/progress.py): strict decoding, and when a step's group should
be ready."""

from __future__ import annotations

import pytest

from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity
from swarm.progress import PeerProgress, decode_progress, latest_finish

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


def _peer(step: int, inner: int, when: float, sec: float = 1.0) -> PeerProgress:
    return PeerProgress(PEER, step, inner, 10, sec, when, False)


def test_latest_finish_waits_for_the_slowest_live_peer_of_the_step_bounded() -> None:
    now = 100.0
    peers = [_peer(5, 4, now), _peer(5, 8, now - 1), _peer(6, 0, now), _peer(5, 0, now - 60)]
    # the first peer needs 6 more seconds; the step-6 peer and the stale one do not count
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 2, max_wait=30) == now + 6
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 2, max_wait=3) == now + 5  # capped
    assert latest_finish(peers, 5, now, fresh_for=10, own_finish=now + 9, max_wait=30) == now + 9  # we are slowest
    assert latest_finish([], 5, now, fresh_for=10, own_finish=now, max_wait=30) == now
