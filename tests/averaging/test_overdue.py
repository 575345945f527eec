"""An overdue sender is probed and, when its process is gone, left out at once (rounds/overdue.py):
the rule on a table of cases, the probe on real hosts, and whole rounds (flat and grid) in which
a member dies before its streams began, ended by the survivors far within the part timeout."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from swarm.averaging.messages import MemberInfo
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.overdue import (
    MARGIN_FACTOR,
    MIN_MARGIN_S,
    Action,
    Probe,
    Watch,
    plan,
    probe_margin,
    probe_member,
    watch,
)
from swarm.p2p import P2PHost
from swarm.p2p.identity import Identity
from tests.averaging.rounds import LOCAL, MakeGroup, inputs
from tests.averaging.test_hierarchical import SMALL, grid_rounds
from tests.averaging.test_part_timeout import black_hole
from tests.waiting import until

INF = math.inf


@pytest.mark.parametrize(
    ("waited", "margin", "probes", "last", "expected", "why"),
    [
        (0.1, 0.5, 0, None, (Action.WAIT, 0.4), "not overdue yet: wait until the margin"),
        (0.5, 0.5, 0, None, (Action.PROBE, 0.0), "overdue by the margin: probe"),
        (0.6, 0.5, 1, Probe.PENDING, (Action.WAIT, INF), "a probe in flight: wait for it"),
        (0.6, 0.5, 1, Probe.GONE, (Action.FAIL_OVER, 0.0), "refused or closed: fail over now"),
        (0.6, 0.5, 1, Probe.ANSWERED, (Action.WAIT, 0.4), "alive: the next probe at twice the margin"),
        (1.0, 0.5, 1, Probe.ANSWERED, (Action.PROBE, 0.0), "alive then, maybe not now: probe again"),
        (1.5, 0.5, 2, Probe.SILENT, (Action.WAIT, 0.5), "no answer (paused, vanished): wait, probe at 4x"),
        (29.0, 0.5, 6, Probe.ANSWERED, (Action.WAIT, 3.0), "probes thin out: 6 in the first 32 margins"),
        (100.0, 0.5, 10**6, Probe.ANSWERED, (Action.WAIT, 0.5 * 2.0**64 - 100), "any number of probes stays bounded"),
    ],
)
def test_plan(waited: float, margin: float, probes: int, last: Probe | None, expected: tuple[Action, float],
              why: str) -> None:  # fmt: skip
    action, after = plan(waited, margin, probes, last)
    assert action is expected[0], why
    assert after == pytest.approx(expected[1]), why


@pytest.mark.parametrize(
    ("rounds", "expected", "why"),
    [
        ((), MIN_MARGIN_S, "nothing measured: the minimum"),
        ((0.05, 0.1, 0.2), MIN_MARGIN_S, "tiny rounds: the minimum"),
        ((1.0, 3.0, 2.0, 2.5), MARGIN_FACTOR * 1.0, "a multiple of the fastest quarter"),
        ((4.44, 1.04, 4.63), MARGIN_FACTOR * 1.04, "a newcomer whose rounds waited for deaths: its fast one"),
        ((1.0,) * 5 + (40.0,) * 5, MARGIN_FACTOR * 1.0, "half the rounds slowed by deaths still do not count"),
        ((2.0, float("nan"), -1.0), MARGIN_FACTOR * 2.0, "non-finite and negative durations are ignored"),
    ],
)
def test_probe_margin(rounds: tuple[float, ...], expected: float, why: str) -> None:
    assert probe_margin(rounds) == pytest.approx(expected), why


def info(host: P2PHost, maddrs: tuple[str, ...] | None = None, client: bool = False) -> MemberInfo:
    addrs = () if client else maddrs or tuple(host.visible_maddrs)
    return MemberInfo(host.peer_id, addrs, 1.0, 0.0 if client else 100.0, client)


@pytest.mark.timeout(30)
async def test_a_probe_tells_a_gone_process_from_a_live_or_silent_one() -> None:
    me, alive, dead = [await P2PHost(config=LOCAL).start() for _ in range(3)]
    try:
        await me.connect(info(dead).address())  # an open connection that ends when the process does
        dead_info = info(dead)
        await dead.close()
        # its end closed the connection: our side sees it within a few loop turns (a probe comes
        # a margin, at least 0.5 s, after a sender is due)
        await until(lambda: not me.connections_to(dead.peer_id), 5.0, "our end of the connection to close")
        assert await probe_member(me, info(alive), 2.0) is Probe.ANSWERED
        assert await probe_member(me, dead_info, 2.0) is Probe.GONE
        # a paused process or a vanished machine: nothing tells it is gone
        async with black_hole() as hole:
            stranger = MemberInfo(Identity.generate().peer_id, (hole,), 1.0, 100.0, False)
            began = time.monotonic()
            assert await probe_member(me, stranger, 0.5) is Probe.SILENT
            assert time.monotonic() - began < 2.0
        # a client accepts no connections: it cannot be asked
        assert await probe_member(me, info(alive, client=True), 2.0) is Probe.SILENT
    finally:
        await asyncio.gather(me.close(), alive.close())


@pytest.mark.timeout(30)
async def test_watch_reports_a_gone_sender_once_and_probes_a_live_one_ever_more_rarely() -> None:
    missing = {1, 2}
    asked: list[tuple[int, float]] = []
    reported: list[int] = []
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def probe(sender: int) -> Probe:
        asked.append((sender, loop.time() - began))
        return Probe.GONE if sender == 1 and loop.time() - began > 0.25 else Probe.ANSWERED

    def gone(sender: int) -> None:
        reported.append(sender)
        missing.discard(sender)

    task = asyncio.ensure_future(watch(lambda: set(missing), Watch(probe, 0.1, 1.0), gone))
    try:
        await until(lambda: reported, 10.0, "sender 1 found gone", poll=0.01)
        await asyncio.sleep(max(0.0, 1.2 - (loop.time() - began)))
        assert not task.done()  # sender 2 is still missing and alive
    finally:
        task.cancel()
    assert reported == [1]  # alive at the first probes, gone after 0.25 s: reported once
    assert len([sender for sender, _ in asked if sender == 1]) <= 3
    times = [t for sender, t in asked if sender == 2]
    # due at 0.1, 0.2, 0.4 and 0.8 s, the next at 1.6 s: a busy loop may only delay them
    assert 1 <= len(times) <= 4, times
    assert all(t >= 0.1 * 2**k - 0.01 for k, t in enumerate(times)), times


async def killed_at_start(rounds: list, members: list, victim: int) -> tuple[list, float]:
    """Start every member's round, then kill `victim` before any of its streams began: its host
    closes (a dial to it is refused, its connections end) and its round stops, as under kill -9.
    The survivors' outcomes, and how long the last of them took."""
    tasks = [asyncio.ensure_future(r.run()) for r in rounds]
    await asyncio.sleep(0)  # every round has begun: registered, its first dials in flight
    began = time.monotonic()
    tasks[victim].cancel()
    await members[victim].host.close()
    outcomes = await asyncio.gather(*(t for i, t in enumerate(tasks) if i != victim))
    took = time.monotonic() - began
    await asyncio.gather(tasks[victim], return_exceptions=True)
    return outcomes, took


