"""bench_bandwidth's arithmetic: the round a split costs on given links, phases in turn or overlapped."""

from __future__ import annotations

import pytest

from scripts.bench_bandwidth import overlapped_round_s, phased_round_s, shares_of

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
