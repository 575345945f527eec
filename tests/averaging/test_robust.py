"""The robust reduction (swarm/averaging/robust.py): a table of attacks against the aggregator,
its breakdown point, bit-identity across thread counts, and real rounds over sockets with one
attacking member (flat and grid)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from swarm.averaging import robust
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.grid import GridRound
from tests.averaging.faults import garbage_codec
from tests.averaging.rounds import MakeGroup

HONEST_WEIGHTS = [1.0, 1.5, 2.0, 0.5]
EQUAL = [1.0] * 5  # the attacks: 4 honest members and an attacker of the same (the largest) weight


def honest_deltas(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    """Non-iid pseudo-gradients: a shared direction plus per-node noise of the same norm."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=gen) * 1e-3
    return [shared + torch.randn(numel, generator=gen) * 1e-3 for _ in range(n)]


def weighted_mean(xs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    stacked = torch.stack([x.double() for x in xs])
    return (stacked * torch.tensor(weights, dtype=torch.float64)[:, None]).sum(0) / sum(weights)


def relative_error(result: torch.Tensor, truth: torch.Tensor) -> float:
    return float((result.double() - truth).norm() / truth.norm())


def attack(kind: str, honest: list[torch.Tensor]) -> torch.Tensor:
    mean = torch.stack(honest).mean(0)
    return {
        "x1e4": lambda: honest[0] * 1e4,
        "x30": lambda: honest[0] * 30,  # big, not absurd: clipped, not dropped
        "1e30": lambda: torch.full_like(mean, 1e30),
        "1e20": lambda: torch.full_like(mean, 1e20),  # its fp32 square overflows
        "nan": lambda: torch.full_like(mean, math.nan),
        "inf": lambda: torch.full_like(mean, -math.inf),
        "sign-flip": lambda: -mean * (honest[0].norm() / mean.norm()),
    }[kind]()


# attack -> (bound on the relative error to the honest mean, the attacker's fate). A clipped
# attacker moves the result by at most its weight share x tau (1/5 x the honest members' median
# pairwise distance, ~1.4x an honest noise norm): ~0.28 of the honest mean's norm here.
CASES = {
    "x1e4": (1e-5, "dropped"),
    "1e30": (1e-5, "dropped"),
    "1e20": (1e-5, "dropped"),
    "nan": (1e-5, "dropped"),
    "inf": (1e-5, "dropped"),
    "x30": (0.35, "clipped"),
    "sign-flip": (0.35, "clipped"),
}


def test_without_an_attacker_it_is_the_weighted_mean() -> None:
    xs = honest_deltas(5, 50_000)
    weights = [*HONEST_WEIGHTS, 1.0]
    result, fates = robust.robust_aggregate(xs, weights)
    assert not any(f.touched for f in fates)
    assert relative_error(result, weighted_mean(xs, weights)) <= 1e-6


@pytest.mark.parametrize("kind", list(CASES))
def test_one_attacker_is_dropped_or_bounded(kind: str) -> None:
    bound, fate = CASES[kind]
    honest = honest_deltas(4, 50_000)
    truth = weighted_mean(honest, EQUAL[:4])
    result, fates = robust.robust_aggregate([*honest, attack(kind, honest)], EQUAL)
    assert bool(torch.isfinite(result).all())
    assert relative_error(result, truth) <= bound
    assert not any(f.touched for f in fates[:4])
    assert (fates[4].dropped is not None) == (fate == "dropped")
    if fate == "clipped":
        assert 0 < fates[4].clip < 1
        plain = weighted_mean([*honest, attack(kind, honest)], EQUAL)
        assert relative_error(result, truth) < 0.8 * relative_error(plain.float(), truth)


def test_nobody_touched_is_the_weighted_mean_bit_for_bit() -> None:
    xs = honest_deltas(4, 3 * robust.BLOCK + 777)  # whole blocks and a short one
    weights = HONEST_WEIGHTS
    result, fates = robust.robust_aggregate(xs, weights)
    assert not any(f.touched for f in fates)
    assert torch.equal(result, robust.combine(xs, robust.mean_coefficients(weights)))


def test_the_attacker_may_sit_anywhere_in_member_order() -> None:
    honest = honest_deltas(4, 20_000)
    truth = weighted_mean(honest, [1.0] * 4)
    xs = [honest[0], honest[1], attack("x1e4", honest), honest[2], honest[3]]
    result, fates = robust.robust_aggregate(xs, [1.0] * 5)
    assert [f.dropped is not None for f in fates] == [False, False, True, False, False]
    assert relative_error(result, truth) <= 1e-5


def test_breakdown_point_is_half_the_weight() -> None:
    """Attackers below half the weight are dropped; at half or more they set the median."""
    honest = honest_deltas(3, 20_000)
    truth = weighted_mean(honest, [1.0] * 3)
    two = [torch.full_like(truth, 1e6).float()] * 2  # the same huge (but finite-squared) delta
    result, fates = robust.robust_aggregate([*honest, *two], [1.0] * 5)  # 2/5 of the weight
    assert relative_error(result, truth) <= 1e-5 and all(f.dropped for f in fates[3:])
    result, fates = robust.robust_aggregate([*honest, *two], [1.0, 1.0, 1.0, 1.6, 1.6])  # 3.2/6.2
    assert relative_error(result, truth) > 1e6 and not any(f.dropped for f in fates[3:])


def test_two_members_of_unequal_weight_average_plainly() -> None:
    xs = honest_deltas(2, 10_000)
    result, fates = robust.robust_aggregate(xs, [3.0, 1.0])
    assert not any(f.touched for f in fates)
    assert relative_error(result, weighted_mean(xs, [3.0, 1.0])) <= 1e-6


def test_zero_weights_and_all_dropped() -> None:
    xs = honest_deltas(3, 1000)
    result, fates = robust.robust_aggregate(xs, [1.0, 0.0, 1.0])
    assert fates[1] == robust.Fate() and relative_error(result, weighted_mean([xs[0], xs[2]], [1.0, 1.0])) <= 1e-6
    nan = torch.full((1000,), math.nan)
    result, fates = robust.robust_aggregate([nan, nan], [1.0, 1.0])
    assert torch.equal(result, torch.zeros(1000)) and all(f.dropped == "not finite" for f in fates)


@pytest.mark.parametrize(
    ("values", "weights", "median"),
    [([3.0, 1.0, 2.0], [1.0, 1.0, 1.0], 2.0), ([1.0, 2.0], [1.0, 1.0], 1.0), ([1.0, 9.0], [1.0, 3.0], 9.0),
     ([5.0, 1.0, 2.0, 7.0], [1.0, 1.0, 1.0, 1.0], 2.0), ([], [], 0.0)],
)  # fmt: skip
def test_weighted_median(values: list[float], weights: list[float], median: float) -> None:
    assert robust.weighted_median(values, weights) == median


def test_gram_matrix_matches_float64() -> None:
    xs = honest_deltas(3, 3 * robust.CHUNK + 1234)  # whole chunks, a short one and a tail row
    gram = robust.gram_matrix(xs)
    for i in range(3):
        for j in range(3):
            exact = float((xs[i].double() * xs[j].double()).sum())
            assert gram[i][j] == pytest.approx(exact, rel=1e-5)


def test_bit_identical_across_thread_counts() -> None:
    honest = honest_deltas(4, 1_000_003, seed=1)
    xs = [*honest, attack("x30", honest)]  # a clip, so the coefficients are not the plain mean
    weights = [*HONEST_WEIGHTS, 2.0]
    threads = torch.get_num_threads()
    outcomes = []
    try:
        for count in (1, 2, 4, 1):
            torch.set_num_threads(count)
            outcomes.append(robust.robust_aggregate(xs, weights))
    finally:
        torch.set_num_threads(threads)
    assert outcomes[0][1][4].clip < 1
    for result, fates in outcomes[1:]:
        assert torch.equal(result, outcomes[0][0]) and fates == outcomes[0][1]


# --- real rounds over sockets ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["x1e4", "1e30"])
async def test_a_flat_round_with_one_attacker_stays_with_the_honest_mean(make_group: MakeGroup, kind: str) -> None:
    group, members = await make_group(5, weights=[1.0] * 5, bandwidths=[100.0] * 5, block_size=1024,
                                      chunk_elements=4096)  # fmt: skip
    honest = honest_deltas(4, 40_000)
    vectors = [*honest, attack(kind, honest)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    results = [o[0] for o in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert relative_error(results[0], weighted_mean(honest, [1.0] * 4)) <= 0.01  # the int8 codec's error
    for part, (_, report) in enumerate(outcomes):
        assert all(inc == [0, 1, 2, 3] for inc in report.contributions.values())
        assert report.clipped == {part: [4]}


async def test_a_flat_round_drops_a_sender_of_garbage_and_an_attacker(make_group: MakeGroup) -> None:
    group, members = await make_group(5, weights=[1.0] * 5, block_size=1024, chunk_elements=4096)
    honest = honest_deltas(3, 40_000)
    vectors = [*honest, honest[0].clone(), attack("x1e4", honest)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    rounds[3].codec = garbage_codec(rounds[3].codec)  # NaN scales: malformed on arrival
    outcomes = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
    agreeing = [o for i, o in enumerate(outcomes) if i != 3]
    assert all(not isinstance(o, BaseException) for o in agreeing), agreeing
    results = [o[0] for o in agreeing]  # type: ignore[index]
    assert all(torch.equal(r, results[0]) for r in results)
    assert relative_error(results[0], weighted_mean(honest, [1.0] * 3)) <= 0.01


async def test_a_grid_round_with_one_attacker_stays_with_the_honest_mean(make_group: MakeGroup) -> None:
    n = 12
    group, members = await make_group(n, weights=[1.0] * n, max_group_size=4, block_size=1024, chunk_elements=4096)
    honest = honest_deltas(n - 1, 30_000)
    vectors = [*honest, attack("x1e4", honest)]
    rounds = [GridRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    results = [o[0] for o in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert relative_error(results[0], weighted_mean(honest, [1.0] * (n - 1))) <= 0.02  # two int8 stages
    row_owners = {m for _, report in outcomes for clipped in report.clipped.values() for m in clipped}
    assert row_owners == {n - 1}
