"""A part owner stalled between its group's formation and its round (a SIGSTOPped process) must
not end the round with a result of its own part that the others did not take (rounds/confirm.py).

The stall is the process's: the others' frames to it (their slices of its part, their END, then,
once they give up on its answer, their CANCEL) wait in its socket buffers and are read, a frame at
a time, once it wakes, right as its round begins. The others gave up on it two part timeouts into
the round and took its part from the backup (the next member), reduced without its slice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds.confirm import Decision, Vote, decide, parse_vote
from swarm.averaging.rounds.flat import AllReduceRound
from tests.averaging.rounds import MakeGroup, Member
from tests.averaging.stall import Stall

NUMEL, STALLED = 40_000, 1
TIMEOUT = 1.0  # the rounds' part timeout: the others give up on the stalled owner's answer after twice this
LINGER = 5.0  # how long a finished round still serves its results (the registry's part timeout)


OURS, THEIRS, FAKE = b"o" * 32, b"t" * 32, b"f" * 32


@pytest.mark.parametrize(
    ("votes", "voters", "expected", "why"),
    [
        ({}, 3, Decision("open"), "nobody answered yet"),
        ({0: Vote(OURS, 1)}, 3, Decision("open"), "another result could still win 2 of 3"),
        ({0: Vote(OURS, 1), 2: Vote(OURS, 1)}, 3, Decision("ours"), "the group holds ours"),
        ({0: Vote(THEIRS, 2), 2: Vote(THEIRS, 2)}, 3, Decision("adopt", THEIRS, 2), "a majority took the backup's"),
        (
            {0: Vote(THEIRS, 2), 2: Vote(THEIRS, 0), 3: Vote(THEIRS, 2)},
            3,
            Decision("adopt", THEIRS, 2),
            "the reducer most voters name",
        ),
        (
            {0: Vote(OURS, 1), 2: Vote(THEIRS, 2), 3: Vote(THEIRS, 2)},
            3,
            Decision("adopt", THEIRS, 2),
            "one member we answered in time is outvoted",
        ),
        ({0: Vote(FAKE, 3), 2: Vote(OURS, 1), 3: None}, 3, Decision("ours"), "one liar is no majority"),
        ({0: Vote(FAKE, 3), 2: None, 3: None}, 3, Decision("none"), "nobody confirms ours: fail"),
        ({0: None, 2: None}, 2, Decision("none"), "the others' rounds are gone: fail"),
        ({0: Vote(OURS, 1)}, 1, Decision("ours"), "a group of two"),
        ({0: Vote(FAKE, 0), 2: Vote(FAKE, 0), 3: Vote(OURS, 1)}, 5, Decision("open"), "2 of 5 are no majority yet"),
    ],
)
def test_decide(votes: dict[int, Vote | None], voters: int, expected: Decision, why: str) -> None:
    assert decide(OURS, votes, voters) == expected, why


@pytest.mark.parametrize(
    ("votes", "voters", "gone", "expected", "why"),
    [
        ({0: None}, 1, 1, Decision("ours"), "the only other owner of a grid column is dead: nobody took it over"),
        ({0: None, 2: None}, 2, 2, Decision("ours"), "every voter is gone"),
        ({0: None, 2: None}, 2, 1, Decision("none"), "one voter is alive and holds nothing of ours: fail"),
        ({0: None, 2: Vote(THEIRS, 2), 3: Vote(THEIRS, 2)}, 3, 1, Decision("adopt", THEIRS, 2), "a dead voter"),
        ({0: None}, 3, 1, Decision("open"), "the others may still hold another result"),
        ({0: None}, 2, 1, Decision("open"), "the other voter may still hold ours"),
        ({0: None}, 2, 0, Decision("open"), "one voter without ours: the other may still hold it"),
    ],
)
def test_decide_with_gone_voters(
    votes: dict[int, Vote | None], voters: int, gone: int, expected: Decision, why: str
) -> None:
    assert decide(OURS, votes, voters, gone) == expected, why


def test_a_vote_is_checked() -> None:
    assert parse_vote({"d": THEIRS, "by": 2}, 4) == Vote(THEIRS, 2)
    assert parse_vote({"inc": [0, 1]}, 4) is None  # a peer that answered as to a plain avg.fetch
    for bad in ({"d": b"short", "by": 2}, {"d": THEIRS, "by": 4}, {"d": THEIRS, "by": True}, {"d": "x", "by": 0}):
        with pytest.raises(AllReduceError):
            parse_vote(bad, 4)


def vectors(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=gen)
    return [base + 0.1 * torch.randn(NUMEL, generator=gen) for _ in range(n)]  # no outliers: nobody clipped


def start(
    member: Member, group: GroupInfo, vector: torch.Tensor, config: AveragingConfig, **kwargs: Any
) -> AllReduceRound:
    return AllReduceRound(member.host, member.registry, group, vector, config, **kwargs)


async def stalled_round(
    make_group: MakeGroup, n: int, clients: int, waits_long: int | None
) -> tuple[list[int], list[tuple[torch.Tensor, Any]], tuple[torch.Tensor, Any]]:
    """A group of n (the last `clients` in client mode) after a warm-up round; member STALLED
    stalls from the group's formation until the others' rounds are over, then runs its own.
    `waits_long`: a member that waits ten times longer for an owner's answer (it is answered
    before it gives up on the stalled owner). The others' indices, their outcomes, the stalled
    member's outcome."""
    group, members = await make_group(
        n, clients=clients, part_timeout=LINGER, request_timeout=TIMEOUT, chunk_elements=4096, bandwidths=[100.0] * n
    )
    configs = [dataclasses.replace(m.config, part_timeout=TIMEOUT) for m in members]
    if waits_long is not None:
        configs[waits_long] = dataclasses.replace(configs[waits_long], part_timeout=10 * TIMEOUT)
    # a first round: every pair of members is connected, as in a swarm that has run a while
    warm = await asyncio.gather(
        *(start(m, group, v, c).run() for m, v, c in zip(members, vectors(n, 0), configs, strict=True))
    )
    assert all(torch.equal(r, warm[0][0]) for r, _ in warm)

    group = GroupInfo.create("run", 1, group.members)
    formed_at = time.monotonic()  # every member learns of the group now; the stalled one is paused then
    inputs = vectors(n, 1)
    stall = Stall(members[STALLED].host)
    others = [i for i in range(n) if i != STALLED]
    tasks = {i: asyncio.ensure_future(start(members[i], group, inputs[i], configs[i]).run()) for i in others}
    prompt = [i for i in others if i != waits_long]
    await asyncio.wait([tasks[i] for i in prompt])
    # the owner wakes: its round begins as its buffers are read
    late = asyncio.ensure_future(
        start(members[STALLED], group, inputs[STALLED], configs[STALLED], formed_at=formed_at).run()
    )
    await asyncio.sleep(0)  # the round joins its registry before the first frame is read
    await stall.wake()
    outcomes = await asyncio.gather(*(tasks[i] for i in others))
    return others, outcomes, await late