@pytest.mark.timeout(120)
async def test_a_member_killed_inside_a_flat_round_costs_it_seconds_not_the_part_timeout(
    make_group: MakeGroup,
) -> None:
    group, members = await make_group(4, part_timeout=30.0, block_size=1024, chunk_elements=4096)
    vectors = inputs(4, 40_000)
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    outcomes, took = await killed_at_start(rounds, members, victim=1)
    results = [averaged for averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the survivors hold different states"
    assert all(inc == [0, 2, 3] for _, report in outcomes for inc in report.contributions.values())
    assert took < 5.0, took  # the part timeout is 30 s: the owners did not wait it out


@pytest.mark.timeout(120)
async def test_a_member_killed_inside_a_grid_round_costs_it_seconds_not_the_part_timeout(
    make_group: MakeGroup,
) -> None:
    group, members = await make_group(12, part_timeout=30.0, **SMALL)
    vectors = inputs(12, 50_003)
    rounds = grid_rounds(group, members, vectors)
    victim = 5  # owner (1, 1): a sender of its row, a row partial of its column, an owner of a sub-part
    assert rounds[victim].grid.col_of[victim] >= 0
    outcomes, took = await killed_at_start(rounds, members, victim)
    results = [averaged for averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the survivors hold different states"
    reports = [report for _, report in outcomes]
    assert all(r.contributions == reports[0].contributions for r in reports)
    assert len(reports[0].contributions) == 12
    assert all(victim not in inc for inc in reports[0].contributions.values())
    assert took < 5.0, took  # the part timeout is 30 s: no stage waited it out


@pytest.mark.timeout(60)
async def test_a_member_that_answers_probes_but_never_sends_is_waited_for_not_dropped(
    make_group: MakeGroup,
) -> None:
    """Its host is up (a probe gets an answer), its round never runs: the owners wait the part
    timeout for its slice, as before probes existed, and no longer."""
    timeout = 3.0
    group, members = await make_group(3, part_timeout=timeout, block_size=1024, chunk_elements=4096)
    vectors = inputs(3, 20_000)
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    began = time.monotonic()
    outcomes = await asyncio.gather(*(r.run() for r in rounds[:2]))
    took = time.monotonic() - began
    results = [averaged for averaged, _ in outcomes]
    assert torch.equal(results[0], results[1])
    assert all(2 not in inc for _, report in outcomes for inc in report.contributions.values())
    assert timeout <= took < 4 * timeout, took
