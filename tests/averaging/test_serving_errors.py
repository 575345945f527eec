"""A part that cannot be reduced (too few contributions) is answered to its senders with a typed
error, so each goes on to its next reducer; the owner logs no handler traceback for it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from swarm.averaging.rounds.flat import AllReduceRound
from tests.averaging.rounds import EXACT, MakeGroup


@pytest.mark.timeout(60)
async def test_a_part_with_too_few_contributions_is_refused_to_its_senders_with_a_typed_error(
    make_group: MakeGroup, caplog: pytest.LogCaptureFixture
) -> None:
    group, members = await make_group(3, min_group_size=3, part_timeout=1.0, request_timeout=1.0, **EXACT)
    gen = torch.Generator().manual_seed(3)
    rounds = [AllReduceRound(m.host, m.registry, group, torch.randn(6_000, generator=gen), m.config)
              for m in members]  # fmt: skip
    await members[2].host.close()  # its slices never come: every part has 2 contributions of the 3 needed
    with caplog.at_level(logging.INFO):
        outcomes = await asyncio.gather(rounds[0].run(), rounds[1].run(), return_exceptions=True)
    assert all(isinstance(o, Exception) for o in outcomes), outcomes  # no part could be reduced
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a handler failed unexpectedly"
    refusals = [r.getMessage() for r in caplog.records if "via member" in r.getMessage()]
    assert any("[not_found]" in m and "could not be reduced here" in m for m in refusals), refusals


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation", [EXACT, {"aggregator": "robust", "audit": True}], ids=["mean", "robust+audit"])
async def test_an_owner_whose_senders_all_came_late_takes_its_part_from_its_backup(
    make_group: MakeGroup, aggregation: dict[str, object]
) -> None:
    """The slices for part 1 reach its owner only after its wait ran out (a busy machine: they
    began their rounds seconds after it). The owner refuses them, they go to the backup (2), and
    the owner, alive and without a result of its own part, sends its slice there too: all four
    finish the round with one result, the owner's slice in it. (Refused by the backup as a sender
    it did not expect, the owner failed the round that the other three finished.)"""
    n, owner = 4, 1
    group, members = await make_group(n, min_group_size=2, part_timeout=1.0, request_timeout=1.0, **aggregation)
    gen = torch.Generator().manual_seed(7)
    vectors = [torch.randn(8_000, generator=gen) for _ in range(n)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]

    def late_to_the_owner(r: AllReduceRound) -> None:
        honest = r._exchange

        async def exchange(reducer: int, j: int) -> object:
            if reducer == owner and j == owner:
                await asyncio.sleep(1.3)  # past the owner's wait of one part timeout
            return await honest(reducer, j)

        r._exchange = exchange  # type: ignore[method-assign]

    for i, r in enumerate(rounds):
        if i != owner:
            late_to_the_owner(r)
    outcomes = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    results = [o[0] for o in outcomes]  # type: ignore[index]
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    assert rounds[owner].reducer_of[owner] == 2  # the backup's result, not its own
    assert owner in outcomes[0][1].contributions[owner]  # type: ignore[index]
    assert not [o[1].audit_excluded for o in outcomes if o[1].audit_excluded]  # type: ignore[index]
