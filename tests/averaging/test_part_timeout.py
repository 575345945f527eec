"""The part timeout from measured round times (rounds/timeouts.py): the rule on a table of cases,
and a round in which a member vanishes silently ending within max(5 s, 3x the median round)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from swarm.averaging.averager import Averager
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.rounds.timeouts import (
    FLOOR_S,
    SPREAD,
    WINDOW,
    RoundClock,
    derived_part_timeout,
    group_part_timeout,
    measures_busy,
    measures_round,
    quantile,
)
from swarm.p2p import PeerID
from swarm.p2p.errors import BadRequest
from swarm.p2p.identity import Identity
from tests.averaging.rounds import averagers

CEILING = 60.0


@pytest.mark.parametrize(
    ("rounds", "ceiling", "expected", "why"),
    [
        ((), CEILING, CEILING, "nothing measured: the flag"),
        ((0.1,), CEILING, CEILING, "one round is not a pace yet"),
        ((0.1, 0.2), CEILING, CEILING, "two rounds: the slower may have waited, one is not a pace"),
        ((0.1, 0.2, 0.1), CEILING, FLOOR_S, "tiny rounds: the floor"),
        ((1.0, 2.0, 3.0), CEILING, 6.0, "3 x the slower of a few: their slowest never counts"),
        ((1.0, 1.5, 1.2, 25.6), CEILING, 4.5, "a short window's one round that waited for a paused member"),
        ((1.0, 9.0, 1.2, 8.0), CEILING, 10.8, "two slow rounds of four: 3 x the median, they fit"),
        ((1.0,) * 19 + (40.0,), CEILING, 3.0, "one round that waited for a vanished member is ignored"),
        ((1.0,) * 17 + (10.0,) * 3, CEILING, 9.0, "three slow rounds of twenty: 3 x the median"),
        ((1.0,) * 9 + (10.0,) * 11, CEILING, 30.0, "a member slow for good is in every round: the timeout grows"),
        (
            (1.0,) * 13 + (20.0, 30.0) * 3 + (60.0,),
            CEILING,
            9.0,
            "churn: a third of the rounds waited out timeouts, the timeout stays at 3 x the median",
        ),
        ((30.0, 40.0, 50.0), CEILING, CEILING, "never above the flag"),
        ((5.0, 5.0), 4.0, 4.0, "a flag below the floor still bounds it"),
        ((40.0,) * WINDOW + (1.0,) * WINDOW, CEILING, 3.0, "only the last WINDOW rounds count"),
        ((1.0, float("nan"), -1.0, 1.0, 1.0), CEILING, 3.0, "non-finite and negative durations are ignored"),
    ],
)
def test_derived_part_timeout(rounds: tuple[float, ...], ceiling: float, expected: float, why: str) -> None:
    assert derived_part_timeout(rounds, ceiling) == pytest.approx(expected), why


@pytest.mark.parametrize(
    ("rounds", "failed", "expected", "why"),
    [
        ((0.1, 0.2, 0.1), 1, 2 * FLOOR_S, "tiny rounds, then one failed: twice the floor"),
        ((0.1, 0.2, 0.1), 3, 8 * FLOOR_S, "three failed in a row: eight times"),
        ((1.0, 2.0, 3.0), 1, 12.0, "twice 3 x the slower"),
        ((1.0, 2.0, 3.0), 10, CEILING, "never above the flag"),
        ((0.1,), 5, CEILING, "nothing measured yet: the flag, whatever failed"),
        ((0.1, 0.2, 0.1), 10**9, CEILING, "any number of failures stays bounded by the flag"),
    ],
)
def test_failed_rounds_in_a_row_back_the_timeout_off(rounds: tuple[float, ...], failed: int, expected: float,
                                                      why: str) -> None:  # fmt: skip
    assert derived_part_timeout(rounds, CEILING, failed) == pytest.approx(expected), why


def test_a_completed_round_ends_the_backoff() -> None:
    clock = RoundClock()
    for seconds in (0.1, 0.2, 0.1):
        clock.observe(seconds)
    clock.failed()
    clock.failed()
    assert clock.part_timeout(CEILING) == 4 * FLOOR_S
    assert clock.announced(CEILING) == 4 * FLOOR_S  # the group waits as long as its most failed member
    clock.observe(0.1)
    assert clock.part_timeout(CEILING) == FLOOR_S


def test_quantile_is_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.9) == 3.0
    assert quantile(list(range(1, 21)), 0.9) == 18
    assert quantile([7.0], 0.5) == 7.0
    with pytest.raises(ValueError):
        derived_part_timeout((1.0, 1.0), 0.0)


def test_the_clock_remembers_completed_rounds_only() -> None:
    clock = RoundClock()
    assert clock.part_timeout(CEILING) == CEILING
    assert clock.announced(CEILING) == 0.0  # nothing measured: nothing announced
    for seconds in (1.0, 2.0, float("inf")):
        clock.observe(seconds)
    assert clock.part_timeout(CEILING) == CEILING  # two rounds: the slower may have waited
    assert clock.announced(CEILING) == 0.0
    clock.observe(1.5)
    assert clock.recent() == (1.0, 2.0, 1.5)
    assert clock.part_timeout(CEILING) == 4.5  # 3 x the slower of the two besides the slowest
    assert clock.announced(CEILING) == 4.5


@pytest.mark.parametrize(
    ("announced", "ceiling", "expected", "why"),
    [
        ((2.0, 3.0, 2.5), CEILING, 3.0, "the largest: every member waits as long"),
        ((2.0, 0.0), CEILING, 2.0, "a member that measured nothing (a restart) takes the group's"),
        ((0.0, 0.0), CEILING, CEILING, "nobody measured anything: the flag"),
        ((2.0, 1e9), CEILING, CEILING, "an absurd announcement is capped by our flag"),
        ((), CEILING, CEILING, "no members: the flag"),
        ((5.0, 4.0), 4.5, 4.5, "our flag bounds it"),
    ],
)
def test_group_part_timeout(announced: tuple[float, ...], ceiling: float, expected: float, why: str) -> None:
    assert group_part_timeout(announced, ceiling) == expected, why


# The completed rounds (round_s, oldest first) of six members of one 60-minute soak's group of 15,
# since each one's last start, before the round after one in which a member was paused 14 s
# (SIGSTOP) inside the round: that member's paused round (25.6 s) and the others' round slowed
# by it (16.5-16.6 s) are the slowest of each window; the fifth member restarted two rounds ago.
SOAK_WINDOWS = (
    (3.5, 1.5, 2.8, 2.2, 1.9, 4.2, 25.6),  # the member that was paused
    (1.3, 2.4, 1.2, 1.9, 4.3, 16.6),
    (0.6, 2.3, 1.3, 2.0, 4.2, 16.5),
    (5.4, 1.8, 0.7, 2.5, 1.9, 2.5, 1.8, 1.7, 0.6, 2.0, 1.7, 2.1, 1.4, 3.8, 1.4, 2.3, 1.7, 1.7, 4.2, 16.6),
    (4.3, 10.9),
    (1.2, 2.3, 1.3, 1.9, 3.0, 4.3, 1.7, 2.7, 1.7, 1.6, 4.3, 16.6),
)


# One member's last 20 completed rounds (round_s, oldest first) at the 110th step of a 60-minute
# soak, in its fortieth minute: a kill or a pause landed in about every third round, and the four
# newest rounds waited out timeouts.
RUNAWAY_WINDOW = (1.5, 1.4, 0.9, 1.5, 1.1, 2.2, 2.0, 2.6, 3.6, 2.6, 1.1, 1.8, 1.3, 1.8, 1.1, 3.0, 19.5, 10.6, 30.2,
                  17.2)  # fmt: skip


def test_rounds_that_waited_out_timeouts_do_not_run_the_timeout_up_to_the_flag() -> None:
    """Measured as they were, the p90 of that window (17.2 s) made the member's next timeout
    52 s, and its group's (the largest announced) the 60 s flag; kills then cost rounds 30-95 s.
    At most SPREAD x the median (1.8 s), it is 3 x 5.4 s, and the rounds that took 1-4 s still
    fit in it with room."""
    clock = RoundClock()
    for seconds in RUNAWAY_WINDOW:
        clock.observe(seconds)
    assert clock.part_timeout(CEILING) == pytest.approx(3 * SPREAD * 1.8)
    assert 3 * quantile(sorted(RUNAWAY_WINDOW)[:-1], 0.9) == pytest.approx(51.6)  # the rule before SPREAD


def test_one_paused_member_does_not_put_its_groups_timeout_at_the_flag() -> None:
    """Each member announces 3x the slow rounds of its own window and the group takes the largest
    announced: the slowest round of a short window must not be what a member announces, or one
    round that waited for a paused member sets every member's timeout to the flag (in the soak:
    12.9 s, then 60 s for the next 28 steps)."""
    announced = []
    for window in SOAK_WINDOWS:
        clock = RoundClock()
        for seconds in window:
            clock.observe(seconds)
        announced.append(clock.announced(CEILING))
    assert announced[4] == 0.0, "two rounds since a restart: nothing announced, the group's taken"
    assert group_part_timeout(announced, CEILING) == pytest.approx(3 * 4.3), announced


@pytest.mark.parametrize(
    ("seconds", "rounds", "expected", "why"),
    [
        (1.0, (0.7, 1.9, 1.2, 1.5), True, "a round like our recent ones: it was busy, it measures"),
        (4.3, (0.7, 1.9, 1.2, 1.5), False, "it waited (a kill) though its timeout, 11.5 s, did not run out"),
        (4.3, (4.3,), False, "a restart's first round: nothing to tell a wait from a slow link by"),
        (4.3, (0.7, 1.9), False, "two rounds: one besides the slowest is no pace yet"),
        (0.9, (0.1, 0.2, 0.1), True, "a tiny model's rounds: up to half the floor"),
        (12.0, (8.0, 9.0, 8.5, 30.0), True, "a link slow for good: its slow rounds measure it"),
        (float("nan"), (1.0, 1.0, 1.0), False, "no duration: nothing measured"),
        (-1.0, (1.0, 1.0, 1.0), False, "a negative duration: nothing measured"),
    ],
)
def test_a_round_measures_the_busy_rate_only_if_it_did_not_wait(
    seconds: float, rounds: tuple[float, ...], expected: bool, why: str
) -> None:
    assert measures_busy(seconds, rounds) is expected, why


@pytest.mark.parametrize(
    ("seconds", "timeout", "expected", "why"),
    [
        (1.0, 30.0, True, "a round of a live group: well within its timeout"),
        (14.9, 30.0, True, "just under half of it"),
        (15.0, 30.0, False, "half of it: a wait may have run out at another member"),
        (59.97, 60.0, False, "the wait of a member that learned of the group before us ran out"),
        (61.0, 60.0, False, "our own wait ran out"),
        (float("nan"), 60.0, False, "no duration: nothing measured"),
        (-1.0, 60.0, False, "a negative duration: nothing measured"),
    ],
)
def test_a_round_measures_the_link_only_well_within_its_part_timeout(
    seconds: float, timeout: float, expected: bool, why: str
) -> None:
    assert measures_round(seconds, timeout) is expected, why


def test_a_member_announces_its_timeout_on_the_wire() -> None:
    info = MemberInfo(PeerID.from_public_key(bytes(32)), ("/ip4/127.0.0.1/tcp/1",), 1.0, 100.0, False, timeout=4.5)
    assert MemberInfo.decode(info.encode()) == info
    assert MemberInfo.decode(info.encode()[:7]).timeout == 0.0  # a member of an older version: none
    for bad in (-1.0, float("nan"), "5"):
        with pytest.raises(BadRequest):
            MemberInfo.decode([*info.encode()[:7], bad])


@contextlib.asynccontextmanager
async def black_hole() -> AsyncIterator[str]:
    """A listener that accepts TCP connections and never answers: a member that vanished
    inside a round as a machine that lost power does (no FIN, no RST), or a SIGSTOPped process
    (its kernel still completes handshakes)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # never read, never written, never closed until the test ends

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"/ip4/127.0.0.1/tcp/{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def member(averager: Averager, weight: float, maddrs: tuple[str, ...] | None = None) -> MemberInfo:
    info = averager.member_info(weight)
    return MemberInfo(info.peer_id, maddrs or info.maddrs, weight, 100.0, False, timeout=info.timeout)


