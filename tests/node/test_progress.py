"""Progress records of peers (swarm/node/progress.py): strict decoding, and when a step's group should
be ready."""

from __future__ import annotations

import dataclasses
import logging
import time

import msgpack
import pytest

from swarm.dht import store_retry
from swarm.dht.id_proof import solve
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import RUNS_KEY, nodes_key
from swarm.node.plan import APPLY_OWN, RETRY, Facts, plan_without_group, recently_stale
from swarm.node.progress import (
    EVAL_HISTORY,
    OwnProgress,
    PeerProgress,
    ProgressBook,
    decode_evals,
    decode_progress,
    implausible,
)
from swarm.p2p.identity import Identity
from tests.dht.refusing import refusing_dht

PEER = Identity.from_seed(b"\x01" * 32).peer_id
OTHER = Identity.from_seed(b"\x02" * 32).peer_id
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


def test_a_plan_reads_only_records_with_a_proof_of_a_costly_id() -> None:
    """What a plan reads must cost each identity something (a record ahead holds a node back);
    a display of the run reads every well-formed record."""
    bits = 8
    proof = solve(PEER, bits)
    assert decode_progress(owner_subkey(PEER), {**GOOD, "proof": proof}, bits) is not None
    assert decode_progress(owner_subkey(PEER), GOOD, bits) is None
    assert decode_progress(owner_subkey(PEER), {**GOOD, "proof": b"\x00" * 8}, bits) is None  # another id's
    assert decode_progress(owner_subkey(OTHER), {**GOOD, "proof": proof}, bits) is None
    assert decode_progress(owner_subkey(PEER), GOOD) is not None


def test_records_not_under_an_owner_or_not_maps_are_ignored() -> None:
    assert decode_progress("plain-subkey", GOOD) is None
    assert decode_progress(owner_subkey(PEER), [1, 2]) is None


def test_our_own_record_decodes_as_peers_read_it() -> None:
    own = OwnProgress(maddrs=["/ip4/127.0.0.1/tcp/1"], client=False, step=4, inner=0, H=0, sec_per_step=0.25,
                      train_loss=3.14159, eval_loss=None, tokens_per_s=None, group_size=3)  # fmt: skip
    decoded = decode_progress(owner_subkey(PEER), own.encode(1000.0))
    # H 0 (joining a forming group) reads as 1
    assert decoded == PeerProgress(PEER, 4, 0, 1, 0.25, 1000.0, False, reach="direct")


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


async def test_a_progress_record_no_node_stores_is_retried_and_warned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md "Stop": a store accepted by 0 nodes is not ignored. The progress record and the
    run listing are each tried STORE_TRIES times, then a warning names them."""
    monkeypatch.setattr(store_retry, "STORE_BACKOFF", 0.01)
    own = OwnProgress(maddrs=[], client=True, step=4, inner=1, H=8, sec_per_step=0.25, train_loss=None,
                      eval_loss=None, tokens_per_s=None, group_size=1)  # fmt: skip
    async with refusing_dht() as dht:
        book = ProgressBook(dht.client, "run", publish_interval=3.0)
        assert await book.publish(own) is False
        assert dht.stored(nodes_key("run")) == store_retry.STORE_TRIES
        assert dht.stored(RUNS_KEY) == store_retry.STORE_TRIES
        dht.refuse = 0  # the DHT recovers: the next publication is stored
        assert await book.publish(own) is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("the progress record" in w for w in warned) and any("the runs record" in w for w in warned), warned


def test_a_record_carries_its_last_eval_losses_bounded() -> None:
    history = tuple((step, 5.0 - step / 100) for step in range(100))
    own = OwnProgress(maddrs=[], client=False, step=100, inner=0, H=4, sec_per_step=0.1, train_loss=None,
                      eval_loss=4.0, tokens_per_s=None, group_size=3, evals=history)  # fmt: skip
    value = own.encode(1000.0)
    assert len(value["evals"]) == EVAL_HISTORY and value["evals"][0] == [36, 4.64]
    assert decode_progress(owner_subkey(PEER), value).evals == tuple((s, round(v, 4)) for s, v in history[-64:])
    assert len(msgpack.packb(value["evals"])) < 1200


@pytest.mark.parametrize(
    "evals",
    [
        "x", [[1, 2.0]] * 2, [[2, 1.0], [1, 1.0]], [[1, float("nan")]], [[1, -1.0]], [[1, 1e9]], [[-1, 1.0]],
        [[True, 1.0]], [[1, "2"]], [[1, 2.0, 3]], [[1]], [[s, 1.0] for s in range(EVAL_HISTORY + 1)], [None],
    ],
)  # fmt: skip
def test_a_malformed_eval_history_is_dropped_and_the_record_still_counts(evals: object) -> None:
    decoded = decode_progress(owner_subkey(PEER), {**GOOD, "evals": evals})
    assert decoded is not None and decoded.evals == ()
    assert decode_evals([[0, 3], [5, 2.5]]) == ((0, 3.0), (5, 2.5))


async def test_a_node_that_leaves_is_not_live_for_its_peers_at_their_next_read() -> None:
    """Its last record says it left: its peers stop planning with it at once, where they would
    otherwise wait for its step until its record aged out (freshness, then a grace). The record's
    step still counts for how far the run went."""
    own = OwnProgress(maddrs=[], client=False, step=4, inner=8, H=8, sec_per_step=0.25, train_loss=None,
                      eval_loss=None, tokens_per_s=None, group_size=2)  # fmt: skip
    async with refusing_dht(refuse=0) as dht:
        leaving, staying = ProgressBook(dht.client, "run", 3.0), ProgressBook(dht.server, "run", 3.0)

        async def facts() -> Facts:
            await staying.refresh()
            return Facts(step=4, inner_steps=8, own_sec=0.25, client=False, peers=staying.peers, now=time.time(),
                         fresh_for=staying.fresh_for, watched_for=60.0)  # fmt: skip

        assert await leaving.publish(own)
        seen = await facts()
        assert [p.peer_id for p in seen.live()] == [dht.client.peer_id] and recently_stale(seen) == []
        assert (
            plan_without_group(seen, late=False, other_state=False, waited=0.0, max_wait=30.0).action == RETRY
        )  # a live peer of our step: not alone
        assert await leaving.leave(own)
        seen = await facts()
        assert [(p.step, p.left) for p in seen.peers] == [(4, True)] and seen.live() == []
        assert (
            plan_without_group(seen, late=False, other_state=False, waited=0.0, max_wait=30.0).action == APPLY_OWN
            and "1 left" in seen.summary()
        )
    # only `true` says so (a record's fields are typed)
    assert decode_progress(owner_subkey(PEER), {**GOOD, "left": 1}).left is False
