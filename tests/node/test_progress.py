"""Progress records of peers (swarm/progress.py): strict decoding, and when a step's group should
be ready."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity
from swarm.progress import OwnProgress, PeerProgress, decode_progress, implausible

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


def test_our_own_record_decodes_as_peers_read_it() -> None:
    own = OwnProgress(maddrs=["/ip4/127.0.0.1/tcp/1"], client=False, step=4, inner=0, H=0, sec_per_step=0.25,
                      train_loss=3.14159, eval_loss=None, tokens_per_s=None, group_size=3)  # fmt: skip
    decoded = decode_progress(owner_subkey(PEER), own.encode(1000.0))
    assert decoded == PeerProgress(PEER, 4, 0, 1, 0.25, 1000.0, False)  # H 0 (joining a forming group) reads as 1


NOW = 1000.0
HONEST = PeerProgress(PEER, 5, 3, 10, 0.5, NOW - 1.0, False)


@pytest.mark.parametrize(
    ("change", "max_step", "problem"),
    [
        ({}, 40, None),
        ({}, None, None),  # no bound known yet
        ({"sec_per_step": 0.0}, 40, None),  # not timed yet: allowed
        ({"time": NOW + 5.0}, 40, None),  # a little clock skew
        ({"time": NOW + 3600.0}, 40, "future"),  # attack f: dated ahead, so that it never ages out
        ({"sec_per_step": 1e-7}, 40, "plausible"),  # attack f: "done in no time"
        ({"inner_steps": 10_000}, 40, "exceeds"),  # attack f: a step that never ends
        ({"step": 1_000_000}, 40, "beyond reach"),  # attack f: far ahead, so that everyone fetches
        ({"step": 1_000_000}, None, None),
    ],
)
def test_implausible_records_are_named(change: dict, max_step: int | None, problem: str | None) -> None:
    found = implausible(dataclasses.replace(HONEST, **change), now=NOW, inner_steps=10, max_step=max_step)
    assert (found is None) if problem is None else (found is not None and problem in found), found
