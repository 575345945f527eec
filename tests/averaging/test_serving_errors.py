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
