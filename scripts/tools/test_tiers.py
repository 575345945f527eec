"""The whole test suite, tier by tier, each against its time budget: what CI runs.

    python -m scripts.tools.test_tiers               # every tier; exit 1 on a failed test or a tier over budget
    python -m scripts.tools.test_tiers --tier fast   # one tier
    python -m scripts.tools.test_tiers -- -x         # extra arguments go to every pytest run

Tiers (pytest markers; plain `pytest` is the fast tier, for development):
    fast    unit tests and in-loop tests (many hosts or DHT nodes in one event loop)   `pytest`
    swarm   whole nodes training: real processes, or full nodes in one event loop     `pytest -m "swarm and not soak"`
    soak    the soak's short form: a churned swarm of processes, its invariants       `pytest -m soak`

The budgets are for a 2-core machine. A tier over its budget fails the run as a failed test
would: the suite is the tool we develop with, and a slow one stops being run. Each tier's time
is measured here, around its pytest process, and printed in one table at the end. The swarm
tier's budget is what it takes today with some room (about 450-500 s quiet), not yet the
whole suite's goal of 8 minutes: its real processes import torch and train, and that CPU is
most of its time. The soak tier has its own budget, outside the whole suite's: it runs for a set
time by design, and CI may run it apart.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TIERS", "Tier", "TierResult", "tier_env", "verdict"]


@dataclass(frozen=True)
class Tier:
    name: str
    marker: str  # the -m expression that selects it
    budget_s: float
    in_total: bool = True  # counts toward TOTAL_BUDGET_S


TIERS = (
    Tier("fast", "not swarm and not soak", 120.0),
    Tier("swarm", "swarm and not soak", 600.0),
    Tier("soak", "soak", 420.0, in_total=False),
)
TOTAL_BUDGET_S = 720.0  # the tiers that count toward it (fast and swarm) together


@dataclass(frozen=True)
class TierResult:
    tier: Tier
    exit_code: int  # pytest's: 0 passed, 5 none selected
    seconds: float


def verdict(results: list[TierResult], total_budget_s: float) -> list[str]:
    """Why the suite failed, one line each (empty: it passed). Pure: the times are passed in."""
    problems = []
    for r in results:
        if r.exit_code not in (0, 5):
            problems.append(f"tier {r.tier.name}: pytest exited with {r.exit_code}")
        if r.seconds > r.tier.budget_s:
            problems.append(f"tier {r.tier.name}: {r.seconds:.0f} s, over its budget of {r.tier.budget_s:.0f} s")
    counted = [r for r in results if r.tier.in_total]
    total = sum(r.seconds for r in counted)
    if len(counted) == sum(t.in_total for t in TIERS) and total > total_budget_s:
        problems.append(f"the whole suite: {total:.0f} s, over its budget of {total_budget_s:.0f} s")
    return problems


def tier_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a tier's pytest runs in: `environ` with bytecode caching on. Without the
    cache (PYTHONDONTWRITEBYTECODE set) every xdist worker compiles and assertion-rewrites every
    test module again, and every child interpreter compiles the swarm modules it imports:
    collecting the suite took 10.5 CPU-s a worker that way and 5.2 with the cache warm."""
    return {k: v for k, v in environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_tier(tier: Tier, extra: list[str]) -> TierResult:
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-m", tier.marker, *extra], env=tier_env(os.environ))
    return TierResult(tier, code, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=[t.name for t in TIERS], help="run this tier only")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    args = parser.parse_args(argv)
    results = [run_tier(t, args.pytest_args) for t in TIERS if args.tier in (None, t.name)]
    print(f"\n{'tier':<8}{'result':<10}{'seconds':>9}{'budget':>9}")
    for r in results:
        outcome = "passed" if r.exit_code in (0, 5) else f"exit {r.exit_code}"
        print(f"{r.tier.name:<8}{outcome:<10}{r.seconds:>9.0f}{r.tier.budget_s:>9.0f}")
    counted = [r for r in results if r.tier.in_total]
    if len(counted) == sum(t.in_total for t in TIERS):
        print(f"{'fast+swarm':<8}{'':<10}{sum(r.seconds for r in counted):>9.0f}{TOTAL_BUDGET_S:>9.0f}")
    problems = verdict(results, TOTAL_BUDGET_S)
    for line in problems:
        print(f"test_tiers: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