async def timed_round(averager: Averager, group: GroupInfo, tensor: torch.Tensor) -> float:
    began = time.monotonic()
    await averager.run_round(group, [tensor])
    return time.monotonic() - began


@pytest.mark.timeout(90)
async def test_a_member_that_vanishes_inside_a_round_costs_it_seconds_not_the_flag() -> None:
    config = AveragingConfig(part_timeout=30.0, request_timeout=1.0, block_size=256, chunk_elements=4096)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(50_000, generator=gen) for _ in range(4)]
    async with averagers(4, config) as made:
        warmup: list[float] = []
        for step in range(4):  # the whole group, a few times: every member measures its rounds
            group = GroupInfo.create("run", step, tuple(member(a, 1.0 + i) for i, a in enumerate(made)))
            warmup += await asyncio.gather(*(timed_round(a, group, t) for a, t in zip(made, tensors, strict=True)))
        median = statistics.median(warmup)
        assert all(a.clock.part_timeout(config.part_timeout) < config.part_timeout for a in made)
        # member 3 is in the group, but its address is a black hole: its slices never come, its
        # part's owner never answers, and nothing tells the others it is gone
        measured = [a.clock.recent() for a in made[:3]]
        async with black_hole() as hole:
            infos = [member(a, 1.0 + i) for i, a in enumerate(made[:3])] + [member(made[3], 4.0, (hole,))]
            group = GroupInfo.create("run", 4, tuple(infos))
            began = time.monotonic()
            outcomes = await asyncio.gather(*(a.run_round(group, [t]) for a, t in zip(made[:3], tensors, strict=False)))
            took = time.monotonic() - began
        # the round waited out the part timeout: it says how long that was, not how long rounds take
        assert [a.clock.recent() for a in made[:3]] == measured
    results = [averaged[0] for averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(inc == [0, 1, 2] for _, report in outcomes for inc in report.contributions.values())
    assert took <= max(5.0, 3 * median), (took, median, [report.part_timeout for _, report in outcomes])


@pytest.mark.timeout(60)
async def test_a_failed_round_makes_the_next_wait_longer_on_the_wire() -> None:
    """Two members whose rounds took a fraction of a second, then a round whose other member
    is a black hole: it fails, and the survivor announces twice its timeout for the next round
    (a busy machine whose loops stall past a floor-sized timeout must not fail every round)."""
    config = AveragingConfig(part_timeout=30.0, request_timeout=1.0)
    tensors = [torch.randn(1_000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    async with averagers(2, config) as made:
        for step in range(3):  # MIN_ROUNDS rounds besides the slowest
            group = GroupInfo.create("run", step, tuple(member(a, 1.0) for a in made))
            await asyncio.gather(*(a.run_round(group, [t]) for a, t in zip(made, tensors, strict=True)))
        before = made[0].member_info(1.0).timeout
        assert before == FLOOR_S
        async with black_hole() as hole:
            gone = member(made[1], 1.0, (hole,))
            group = GroupInfo.create("run", 3, (member(made[0], 1.0), gone))
            with pytest.raises(AllReduceError):
                await made[0].run_round(group, [tensors[0]])
        assert made[0].member_info(1.0).timeout == 2 * before


@pytest.mark.swarm  # a whole round on real sockets that waits out a part timeout: 10 s
@pytest.mark.timeout(60)
async def test_a_round_whose_wait_ran_out_at_other_members_measures_no_link_here() -> None:
    """Member 2 (a client) learns of the group with the others but starts its round
    LATE x the part timeout later; member 3 (a client) never sends. The owners wait the part
    timeout for member 3 and answer member 2 then: member 2's round lasts well under the timeout
    on its own clock, yet it measured a wait, not its link. Taken as a measurement, such a round
    paced a node's next round at 1 KB/s in the NAT lab (rounds/timeouts.py's docstring)."""
    timeout, late = 10.0, 0.7
    config = AveragingConfig(part_timeout=timeout, request_timeout=1.0, measure_bandwidth=True, aggregator="mean")
    tensors = [torch.randn(1_000_000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    async with averagers(3, config) as made:
        owners = [member(a, 1.0) for a in made[:2]]
        client = MemberInfo(made[2].host.peer_id, (), 1.0, 0.0, True)
        gone = MemberInfo(Identity.generate().peer_id, (), 1.0, 0.0, True)
        group = GroupInfo.create("run", 0, (*owners, client, gone))
        formed = time.monotonic()
        made[2]._formed[group.group_id] = formed  # as form_group notes it for the rounds it returns

        async def late_client() -> tuple[list[torch.Tensor], Any]:
            await asyncio.sleep(late * timeout)
            return await made[2].run_round(group, [tensors[2]])

        outcomes = await asyncio.gather(*(a.run_round(group, [t]) for a, t in zip(made[:2], tensors, strict=False)),
                                        late_client())  # fmt: skip
        lasted = time.monotonic() - formed
    results = [averaged[0] for averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(sorted(inc) == [0, 1, 2] for _, report in outcomes for inc in report.contributions.values())
    # member 2's round on its own clock stayed under the part timeout: a rule of our own clock alone
    # would have taken it as a measurement
    own_s = lasted - late * timeout
    assert own_s < timeout, (own_s, lasted)
    assert (made[2].link.up, made[2].link.down, made[2].link.busy) == (None, None, None)
