"""The suite's tiers and budgets (scripts/tools/test_tiers.py): when a run fails, on a table of cases."""

from __future__ import annotations

import pytest

from scripts.tools.test_tiers import TIERS, TierResult, tier_env, verdict

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
    assert [(t.name, t.marker, t.in_total) for t in TIERS] == [
        ("fast", "not swarm and not soak", True),
        ("swarm", "swarm and not soak", True),
        ("soak", "soak", False),
    ]


def test_a_tier_runs_with_the_bytecode_cache_on_and_the_rest_of_the_environment_as_given() -> None:
    given = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin", "SWARM_DHT_ID_BITS": "8"}
    assert tier_env(given) == {"PATH": "/bin", "SWARM_DHT_ID_BITS": "8"}
    assert tier_env({"PATH": "/bin"}) == {"PATH": "/bin"}
