"""Which advertised state a node adopts (swarm/state/trust.py) on tables of cases, and a fetch
that refuses a manifest too big for the model before allocating anything (real sockets)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.model.checkpoint import RunInfo, ShardInfo, Snapshot, copy_state, make_snapshot
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.identity import Identity
from swarm.state.config import FetchConfig
from swarm.state.fetcher import RefusedManifest, fetch_state
from swarm.state.holders import Holder
from swarm.state.server import StateServer
from swarm.state.trust import FORK_STEPS, Known, choose_trusted, manifest_problem, step_horizon

IDS = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(8)]
GOOD, ZERO, OTHER = "a" * 64, "0" * 64, "b" * 64  # the honest state, an attacker's, another


def held(i: int, step: int, sha: str = GOOD) -> Holder:
    return Holder(IDS[i], step, sha, (f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{IDS[i]}",), 100)


HONEST_AT_5 = [held(1, 5), held(2, 5), held(3, 5)]
CASES = [
    # (situation, holders, what the node knows, chosen (step, sha) or None, peers refused)
    ("a newcomer takes the swarm's state", HONEST_AT_5, Known(0), (5, GOOD), set()),
    ("attack d on a newcomer: the best-backed state wins, not the newest",
     [*HONEST_AT_5, held(0, 1_000_000, ZERO)], Known(0), (5, GOOD), set()),
    ("attack d on a node in sync: an unreachable step is refused",
     [*HONEST_AT_5, held(0, 1_000_000, ZERO)], Known(5, horizon=40), (5, GOOD), {0}),
    ("a reachable step backed by one peer does not pull a node in sync off its group's state",
     [*HONEST_AT_5, held(0, 6, ZERO)], Known(5, horizon=40), (5, GOOD), {0}),
    ("a node that fell behind follows its group", [held(1, 6), held(2, 6), held(3, 5)], Known(5), (6, GOOD), set()),
    ("behind in a swarm of two: one peer ahead is enough", [held(1, 6)], Known(5), (6, GOOD), set()),
    ("a tie between a step and a later one: the earlier", [held(1, 6), held(0, 7, ZERO)], Known(5), (6, GOOD), set()),
    ("without a quorum, the initial peer's state is preferred",
     [held(1, 6), held(0, 6, ZERO)], Known(5, vouching=frozenset({IDS[1]})), (6, GOOD), set()),
    ("an initial peer does not outweigh the node's own group",
     [*HONEST_AT_5, held(4, 6, OTHER)], Known(5, horizon=40, vouching=frozenset({IDS[4]})), (5, GOOD), {4}),
    ("one identity advertising twice counts once",
     [held(0, 6, ZERO), held(0, 6, ZERO), held(1, 5), held(2, 5)], Known(5), (5, GOOD), {0}),
    ("nothing newer: the newest at or below ours (fetch_reason decides)",
     [held(1, 4), held(2, 5, OTHER), held(3, 5, OTHER)], Known(5), (5, OTHER), set()),
    ("a node that missed its group is not held back by the late peers (and an attacker) at its step",
     [held(1, 1), held(2, 1), held(3, 0), held(4, 0), held(0, 0)], Known(0, horizon=40, missed=True), (1, GOOD), set()),
    ("a crowd outnumbers the holders that signed our recent rounds: those who earned it win",
     [held(1, 5), held(2, 5), held(0, 6, ZERO), held(5, 6, ZERO), held(6, 6, ZERO)],
     Known(0, earned=frozenset({IDS[1], IDS[2]})), (5, GOOD), set()),
    ("the same crowd against a node with no rounds wins rule 4 (the lineage check is what is left)",
     [held(1, 5), held(2, 5), held(0, 6, ZERO), held(5, 6, ZERO), held(6, 6, ZERO)], Known(0), (6, ZERO), set()),
    ("among states backed by round mates, the most round mates first",
     [held(1, 6), held(2, 6), held(3, 6, OTHER), held(5, 6, OTHER), held(6, 6, OTHER)],
     Known(0, earned=frozenset({IDS[1], IDS[2], IDS[3]})), (6, GOOD), set()),
    ("an initial peer's own state still comes first",
     [held(1, 5), held(0, 6, ZERO)], Known(0, vouching=frozenset({IDS[0]}), earned=frozenset({IDS[1]})),
     (6, ZERO), set()),
    ("... while a node that did not miss it stays with them",
     [held(1, 1), held(2, 1), held(3, 0), held(4, 0), held(0, 0)], Known(0, horizon=40), (0, GOOD), {1, 2}),
    ("a node that missed its group still does not follow one identity",
     [held(0, 1, ZERO), held(3, 0), held(4, 0)], Known(0, horizon=40, missed=True), (0, GOOD), {0}),
    ("nobody advertises", [], Known(3), None, set()),
    ("only an unreachable step", [held(0, 1_000_000, ZERO)], Known(3, horizon=10), None, {0}),
]  # fmt: skip


@pytest.mark.parametrize(("what", "holders", "known", "chosen", "refused"), CASES, ids=[c[0] for c in CASES])
def test_choose_trusted(
    what: str, holders: list[Holder], known: Known, chosen: tuple[int, str] | None, refused: set[int]
) -> None:
    verdict = choose_trusted(holders, known)
    assert (verdict.choice[:2] if verdict.choice else None) == chosen
    if verdict.choice is not None:
        assert verdict.choice[2] and all((h.step, h.manifest) == chosen for h in verdict.choice[2])
    assert {IDS.index(peer) for peer, _ in verdict.refused} == refused


MATES = frozenset(IDS[1:7])  # signed our recent rounds
FORK_CASES = [
    # (situation, holders, what the node knows, the fork to check (step, sha) or None)
    ("the larger side of a fork, six steps ahead beyond the horizon: checked",
     [held(1, 56, OTHER), held(2, 56, OTHER), held(3, 50)], Known(50, horizon=52, earned=MATES, sha=GOOD), (56, OTHER)),
    ("... and at our own step with another hash, fewer than stand with us: checked",
     [held(1, 50, OTHER), held(2, 50), held(3, 50)], Known(50, earned=MATES, sha=GOOD), (50, OTHER)),
    ("the most round mates first", [held(1, 51, OTHER), held(2, 52, ZERO), held(3, 52, ZERO)],
     Known(50, horizon=60, earned=MATES, sha=GOOD), (52, ZERO)),
    ("identities that never averaged with us name no fork, however many",
     [held(0, 56, ZERO), held(7, 56, ZERO), held(3, 50)], Known(50, horizon=52, earned=MATES, sha=GOOD), None),
    ("a state of our own step and hash is ours, not a fork",
     [held(1, 50), held(2, 50)], Known(50, earned=MATES, sha=GOOD), None),
    ("what our last round's members hold at our step is ours, while our own manifest is still made",
     [held(1, 50, OTHER), held(2, 50, OTHER)], Known(50, earned=MATES, sha=ZERO, last_round=frozenset(IDS[1:3])), None),
    ("... but a round mate of old that was not in it names a fork",
     [held(1, 50, OTHER), held(3, 50, ZERO)], Known(50, earned=MATES, sha=GOOD, last_round=frozenset(IDS[1:3])),
     (50, ZERO)),
    ("a larger side behind us (a smaller half that trained ahead while split): checked",
     [held(1, 47, OTHER), held(2, 47, OTHER), held(3, 47, OTHER), held(4, 50)], Known(50, earned=MATES, sha=GOOD),
     (47, OTHER)),
    ("... and an equal one (the hash settles a split of halves)",
     [held(1, 47, OTHER), held(2, 47, OTHER), held(3, 50)], Known(50, earned=MATES, sha=GOOD), (47, OTHER)),
    ("... but not a smaller one: a fork's smaller side behind us takes ours",
     [held(1, 47, OTHER), held(2, 50), held(3, 50)], Known(50, earned=MATES, sha=GOOD), None),
    ("peers behind us on our own lineage are not a fork, however many",
     [held(1, 49, OTHER), held(2, 49, OTHER), held(3, 48, ZERO)],
     Known(50, earned=MATES, sha=GOOD, ancestors=frozenset({(49, OTHER), (48, ZERO)})), None),
    ("identities that never averaged with us name no fork behind us either",
     [held(0, 47, ZERO), held(7, 47, ZERO)], Known(50, earned=MATES, sha=GOOD), None),
    ("more than FORK_STEPS behind: not checked",
     [held(1, 80 - FORK_STEPS - 1, OTHER), held(2, 80 - FORK_STEPS - 1, OTHER)], Known(80, earned=MATES, sha=GOOD),
     None),
    ("more than FORK_STEPS ahead: not checked (a lineage that long costs too much to fetch)",
     [held(1, 50 + FORK_STEPS + 1, OTHER)], Known(50, horizon=52, earned=MATES, sha=GOOD), None),
]  # fmt: skip


@pytest.mark.parametrize(("what", "holders", "known", "fork"), FORK_CASES, ids=[c[0] for c in FORK_CASES])
def test_a_fork_to_check(what: str, holders: list[Holder], known: Known, fork: tuple[int, str] | None) -> None:
    """Rule 5: what the node checks the lineage of, whatever the choice."""
    verdict = choose_trusted(holders, known)
    assert (verdict.fork[:2] if verdict.fork else None) == fork
    if verdict.fork is not None:
        assert all((h.step, h.manifest) == fork for h in verdict.fork[2])


@pytest.mark.parametrize(
    ("known_step", "since_s", "pace_s", "h", "horizon"),
    [
        (5, 0.0, 0.5, 4, 7),  # just started: the slack alone
        (5, 10.0, 0.5, 4, 27),  # 10 s at 0.5 s per step: 2 s per outer step, 4x faster: 20 steps
        (0, 3600.0, 0.02, 50, 14_402),  # an hour at a fast pace: far below 1,000,000
        (5, 10.0, 0.0, 4, None),  # no pace known: no bound
        (5, -3.0, 0.5, 4, 7),  # a clock that went back
    ],
)
def test_step_horizon(known_step: int, since_s: float, pace_s: float, h: int, horizon: int | None) -> None:
    assert step_horizon(known_step, since_s, pace_s, h) == horizon


RUN = RunInfo(run_id="run", model="tiny", model_config={"dim": 8}, seed=0)


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.w" for i in range(4)]
    return {"outer_step": 3, "params": {n: torch.randn(32, 32, generator=gen) for n in names},
            "momentum": {n: torch.randn(32, 32, generator=gen) for n in names}}  # fmt: skip


def _sizes(state: dict) -> dict[str, int]:
    return {f"{k}/{n}": t.numel() * t.element_size() for k in ("params", "momentum") for n, t in state[k].items()}


def _inflate(snapshot: Snapshot, nbytes: int) -> Snapshot:
    """The same shards listed at another size (attack e: 1 GiB shards for a small model)."""
    shards = tuple(dataclasses.replace(s, nbytes=nbytes) for s in snapshot.manifest.shards)
    return Snapshot(dataclasses.replace(snapshot.manifest, shards=shards), snapshot.shards)


def test_manifest_problem_accepts_the_models_own_and_refuses_the_rest() -> None:
    state = _state()
    sizes = _sizes(state)
    for shard_bytes in (1, 10_000, 1 << 30):  # one tensor per shard, a few, all in one
        assert manifest_problem(make_snapshot(copy_state(state), RUN, shard_bytes).manifest, sizes) is None
    manifest = make_snapshot(copy_state(state), RUN, 10_000).manifest
    assert "bytes" in manifest_problem(_inflate(make_snapshot(state, RUN, 10_000), 1 << 30).manifest, sizes)
    assert "tensors" in manifest_problem(manifest, {**sizes, "params/extra": 4})
    missing = dict(sizes)
    missing.pop("momentum/layers.0.w")
    assert "tensors" in manifest_problem(manifest, missing)
    renamed = dataclasses.replace(manifest, shards=(ShardInfo(manifest.shards[0].name, ("params/x",), 10, GOOD),
                                                    *manifest.shards[1:]))  # fmt: skip
    assert manifest_problem(renamed, sizes) is not None


async def test_a_fetch_refuses_a_manifest_too_big_for_the_model_before_downloading() -> None:
    state = _state()
    bloated = _inflate(make_snapshot(copy_state(state), RUN, 10_000), 1 << 30)  # 4 shards "of 1 GiB"
    local = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    attacker, fetcher = await P2PHost(config=local).start(), await P2PHost(config=local).start()
    server = StateServer(attacker, "run")
    server.publish(bloated)
    try:
        m = bloated.manifest
        holder = Holder(attacker.peer_id, m.step, m.sha256, tuple(attacker.visible_maddrs), m.total_bytes)
        with pytest.raises(RefusedManifest, match="bytes") as refused:
            await fetch_state(fetcher, "run", [holder], expect=RUN, expect_tensors=_sizes(state),
                              config=FetchConfig(timeout=5.0))  # fmt: skip
        assert refused.value.sha == m.sha256
        assert server.bytes_sent == 0  # not a shard asked for: nothing was allocated for it
    finally:
        server.close()
        await attacker.close()
        await fetcher.close()
