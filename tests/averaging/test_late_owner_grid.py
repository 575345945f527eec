"""A grid owner stalled between its group's formation and its round (a SIGSTOPped process) must
not end the round with a result of its own sub-part that the others did not take: the grid
round checks it with the group as the flat round does (rounds/confirm.py).

Twelve members average over a grid of 3 rows x 4 columns; member STALLED owns (0, 1). The others'
frames to it (their row's slices of part 1, the column's row partials of sub-part 0, their ENDs
and, once they gave up on its answer, their CANCELs) wait in its socket buffers and are read, a
frame at a time, once it wakes, right as its round begins. The others took part 1 from row 1's
owner of it, and sub-part (1, 0) from that owner's reduction without row 0's partial.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds.grid import GridRound
from tests.averaging.rounds import MakeGroup, Member
from tests.averaging.stall import Stall

pytestmark = pytest.mark.swarm  # grid rounds of 12 members on real sockets, stalled on purpose: 8-11 s each

N, NUMEL, STALLED = 12, 50_003, 1
# the stalled round's part timeout: the others give up on the stalled owner's answers after a few;
# two seconds, so that the members that are not stalled still reach each other on a busy machine
TIMEOUT = 2.0
LINGER = 10.0  # how long a finished round still serves its results (the registry's part timeout)
GRID = {"max_group_size": 4, "block_size": 1024, "chunk_elements": 4096}


def vectors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=gen)
    return [base + 0.1 * torch.randn(NUMEL, generator=gen) for _ in range(N)]  # no outliers: nobody clipped


def start(m: Member, group: GroupInfo, vector: torch.Tensor, config: AveragingConfig, **kwargs: Any) -> GridRound:
    return GridRound(m.host, m.registry, group, vector, config, **kwargs)


async def stalled_grid_round(
    make_group: MakeGroup, **settings: Any
) -> tuple[list[tuple[torch.Tensor, Any]], tuple[torch.Tensor, Any] | BaseException, GridRound]:
    """After a warm-up round, member STALLED stalls from the group's formation until the others'
    rounds are over, then runs its own: the others' outcomes, the stalled member's outcome (or
    its error), its round."""
    group, members = await make_group(
        N, part_timeout=LINGER, request_timeout=TIMEOUT, bandwidths=[100.0] * N, **GRID, **settings
    )
    # a first round, with the members' own timeouts: every pair of members is connected now
    rounds = [start(m, group, v, m.config) for m, v in zip(members, vectors(0), strict=True)]
    warm = await asyncio.gather(*(r.run() for r in rounds))
    assert all(torch.equal(r, warm[0][0]) for r, _ in warm)
    configs = [dataclasses.replace(m.config, part_timeout=TIMEOUT) for m in members]

    group = GroupInfo.create("run", 1, group.members)
    formed_at = time.monotonic()  # every member learns of the group now; the stalled one is paused then
    inputs = vectors(1)
    stall = Stall(members[STALLED].host)
    others = [start(members[i], group, inputs[i], configs[i]).run() for i in range(N) if i != STALLED]
    outcomes = await asyncio.gather(*others)
    late = start(members[STALLED], group, inputs[STALLED], configs[STALLED], formed_at=formed_at)
    assert late.grid.owners[0][1] == STALLED
    running = asyncio.ensure_future(late.run())
    await asyncio.sleep(0)  # the round joins its registry before the first frame is read
    await stall.wake()
    try:
        outcome: tuple[torch.Tensor, Any] | BaseException = await running
    except Exception as e:
        outcome = e
    return outcomes, outcome, late


@pytest.mark.timeout(90)
@pytest.mark.parametrize("aggregator", ["robust", "mean"])
async def test_a_grid_owner_stalled_before_its_round_ends_it_with_the_groups_result(
    make_group: MakeGroup, aggregator: str
) -> None:
    outcomes, outcome, late = await stalled_grid_round(make_group, aggregator=aggregator)
    results = [r for r, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the members that were not stalled disagree"
    key = 1 * late.grid.rows + 0  # sub-part (column 1, row 0): the stalled owner's own
    taken = outcomes[0][1].contributions[key]
    assert not set(late.grid.row_members[0]) & set(taken), "the backup reduced it without row 0's partial"
    assert not isinstance(outcome, BaseException), f"the stalled owner's round failed: {outcome!r}"
    result, report = outcome
    assert report.contributions[key] == taken, "it took its own reduction of its sub-part"
    assert torch.equal(result, results[0]), "the stalled owner ended the round with another result"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dead", [1, 5])
async def test_an_owner_whose_only_column_partner_is_dead_keeps_its_result(make_group: MakeGroup, dead: int) -> None:
    # 2 rows x 4 columns: column 1's owners are members 1 and 5. The survivor misses the dead
    # one's row partial, so it asks the column whether its result holds; the only voter is gone,
    # so nobody took the sub-part over from it: its result stands (not "nobody confirms it")
    n = 8
    group, members = await make_group(n, part_timeout=2.0, bandwidths=[100.0] * n, aggregator="mean", **GRID)
    gen = torch.Generator().manual_seed(3)
    vectors = [torch.randn(NUMEL, generator=gen) for _ in range(n)]
    rounds = [start(m, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    assert rounds[0].grid.owners[0][1] == 1 and rounds[0].grid.owners[1][1] == 5
    await members[dead].host.close()
    outcomes = await asyncio.gather(*(r.run() for i, r in enumerate(rounds) if i != dead))
    assert all(torch.equal(r, outcomes[0][0]) for r, _ in outcomes)
    assert all(dead not in inc for inc in outcomes[0][1].contributions.values())
