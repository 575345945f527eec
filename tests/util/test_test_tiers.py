"""The suite's tiers and budgets (scripts/tools/test_tiers.py): when a run fails, on a table of cases."""

from __future__ import annotations

import pytest

from scripts.tools.test_tiers import TIERS, TierResult, slowdown, tier_env, verdict

FAST, SWARM, SOAK = TIERS


@pytest.mark.parametrize(
    ("results", "problems"),
    [
        ([TierResult(FAST, 0, 90.0), TierResult(SWARM, 0, 300.0)], []),
        ([TierResult(FAST, 1, 90.0), TierResult(SWARM, 0, 300.0)], ["tier fast: pytest exited with 1"]),
        ([TierResult(FAST, 0, 121.0), TierResult(SWARM, 0, 300.0)], ["tier fast: 121 s, over its budget of 120 s"]),
        # each tier within its own budget, the two together over the whole suite's (720 s here)
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 600.0)], []),
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 599.0)], []),
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 602.0)],
         ["tier swarm: 602 s, over its budget of 600 s", "the whole suite: 721 s, over its budget of 720 s"]),
        ([TierResult(FAST, 0, 100.0), TierResult(SWARM, 0, 590.0)], []),
        ([TierResult(SWARM, 5, 1.0)], []),  # a tier run alone that selects nothing (exit 5) is no failure
        ([TierResult(SWARM, 2, 700.0)],
         ["tier swarm: pytest exited with 2", "tier swarm: 700 s, over its budget of 600 s"]),
        # the soak tier has its own budget and stays out of the whole suite's
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 590.0), TierResult(SOAK, 0, 400.0)], []),
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 590.0), TierResult(SOAK, 0, 421.0)],
         ["tier soak: 421 s, over its budget of 420 s"]),
        ([TierResult(SOAK, 1, 300.0)], ["tier soak: pytest exited with 1"]),
        ([TierResult(FAST, 0, 119.0), TierResult(SWARM, 0, 602.0), TierResult(SOAK, 0, 10.0)],
         ["tier swarm: 602 s, over its budget of 600 s", "the whole suite: 721 s, over its budget of 720 s"]),
    ],
)  # fmt: skip
def test_a_failed_tier_or_one_over_its_budget_fails_the_suite(results: list[TierResult], problems: list[str]) -> None:
    assert verdict(results, 720.0) == problems


def test_the_tiers_split_the_markers() -> None:
    assert [(t.name, t.marker, t.in_total, t.workers) for t in TIERS] == [
        ("fast", "not swarm and not soak", True, 4),
        ("swarm", "swarm and not soak", True, 3),
        ("soak", "soak", False, 3),
    ]


def test_a_tier_runs_with_the_bytecode_cache_on_and_the_rest_of_the_environment_as_given() -> None:
    given = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin", "SWARM_DHT_ID_BITS": "8"}
    assert tier_env(given) == {"PATH": "/bin", "SWARM_DHT_ID_BITS": "8"}
    assert tier_env({"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize(
    ("paces", "expected"),
    [
        ([0.55, 0.55], 1.0),  # the reference machine: the budgets as they are
        ([0.40, 0.45], 1.0),  # a faster one keeps them too
        ([0.66, 0.88], 1.4),  # 1.4x slower around the tier, on the mean of the readings
        ([2.0, 2.0], 1.6),  # never more than MAX_SLOWDOWN
    ],
)  # fmt: skip
def test_a_slower_machine_stretches_the_budgets_up_to_a_cap(paces: list[float], expected: float) -> None:
    assert slowdown(paces, reference_s=0.55, cap=1.6) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("results", "problems"),
    [
        # 1.5x slower: the fast tier's 120 s become 180 s, the swarm tier's 600 s 900 s
        ([TierResult(FAST, 0, 170.0, 1.5), TierResult(SWARM, 0, 880.0, 1.5)], []),
        ([TierResult(FAST, 0, 185.0, 1.5), TierResult(SWARM, 0, 880.0, 1.5)],
         ["tier fast: 185 s, over its budget of 180 s (1.50x for a machine that slow)"]),
        # the whole suite's budget stretches by its tiers' slowdowns, weighted by their seconds:
        # (100 x 1.0 + 700 x 1.2) / 800 = 1.175, so 720 s become 846 s
        ([TierResult(FAST, 0, 100.0, 1.0), TierResult(SWARM, 0, 700.0, 1.2)], []),
        ([TierResult(FAST, 0, 100.0, 1.0), TierResult(SWARM, 0, 760.0, 1.2)],
         ["tier swarm: 760 s, over its budget of 720 s (1.20x for a machine that slow)",
          "the whole suite: 860 s, over its budget of 847 s (1.18x for a machine that slow)"]),
    ],
)  # fmt: skip
def test_a_tier_is_held_to_its_budget_stretched_by_its_slowdown(results: list[TierResult], problems: list[str]) -> None:
    assert verdict(results, 720.0) == problems