@pytest.mark.timeout(60)
async def test_an_owner_stalled_before_its_round_ends_it_with_the_groups_result(make_group: MakeGroup) -> None:
    _, outcomes, (result, report) = await stalled_round(make_group, 4, clients=0, waits_long=None)
    results = [r for r, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the members that were not stalled disagree"
    contributions = outcomes[0][1].contributions
    assert STALLED not in contributions[STALLED], "the backup reduced the stalled owner's part without it"
    assert report.contributions[STALLED] == contributions[STALLED], "it took its own reduction of its part"
    assert torch.equal(result, results[0]), "the stalled owner ended the round with another result"


@pytest.mark.timeout(60)
async def test_a_member_the_late_owner_answered_takes_the_groups_result_and_blames_nobody(
    make_group: MakeGroup,
) -> None:
    # member 3 (a client: it owns no part that the others would wait for) waits long enough for
    # the stalled owner's answer; members 0 and 2 gave up on it and took its part from member 2
    others, outcomes, (result, _) = await stalled_round(make_group, 4, clients=1, waits_long=3)
    by = dict(zip(others, outcomes, strict=True))
    assert STALLED not in by[0][1].contributions[STALLED]
    for i in others:
        assert torch.equal(by[i][0], by[0][0]), f"member {i} ended the round with another result"
        assert by[i][1].audit_excluded == [], f"member {i} excluded an owner that was only late"
    assert torch.equal(result, by[0][0])
