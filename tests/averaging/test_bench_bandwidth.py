"""bench_bandwidth's arithmetic: the round a split costs on given links, phases in turn or overlapped."""

from __future__ import annotations

import pytest

from scripts.bench.bandwidth import optimal_overlapped_s, overlapped_round_s, phased_round_s, shares_of

LINKS = [12.5e6, 12.5e6, 12.5e6, 1.25e6]  # 100,100,100,10 Mbit/s in bytes/s
E = 1.25e6  # a payload the slow link moves in 1 s


@pytest.mark.parametrize(
    ("shares", "phased", "overlapped"),
    [
        ([0.25] * 4, 1.5, 1.5),  # equal: the slow member moves 3/4 E up and down in each phase
        ([1 / 3, 1 / 3, 1 / 3, 0.0], 2.0, 1.0),  # it owns nothing: E up, then E down; or E both at once
        ([0.31, 0.31, 0.31, 0.07], 2 * 0.93, 1.14),
    ],
)
def test_what_a_split_costs_the_slow_member(shares: list[float], phased: float, overlapped: float) -> None:
    assert phased_round_s(E, LINKS, shares) == pytest.approx(phased)
    assert overlapped_round_s(E, LINKS, shares) == pytest.approx(overlapped)


def test_with_phases_in_turn_no_split_beats_the_equal_one_for_the_slow_member() -> None:
    equal = phased_round_s(E, LINKS, [0.25] * 4)
    for slow in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
        rest = (1 - slow) / 3
        assert phased_round_s(E, LINKS, [rest, rest, rest, slow]) >= equal - 1e-12


def test_shares_follow_the_announced_bandwidths_within_the_cap() -> None:
    assert shares_of(1 << 20, [1.0] * 4, 64) == pytest.approx([0.25] * 4)
    capped = shares_of(1 << 20, [1.0, 1.0, 1.0, 1e12], 64)  # at most 4 x the median
    assert capped[3] == pytest.approx(4 / 7, abs=1e-3)


@pytest.mark.parametrize(
    ("links", "optimal"),
    [
        (LINKS, 1.0),  # the slow member owns nothing and moves E each way at once: E / its rate
        ([12.5e6] * 4, 0.15),  # equal links: the equal split, (1 + 2/4) E / rate
        ([12.5e6, 12.5e6], 0.1),  # two members: each moves E each way, whatever it owns
        ([12.5e6, 12.5e6, 6.25e6], 0.2),  # half the rate is slow enough to own nothing: E / its rate
    ],
)
def test_the_best_split_bound_is_what_no_split_beats(links: list[float], optimal: float) -> None:
    best = optimal_overlapped_s(E, links)
    assert best == pytest.approx(optimal, rel=1e-6)
    n = len(links)
    for slow in (0.0, 0.1, 1 / n, 0.5):  # no split of these does better
        rest = (1 - slow) / (n - 1)
        assert overlapped_round_s(E, links, [*[rest] * (n - 1), slow]) >= best - 1e-9
