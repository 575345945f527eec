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
tier's budget leaves room over what it takes today (420-450 s quiet), not yet the whole
suite's goal of 8 minutes: its nodes train (the debug model) and its real processes start
interpreters, and that CPU is most of its time. The soak tier has its own budget, outside the
whole suite's: it runs for a set time by design, and CI may run it apart.

The budgets are for the project's 2-core machine at its usual speed. That speed varies within a
day by half as much again (a fixed loop took 1.5 times as long in one hour as in another, and
the fast tier, with the same code and workers, 101 s and 144 s), and so does CI's. So before
each tier and after the last, a fixed pure-Python loop is timed (machine_pace), and a tier's
budget stretches by how much slower than the reference the machine ran around it, up to
MAX_SLOWDOWN: what fails is a suite that grew, not a slow afternoon. The table prints each
tier's slowdown and stretched budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["TIERS", "Tier", "TierResult", "machine_pace", "slowdown", "tier_env", "verdict"]


@dataclass(frozen=True)
class Tier:
    name: str
    marker: str  # the -m expression that selects it
    budget_s: float
    # pytest-xdist workers. The fast tier's tests wait on short timers and sockets: a fourth worker
    # fills the CPU they leave idle (84 s against 101 s, back to back). The swarm tier's real
    # processes already fill two cores; with four workers its timing assertions failed
    workers: int
    in_total: bool = True  # counts toward TOTAL_BUDGET_S


TIERS = (
    Tier("fast", "not swarm and not soak", 120.0, workers=4),
    Tier("swarm", "swarm and not soak", 600.0, workers=3),
    Tier("soak", "soak", 420.0, workers=3, in_total=False),
)
TOTAL_BUDGET_S = 720.0  # the tiers that count toward it (fast and swarm) together
PACE_LOOP = 15_000_000  # iterations of machine_pace's loop
# machine_pace on the project's 2-core machine at its usual speed: 0.53-0.55 s in an hour when its
# fast tier took 84 s with 4 workers and 101 s with 3
REFERENCE_PACE_S = 0.55
# a budget stretches by at most this much: a machine slower still (or a loop timed in a moment of
# contention) does not hide a suite that grew
MAX_SLOWDOWN = 1.6


@dataclass(frozen=True)
class TierResult:
    tier: Tier
    exit_code: int  # pytest's: 0 passed, 5 none selected
    seconds: float
    slowdown: float = 1.0  # how much slower than the reference the machine ran around it (slowdown())

    @property
    def budget_s(self) -> float:
        return self.tier.budget_s * self.slowdown


def slowdown(paces: Sequence[float], reference_s: float = REFERENCE_PACE_S, cap: float = MAX_SLOWDOWN) -> float:
    """How much slower than `reference_s` the machine ran, from machine_pace's readings around a
    tier (their mean): never below 1 (a fast machine keeps the budgets as they are), never above
    `cap`. Pure: the readings are passed in."""
    return min(cap, max(1.0, statistics.fmean(paces) / reference_s))


def verdict(results: list[TierResult], total_budget_s: float) -> list[str]:
    """Why the suite failed, one line each (empty: it passed). Pure: the times are passed in.
    Each tier is held to its budget stretched by its slowdown; the whole suite to
    `total_budget_s` stretched by its tiers' slowdowns, weighted by their seconds."""
    problems = []
    for r in results:
        if r.exit_code not in (0, 5):
            problems.append(f"tier {r.tier.name}: pytest exited with {r.exit_code}")
        if r.seconds > r.budget_s:
            problems.append(f"tier {r.tier.name}: {r.seconds:.0f} s, over its budget of {r.budget_s:.0f} s"
                            + _stretched(r.slowdown))  # fmt: skip
    counted = [r for r in results if r.tier.in_total]
    total = sum(r.seconds for r in counted)
    if len(counted) == sum(t.in_total for t in TIERS) and total > 0:
        stretch = suite_slowdown(counted)
        if total > total_budget_s * stretch:
            problems.append(f"the whole suite: {total:.0f} s, over its budget of {total_budget_s * stretch:.0f} s"
                            + _stretched(stretch))  # fmt: skip
    return problems


def suite_slowdown(results: Sequence[TierResult]) -> float:
    """The tiers' slowdowns weighted by their seconds: what stretches the whole suite's budget."""
    total = sum(r.seconds for r in results)
    return sum(r.seconds * r.slowdown for r in results) / total if total else 1.0


def _stretched(factor: float) -> str:
    return f" ({factor:.2f}x for a machine that slow)" if factor > 1.0 else ""


def machine_pace(runs: int = 3) -> float:
    """Seconds of a fixed pure-Python loop (the median of `runs`): how fast this machine runs
    Python now, the kind of work most of the suite's CPU is (event loops, pytest itself)."""
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        total = 0
        for i in range(PACE_LOOP):
            total += i
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def tier_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a tier's pytest runs in: `environ` with bytecode caching on. Without the
    cache (PYTHONDONTWRITEBYTECODE set) every xdist worker compiles and assertion-rewrites every
    test module again, and every child interpreter compiles the swarm modules it imports:
    collecting the suite took 10.5 CPU-s a worker that way and 5.2 with the cache warm."""
    return {k: v for k, v in environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_tier(tier: Tier, extra: list[str]) -> TierResult:
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-n", str(tier.workers), "-m", tier.marker, *extra]
    code = subprocess.call(command, env=tier_env(os.environ))
    return TierResult(tier, code, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=[t.name for t in TIERS], help="run this tier only")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    args = parser.parse_args(argv)
    results, pace = [], machine_pace()
    for tier in (t for t in TIERS if args.tier in (None, t.name)):
        ran = run_tier(tier, args.pytest_args)
        after = machine_pace()
        results.append(dataclasses.replace(ran, slowdown=slowdown([pace, after])))
        print(f"test_tiers: machine pace {pace:.2f} s before tier {tier.name}, {after:.2f} s after "
              f"(reference {REFERENCE_PACE_S:.2f} s)", file=sys.stderr)  # fmt: skip
        pace = after
    print(f"\n{'tier':<8}{'result':<10}{'seconds':>9}{'slowdown':>10}{'budget':>9}")
    for r in results:
        outcome = "passed" if r.exit_code in (0, 5) else f"exit {r.exit_code}"
        print(f"{r.tier.name:<8}{outcome:<10}{r.seconds:>9.0f}{r.slowdown:>9.2f}x{r.budget_s:>9.0f}")
    counted = [r for r in results if r.tier.in_total]
    if len(counted) == sum(t.in_total for t in TIERS):
        total, stretch = sum(r.seconds for r in counted), suite_slowdown(counted)
        print(f"{'fast+swarm':<8}{'':<10}{total:>9.0f}{stretch:>9.2f}x{TOTAL_BUDGET_S * stretch:>9.0f}")
    problems = verdict(results, TOTAL_BUDGET_S)
    for line in problems:
        print(f"test_tiers: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
